"""``POST /generate``: a language model's own route (registered by :func:`attnkit.serve.app.create_app`).

:func:`generate_text` checks the request as ``attnkit generate`` checks its options, makes it a
:class:`~attnkit.serve.generation.GenerationJob` and sends it on its way as a :class:`~attnkit.serve.flights.Flight`
(counted against ``max_streams``, 429 beyond; queued, 503 when the queue is full), then answers with the whole text
or, with ``stream``, with server-sent events, one per token as the worker chooses it. A client that goes away
cancels its job: its row leaves the running batch at the next step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

from fastapi import Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from ..engine.continuous_lm import Sampling
from .batching import Limits
from .flights import EventStream, Failure, Flight, event, new_job
from .generation import Generated, GenerationJob
from .routing import app_state, attention_jsons, pick, run_on_worker, with_attention
from .schemas import GenerateRequest, GenerateResponse
from .servables import Servable

__all__ = ["generate_text"]


async def generate_text(req: GenerateRequest, request: Request) -> GenerateResponse | Response:
    state = app_state(request)
    servable = pick(state, req.model, "generate")
    job = _generation_job(req, servable, state.limits)
    flight = Flight(request, servable, [job], req.stream)
    if req.stream:
        return EventStream(flight, _events(flight))
    (result,) = await flight.results()
    response = GenerateResponse(model=servable.info.name, text=result.text, tokens=result.tokens,
                                prompt_tokens=result.prompt_tokens, finish_reason=result.finish_reason,
                                seed=result.seed)
    if not req.attention:
        return response
    maps = partial(servable.attention, beam=1, lenpen=0.0, target=result.text)  # the continuation after the prompt
    attention = await run_on_worker(request, servable, ("attention",), partial(attention_jsons, maps), [req.prompt])
    return with_attention(response, attention, sent=state.workers[servable.info.name].release_soon, one=True)


def _generation_job(req: GenerateRequest, servable: Servable, limits: Limits) -> GenerationJob:
    """The request as the worker runs it, checked as ``attnkit generate`` checks its options
    (:func:`~attnkit.serve.flights.new_job`).

    :raises HTTPException: 413 for a prompt longer than ``max_chars``, 422 for the rest.
    """
    if len(req.prompt) > limits.max_chars:
        raise HTTPException(413, f"prompt: {len(req.prompt)} characters, more than the limit {limits.max_chars} "
                                 "(--max-chars); shorten it")
    if req.stream and req.attention:
        raise HTTPException(422, "attention: not with stream; ask for the attention in a request without stream")
    return new_job(servable, limits, partial(_prompt_ids, servable, req.prompt, req.beyond_context),
                   max_new_tokens=req.max_new_tokens, sampling=Sampling(req.temperature, req.top_k, req.top_p),
                   seed=req.seed, stop=tuple(req.stop))


def _prompt_ids(servable: Servable, prompt: str, beyond_context: bool, max_new_tokens: int | None, default: int
                ) -> tuple[list[int], int]:
    return servable.prompt_ids(prompt, max_new_tokens, default, beyond_context)


async def _events(flight: Flight) -> AsyncIterator[bytes]:
    """A streamed request's events: ``{"token", "id"}`` per token as the worker chooses it, then the counts and
    ``finish_reason`` (or ``{"error"}``). Closed early (the client went away), it cancels the job."""
    try:
        async for told in flight.happenings():
            out = []
            for _, item in told:
                if isinstance(item, dict):
                    out.append(event(item))
                elif isinstance(item, Failure):
                    out.append(event({"error": item.message}))
                else:
                    out.append(event(_counts(item)))
            yield b"".join(out)
    finally:
        flight.close()


def _counts(result: Generated) -> dict:
    return {"text": result.text, "tokens": result.tokens, "prompt_tokens": result.prompt_tokens,
            "finish_reason": result.finish_reason, "seed": result.seed}
