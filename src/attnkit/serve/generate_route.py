"""``POST /generate``: a language model's route (registered by :func:`attnkit.serve.app.create_app`), and how a
request becomes a :class:`~attnkit.serve.generation.GenerationJob` on the model's worker.

:func:`generate_text` checks the request as ``attnkit generate`` checks its options, counts it against
``max_streams`` (429 beyond), queues it (503 when the queue is full), then answers with the whole text or, with
``stream``, with server-sent events, one per token as the worker chooses it. A client that goes away cancels its
job: its row leaves the running batch at the next step.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import deque
from functools import partial
from typing import Any
from weakref import WeakKeyDictionary

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from ..common.errors import UserError
from ..engine.continuous_lm import Sampling
from ..inference.language_model import DEFAULT_NEW_TOKENS, check_sampling
from .batching import Limits, QueueFull
from .generation import Generated, GenerationJob
from .metrics import GONE, TIMING
from .routing import (
    RETRY_AFTER,
    AppState,
    app_state,
    attention_jsons,
    log_internal_error,
    pick,
    run_on_worker,
    with_attention,
)
from .schemas import GenerateRequest, GenerateResponse
from .servables import Servable

__all__ = ["generate_text"]


class _EventStream(StreamingResponse):
    """The events of a streamed request. Whatever ends the response (the events' end, an error, or the client going
    away before the first event, when the events' own ``finally`` never runs), the job is cancelled and its stream
    slot given back (both idempotent)."""

    def __init__(self, job: GenerationJob, future: asyncio.Future, stream: _Stream, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.job, self.future, self.stream = job, future, stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.future.done():
                self.job.cancel()
                self.future.cancel()
            self.stream.close()


async def generate_text(req: GenerateRequest, request: Request) -> GenerateResponse | Response:
    state = app_state(request)
    servable = pick(state, req.model, "generate")
    job = _generation_job(req, servable, state.limits)
    stream = _Stream(state, servable.info.name)  # 429 beyond --max-streams
    queue: asyncio.Queue | None = None
    if req.stream:  # the worker tells each token as it is chosen (set before the job is queued)
        outbox, queue = _outbox(asyncio.get_running_loop()), asyncio.Queue()
        job.emit = partial(outbox.put, queue)
    try:
        future = _submit_generation(request, servable, job)
    except BaseException:
        stream.close()
        raise
    if queue is not None:
        return _EventStream(job, future, stream, _events(request, servable, job, future, queue, stream),
                            media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        result = await _generated(request, servable, job, future)
    finally:
        stream.close()
    response = GenerateResponse(model=servable.info.name, text=result.text, tokens=result.tokens,
                                prompt_tokens=result.prompt_tokens, finish_reason=result.finish_reason,
                                seed=result.seed)
    if not req.attention:
        return response
    maps = partial(servable.attention, beam=1, lenpen=0.0, target=result.text)  # the continuation after the prompt
    attention = await run_on_worker(request, servable, ("attention",), partial(attention_jsons, maps), [req.prompt])
    return with_attention(response, attention, sent=state.workers[servable.info.name].release_soon, one=True)


def _as_fields(message: str) -> str:
    """A check's message written for ``attnkit generate``'s options (``--top-p``), naming the request's fields
    (``top_p``) instead."""
    return re.sub(r"--([a-z]+(?:-[a-z]+)*)", lambda m: m[1].replace("-", "_"), message)


def _generation_job(req: GenerateRequest, servable: Servable, limits: Limits) -> GenerationJob:
    """The request as the worker runs it, checked as ``attnkit generate`` checks its options.

    :raises HTTPException: 413 for a prompt longer than ``max_chars``, 422 for the rest.
    """
    if len(req.prompt) > limits.max_chars:
        raise HTTPException(413, f"prompt: {len(req.prompt)} characters, more than the limit {limits.max_chars} "
                                 "(--max-chars); shorten it")
    if req.stream and req.attention:
        raise HTTPException(422, "attention: not with stream; ask for the attention in a request without stream")
    cap = limits.max_new_tokens
    n = req.max_new_tokens
    if n is not None and not 0 < n <= cap:
        raise HTTPException(422, f"max_new_tokens must be in 1..{cap} (this server's --max-new-tokens), got {n}")
    if req.seed is not None and not servable.seeded:
        raise HTTPException(422, f"seed: {servable.info.name!r} is a CTranslate2 export, which samples from one "
                                 "generator for the whole server; leave seed out, or serve its run directory")
    try:
        check_sampling(req.temperature, req.top_k, req.top_p)
        ids, n = servable.prompt_ids(req.prompt, n, min(DEFAULT_NEW_TOKENS, cap), req.beyond_context)
    except UserError as e:
        raise HTTPException(422, _as_fields(str(e))) from None
    return GenerationJob(ids, n, Sampling(req.temperature, req.top_k, req.top_p), req.seed, tuple(req.stop))


class _Outbox:
    """The worker's hand-over of streamed tokens to the event loop. A decoding step chooses a token for every
    streamed row; they reach the loop with one wake-up per step, not one each (``call_soon_threadsafe`` writes to
    the loop's self-pipe at every call, and each wake-up takes the GIL from the worker). Order holds: a pending
    drain was scheduled before whatever the worker hands over after it (a job's answer), so it runs first."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.pending, self.scheduled = loop, deque(), False

    def put(self, queue: asyncio.Queue, event: dict) -> None:
        """(The worker thread.) ``event`` for ``queue``; wakes the loop unless a drain is already on its way."""
        self.pending.append((queue, event))
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self.scheduled = False  # before draining: an event put meanwhile is drained now or schedules another drain
        while self.pending:
            queue, event = self.pending.popleft()
            queue.put_nowait(event)


_OUTBOXES: WeakKeyDictionary[asyncio.AbstractEventLoop, _Outbox] = WeakKeyDictionary()


def _outbox(loop: asyncio.AbstractEventLoop) -> _Outbox:
    """The event loop's :class:`_Outbox` (one per loop, made on its first streamed request)."""
    if loop not in _OUTBOXES:
        _OUTBOXES[loop] = _Outbox(loop)
    return _OUTBOXES[loop]


class _Stream:
    """A generation in flight, counted against ``max_streams`` from its acceptance until :meth:`close` (event
    loop only)."""

    def __init__(self, state: AppState, model: str) -> None:
        if state.streams[model] >= state.limits.max_streams:
            raise HTTPException(429, f"model {model!r} is generating {state.streams[model]} texts, the limit "
                                     "(--max-streams); retry shortly", headers={"Retry-After": str(RETRY_AFTER)})
        state.streams[model] += 1
        self.state, self.model, self.open = state, model, True

    def close(self) -> None:
        if self.open:
            self.open = False
            self.state.streams[self.model] -= 1


def _submit_generation(request: Request, servable: Servable, job: GenerationJob) -> asyncio.Future:
    """Queue ``job`` on the model's worker: it joins the running batch (a run), or the jobs of the same options
    that arrive with it (an export)."""
    state, name = app_state(request), servable.info.name
    stepper = servable.stepper
    key = ("generate",) if stepper is not None else ("generate", job.max_new_tokens, job.sampling)
    try:
        future = state.workers[name].submit(key, servable.generate, [job], [len(job.ids)], stepper)
    except QueueFull:
        raise HTTPException(503, f"model {name!r} is busy ({state.limits.max_queue} texts queued, --max-queue); "
                                 "retry shortly", headers={"Retry-After": str(RETRY_AFTER)}) from None
    state.metrics.job_queued(request.scope.get(TIMING), name)
    return future


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body was read already: what comes next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _generated(request: Request, servable: Servable, job: GenerationJob, future: asyncio.Future) -> Generated:
    """The job's result; a client that goes away first cancels it (its row leaves the batch at the next step)."""
    state, timing = app_state(request), request.scope.get(TIMING)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({future, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not future.done():
            job.cancel()
            future.cancel()
            raise HTTPException(GONE, "the client went away")  # nobody reads it; counted in the metrics
        state.metrics.job_answered(timing)
        try:
            result = future.result()[0]
        except UserError as e:
            raise HTTPException(422, str(e)) from None
    finally:
        gone.cancel()
    state.metrics.generation(servable.info.name, timing, job, result)
    return result


#: ``json.dumps(data, ensure_ascii=False)``, with one encoder for all events (``json.dumps`` builds an encoder per
#: call when given options: per token and stream, on the event loop).
_encode = json.JSONEncoder(ensure_ascii=False).encode


def _event(data: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + _encode(data).encode() + b"\n\n"


async def _events(request: Request, servable: Servable, job: GenerationJob, future: asyncio.Future,
                  queue: asyncio.Queue, stream: _Stream):
    """A streamed request's events: ``{"token", "id"}`` per token as the worker chooses it, then the counts and
    ``finish_reason`` (or ``{"error"}``). Closed early (the client went away), it cancels the job."""
    state, timing = app_state(request), request.scope.get(TIMING)
    future.add_done_callback(queue.put_nowait)  # after its tokens: the worker settles the future after emitting them
    try:
        while True:  # the events waiting go out as one chunk (a client that fell behind catches up in one write)
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            ended = items[-1] is future  # the last item ever queued
            if len(items) > ended:
                yield b"".join(_event(item) for item in items[:len(items) - ended])
            if ended:
                break
        state.metrics.job_answered(timing)
        try:
            result: Generated = future.result()[0]
        except UserError as e:
            yield _event({"error": str(e)})
            return
        except Exception as e:  # a bug met by this job alone: the stream has begun, so it ends with the error
            log_internal_error("POST /generate (streamed)", e)
            yield _event({"error": f"internal error ({type(e).__name__})"})
            return
        state.metrics.generation(servable.info.name, timing, job, result)
        yield _event({"text": result.text, "tokens": result.tokens, "prompt_tokens": result.prompt_tokens,
                      "finish_reason": result.finish_reason, "seed": result.seed})
    finally:
        if not future.done():
            job.cancel()
            future.cancel()
        stream.close()
