"""The OpenAI-compatible API of ``attnkit serve``: a language model answers the routes every server of small language
models speaks (llama.cpp's, vLLM, TGI, Ollama), so the ``openai`` Python package, LangChain and curl scripts work
unchanged (registered by :func:`register`, beside ``POST /generate``).

===============================  ==================================================================================
endpoint                         what it does
===============================  ==================================================================================
``GET /v1/models``               the language models served: ``{"object": "list", "data": [{"id", "object":
                                 "model", "created", "owned_by"}]}``; ``GET /v1/models/{id}`` one of them
``POST /v1/completions``         continue ``prompt`` (a text, or a list of texts): ``POST /generate``'s text for the
                                 same seed and options, as OpenAI's ``text_completion``
``POST /v1/chat/completions``    answer ``messages``, laid out by the model's chat template as ``attnkit chat`` lays
                                 them out, stopping at its end of turn: ``attnkit chat --once``'s answer for the
                                 same seed, as OpenAI's ``chat.completion``
===============================  ==================================================================================

Both take ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature`` (default 1, OpenAI's), ``top_p``,
``stop`` (a string or a list), ``seed``, ``n`` and ``stream`` (with ``stream_options.include_usage``), and answer
``usage`` (``prompt_tokens``, ``completion_tokens``, ``total_tokens``) and each choice's ``finish_reason``: ``stop``
(``</s>``, the end of turn or a stop string) or ``length``. With ``stream``, the answer is server-sent events: a
chunk per token that shows text (chat: a first chunk with the role), a last chunk of each choice with its
``finish_reason``, then ``data: [DONE]``.

**The same path as /generate.** Each choice is a :class:`~attnkit.serve.generation.GenerationJob` checked by
:func:`~attnkit.serve.flights.new_job` (the same checks and limits, naming OpenAI's fields) and run as a
:class:`~attnkit.serve.flights.Flight` on the model's worker, by continuous batching: ``n`` choices are ``n`` rows
of the running batch, sampled with the seeds ``seed``, ``seed + 1``, ... (each counts against ``--max-streams``), so
asking for several costs a row each and no second prompt format. What holds for ``/generate`` holds here: a request
whose row fails ends alone (a 500, or streamed, an error event), and a client that goes away cancels its rows.

**Errors** are OpenAI's shape (:mod:`attnkit.serve.openai_schemas`): 400 for a field at fault (named in ``param``),
404 ``model_not_found``, 401 ``invalid_api_key``, 413, 429 and 503 as ``/generate`` answers them. A model without a
chat template answers ``/v1/chat/completions`` with a 400 that says so (``/v1/completions`` still continues text).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..engine.continuous_lm import Sampling
from .flights import EventStream, Failure, Flight, encode_json, event, new_job
from .generation import Generated, GenerationJob
from .openai_schemas import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ModelCard,
    ModelList,
    Usage,
    error_body,
)
from .routing import AppState, app_state
from .servables import Servable

__all__ = ["register"]

#: OpenAI's ``finish_reason`` for each of a job's ends (the end of turn is ``eos``).
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
#: The last event of every stream.
DONE = b"data: [DONE]\n\n"
#: A placeholder for a chunk's text: the JSON around it is made once per choice (:func:`_around`).
_MARK = "\x00"


def register(app: FastAPI) -> None:
    """Add the routes to ``app`` (the module doc's table)."""
    app.get("/v1/models", response_model=ModelList)(list_models)
    app.get("/v1/models/{model_id}", response_model=ModelCard)(retrieve_model)
    app.post("/v1/completions", response_model=Completion)(completions)
    app.post("/v1/chat/completions", response_model=ChatCompletion)(chat_completions)


def _served(state: AppState) -> dict[str, Servable]:
    return state.routes.get("generate", {})


def _card(state: AppState, name: str) -> ModelCard:
    return ModelCard(id=name, created=int(state.loaded))


async def list_models(request: Request) -> ModelList:
    state = app_state(request)
    return ModelList(data=[_card(state, name) for name in sorted(_served(state))])


async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    state = app_state(request)
    _model(state, model_id)
    return _card(state, model_id)


def _model(state: AppState, name: str | None) -> Servable:
    """The language model a request names (or the only one served).

    :raises APIError: 404 ``model_not_found`` (a model that is not a language model too), 400 without a name when
        several are served.
    """
    served = _served(state)
    if name is None:
        if len(served) == 1:
            return next(iter(served.values()))
        raise APIError(400, f"model: give the model's id, one of {sorted(served)}", param="model")
    if name not in served:
        other = state.models.get(name)
        why = f"is a {other.info.task} model (POST /{other.info.task})" if other else "is not served here"
        raise APIError(404, f"model {name!r} {why}; GET /v1/models lists {sorted(served)}", param="model",
                       code="model_not_found")
    return served[name]


async def completions(req: CompletionRequest, request: Request) -> Completion | Response:
    state = app_state(request)
    servable = _model(state, req.model)
    limits = state.limits
    prompts = req.prompt
    if len(prompts) > limits.max_texts:
        raise APIError(413, f"prompt: {len(prompts)} prompts, more than the limit {limits.max_texts} (--max-texts); "
                            "send them in several requests", param="prompt")
    jobs: list[GenerationJob] = []
    for i, prompt in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if len(prompt) > limits.max_chars:
            raise APIError(413, f"{where}: {len(prompt)} characters, more than the limit {limits.max_chars} "
                                "(--max-chars); shorten it", param="prompt")
        ids = _ids_of(servable.prompt_ids, prompt, req.beyond_context)
        jobs += _choices(req, servable, state, ids, req.stops, frozenset())
    return await _answer(request, servable, req, jobs, chat=False)


async def chat_completions(req: ChatCompletionRequest, request: Request) -> ChatCompletion | Response:
    state = app_state(request)
    servable = _model(state, req.model)
    messages = [m.for_template() for m in req.messages]
    chars = sum(len(m["content"]) for m in messages)
    if chars > state.limits.max_chars:
        raise APIError(413, f"messages: {chars} characters in all, more than the limit {state.limits.max_chars} "
                            "(--max-chars); shorten the conversation", param="messages")
    stop_ids, stop_texts = servable.end_of_turn
    jobs = _choices(req, servable, state, _ids_of(servable.chat_ids, messages, req.beyond_context),
                    req.stops + stop_texts, stop_ids)
    return await _answer(request, servable, req, jobs, chat=True)


def _ids_of(ids: Callable[..., tuple[list[int], int]], prompt: Any, beyond_context: bool
            ) -> Callable[[int | None, int], tuple[list[int], int]]:
    """``new_job``'s ``prompt``: the servable's ``prompt_ids`` or ``chat_ids`` of ``prompt``."""
    return lambda max_new_tokens, default: ids(prompt, max_new_tokens, default, beyond_context)


def _choices(req: CompletionRequest | ChatCompletionRequest, servable: Servable, state: AppState,
             prompt: Callable[[int | None, int], tuple[list[int], int]], stop: tuple[str, ...],
             stop_ids: frozenset[int]) -> list[GenerationJob]:
    """The ``n`` jobs of one prompt, checked once (``new_job``), seeded ``seed``, ``seed + 1``, ..."""
    max_tokens, field = req.max_tokens, "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
    sampling = Sampling(1.0 if req.temperature is None else req.temperature, req.top_k or 0,
                        1.0 if req.top_p is None else req.top_p)
    job = new_job(servable, state.limits, prompt, max_new_tokens=max_tokens, sampling=sampling, seed=req.seed,
                  stop=stop, stop_ids=stop_ids, renamed={"max_new_tokens": field})
    seeds = [None if req.seed is None else (req.seed + i) % 2**63 for i in range(req.n or 1)]
    return [replace(job, seed=seed) for seed in seeds]


def _usage(jobs: list[GenerationJob], results: list[Generated], n: int) -> Usage:
    """Each prompt's tokens once (its ``n`` choices share it), every choice's generated tokens."""
    prompt = sum(len(job.ids) for job in jobs[::n])
    completion = sum(r.tokens for r in results)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def _answer(request: Request, servable: Servable, req: CompletionRequest | ChatCompletionRequest,
                  jobs: list[GenerationJob], chat: bool) -> Completion | ChatCompletion | Response:
    """Run ``jobs`` (the choices, in order) and answer them whole or, with ``stream``, as OpenAI's chunks."""
    limits, name = app_state(request).limits, servable.info.name
    if len(jobs) > limits.max_streams:
        raise APIError(400, f"n: {len(jobs)} choices in one request, more than this server's --max-streams "
                            f"{limits.max_streams}", param="n")
    flight = Flight(request, servable, jobs, bool(req.stream))
    answer_id, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    n = req.n or 1
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        chunk = _ChatChunks if chat else _TextChunks
        return EventStream(flight, _chunks(flight, chunk(answer_id, created, name, usage), n))
    results = await flight.results()
    usage = _usage(jobs, results, n)
    if chat:
        return ChatCompletion(id=answer_id, created=created, model=name, usage=usage, choices=[
            ChatChoice(index=i, message=AssistantMessage(content=r.text), finish_reason=FINISH[r.finish_reason])
            for i, r in enumerate(results)])
    return Completion(id=answer_id, created=created, model=name, usage=usage, choices=[
        CompletionChoice(index=i, text=r.text, finish_reason=FINISH[r.finish_reason]) for i, r in enumerate(results)])


class _TextChunks:
    """The chunks of a streamed completion (``object: text_completion``), as dicts: :meth:`text` with a piece of
    choice ``index``'s text, :meth:`end` with its ``finish_reason``, :meth:`usage` with no choices."""

    object = "text_completion"

    def __init__(self, answer_id: str, created: int, model: str, usage: bool) -> None:
        self.head = {"id": answer_id, "object": self.object, "created": created, "model": model}
        self.with_usage = usage  # every chunk then has "usage": null but the last, which has it (OpenAI's way)

    def _chunk(self, choice: dict) -> dict:
        return {**self.head, "choices": [choice], **({"usage": None} if self.with_usage else {})}

    def text(self, index: int, piece: str) -> dict:
        return self._chunk({"index": index, "text": piece, "logprobs": None, "finish_reason": None})

    def end(self, index: int, reason: str) -> dict:
        return self._chunk({"index": index, "text": "", "logprobs": None, "finish_reason": reason})

    def start(self, index: int) -> dict | None:
        return None

    def usage(self, usage: Usage) -> dict:
        return {**self.head, "choices": [], "usage": usage.model_dump()}


class _ChatChunks(_TextChunks):
    """The chunks of a streamed chat completion (``object: chat.completion.chunk``): a ``delta`` in each choice,
    the role in the first."""

    object = "chat.completion.chunk"

    def text(self, index: int, piece: str) -> dict:
        return self._chunk({"index": index, "delta": {"content": piece}, "logprobs": None, "finish_reason": None})

    def end(self, index: int, reason: str) -> dict:
        return self._chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})

    def start(self, index: int) -> dict | None:
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})


def _around(chunk: dict) -> tuple[bytes, bytes]:
    """The event of ``chunk`` (whose text is :data:`_MARK`) split around its text: a piece's event is then
    ``head + its JSON + tail``, one string encoded per token instead of the whole chunk."""
    head, tail = event(chunk).split(encode_json(_MARK).encode())
    return head, tail


async def _chunks(flight: Flight, chunks: _TextChunks, n: int) -> AsyncIterator[bytes]:
    """A streamed answer's events (module doc). A choice that fails ends the stream with OpenAI's error object
    (the other choices are cancelled), then ``[DONE]``. Closed early (the client went away), it cancels the jobs."""
    try:
        around = [_around(chunks.text(i, _MARK)) for i in range(len(flight.jobs))]
        first = [chunks.start(i) for i in range(len(flight.jobs))]
        if first[0] is not None:
            yield b"".join(event(c) for c in first)
        results: list[Generated] = []
        async for told in flight.happenings():
            out = []
            for i, item in told:
                if isinstance(item, dict):
                    if item["token"]:  # a token that shows no text yet (held back) makes no chunk
                        head, tail = around[i]
                        out.append(head + encode_json(item["token"]).encode() + tail)
                elif isinstance(item, Failure):
                    yield b"".join(out) + event(error_body(item.status, item.message)) + DONE
                    return
                else:
                    results.append(item)
                    out.append(event(chunks.end(i, FINISH[item.finish_reason])))
            yield b"".join(out)
        if chunks.with_usage:
            yield event(chunks.usage(_usage(flight.jobs, results, n)))
        yield DONE
    finally:
        flight.close()
