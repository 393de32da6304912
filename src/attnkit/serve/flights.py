"""A language model's generations seen from the event loop, shared by its two route families: ``POST /generate``
(:mod:`attnkit.serve.generate_route`) and the OpenAI-compatible routes (:mod:`attnkit.serve.openai_routes`).

=========================  =========================================================================================
name                       what it is
=========================  =========================================================================================
:func:`new_job`            a request's generation checked as ``attnkit generate`` checks its options: a
                           :class:`~attnkit.serve.generation.GenerationJob` (422 naming the request's field)
:class:`Flight`            a request's jobs from their acceptance to their end: counted against ``max_streams``
                           (429 beyond), queued on the model's worker (503 when its queue is full), then awaited
                           whole (:meth:`Flight.results`) or told as they happen (:meth:`Flight.happenings`);
                           whatever ends the request (its answer, an error, its client going away) cancels the jobs
                           still running (their rows leave the batch at the next step) and gives the slots back
:class:`EventStream`       the server-sent events of a streamed request, closing its :class:`Flight` however they end
:class:`Failure`           a job that failed, as its stream tells it (422: what the model cannot do; 500: a bug)
=========================  =========================================================================================

The worker hands each streamed token over to the event loop through one :class:`_Outbox` per loop: one wake-up per
decoding step for all the streamed rows, not one per token.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any
from weakref import WeakKeyDictionary

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from ..common.errors import UserError
from ..engine.continuous_lm import Sampling
from ..inference.language_model import DEFAULT_NEW_TOKENS, check_sampling
from .batching import Limits, QueueFull
from .generation import Generated, GenerationJob
from .metrics import GONE, TIMING
from .routing import RETRY_AFTER, AppState, app_state, log_internal_error
from .servables import Servable

__all__ = ["EventStream", "Failure", "Flight", "Happening", "as_fields", "encode_json", "event", "new_job"]

#: ``json.dumps(data, ensure_ascii=False)``, with one encoder for all events (``json.dumps`` builds an encoder per
#: call when given options: per token and stream, on the event loop).
encode_json = json.JSONEncoder(ensure_ascii=False).encode


def as_fields(message: str, renamed: Mapping[str, str] | None = None) -> str:
    """A check's message written for ``attnkit generate``'s options (``--top-p``), naming the request's fields
    (``top_p``; ``renamed``: a field named otherwise, ``{"max_new_tokens": "max_tokens"}``) instead."""
    renamed = renamed or {}

    def field(m: re.Match) -> str:
        name = m[1].replace("-", "_")
        return renamed.get(name, name)

    return re.sub(r"--([a-z]+(?:-[a-z]+)*)", field, message)


def new_job(servable: Servable, limits: Limits, prompt: Callable[[int | None, int], tuple[list[int], int]], *,
            max_new_tokens: int | None, sampling: Sampling, seed: int | None, stop: tuple[str, ...] = (),
            stop_ids: frozenset[int] = frozenset(), renamed: Mapping[str, str] | None = None) -> GenerationJob:
    """A request's generation as the worker runs it, checked as ``attnkit generate`` checks its options.

    :param prompt: ``(max_new_tokens, default) -> (ids, tokens to generate)``, checked (the servable's
        ``prompt_ids`` or ``chat_ids``): :class:`UserError` for what does not fit.
    :param renamed: the request's names of fields named otherwise than ``attnkit generate``'s options.
    :raises HTTPException: 422, naming the request's field.
    """
    cap, n = limits.max_new_tokens, max_new_tokens
    if n is not None and not 0 < n <= cap:
        field = (renamed or {}).get("max_new_tokens", "max_new_tokens")
        raise HTTPException(422, f"{field} must be in 1..{cap} (this server's --max-new-tokens), got {n}")
    if seed is not None and not servable.seeded:
        raise HTTPException(422, f"seed: {servable.info.name!r} is a CTranslate2 export, which samples from one "
                                 "generator for the whole server; leave seed out, or serve its run directory")
    try:
        check_sampling(sampling.temperature, sampling.top_k, sampling.top_p)
        ids, n = prompt(n, min(DEFAULT_NEW_TOKENS, cap))
    except UserError as e:
        raise HTTPException(422, as_fields(str(e), renamed)) from None
    return GenerationJob(ids, n, sampling, seed, stop, stop_ids)


@dataclass(frozen=True)
class Failure:
    """A job that failed, as a stream tells it: ``status`` 422 for what the model cannot do (a
    :class:`UserError`), 500 for a bug (logged in one line)."""

    status: int
    message: str


#: What a streamed job tells: a token (``{"token", "id"}``), or its end (its result, or why it failed).
Happening = dict | Generated | Failure


class _Outbox:
    """The worker's hand-over of streamed tokens to the event loop. A decoding step chooses a token for every
    streamed row; they reach the loop with one wake-up per step, not one each (``call_soon_threadsafe`` writes to
    the loop's self-pipe at every call, and each wake-up takes the GIL from the worker). Order holds: a pending
    drain was scheduled before whatever the worker hands over after it (a job's answer), so it runs first."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.pending, self.scheduled = loop, deque(), False

    def put(self, queue: asyncio.Queue, index: int, event: dict) -> None:
        """(The worker thread.) ``event`` of job ``index`` for ``queue``; wakes the loop unless a drain is already
        on its way."""
        self.pending.append((queue, (index, event)))
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self.scheduled = False  # before draining: an event put meanwhile is drained now or schedules another drain
        while self.pending:
            queue, item = self.pending.popleft()
            queue.put_nowait(item)


_OUTBOXES: WeakKeyDictionary[asyncio.AbstractEventLoop, _Outbox] = WeakKeyDictionary()


def _outbox(loop: asyncio.AbstractEventLoop) -> _Outbox:
    """The event loop's :class:`_Outbox` (one per loop, made on its first streamed request)."""
    if loop not in _OUTBOXES:
        _OUTBOXES[loop] = _Outbox(loop)
    return _OUTBOXES[loop]


class _Slots:
    """``count`` generations in flight, counted against ``max_streams`` from their acceptance until :meth:`close`
    (event loop only)."""

    def __init__(self, state: AppState, model: str, count: int) -> None:
        if state.streams[model] + count > state.limits.max_streams:
            raise HTTPException(429, f"model {model!r} is generating {state.streams[model]} texts, the limit "
                                     "(--max-streams); retry shortly", headers={"Retry-After": str(RETRY_AFTER)})
        state.streams[model] += count
        self.state, self.model, self.count = state, model, count

    def close(self) -> None:
        if self.count:
            self.state.streams[self.model] -= self.count
            self.count = 0


class Flight:
    """A request's generation jobs in flight (see the module doc); ``stream``: their tokens are told as they come
    (:meth:`happenings`), else their results awaited (:meth:`results`).

    :raises HTTPException: 429 beyond ``max_streams``, 503 when the model's queue is full.
    """

    def __init__(self, request: Request, servable: Servable, jobs: list[GenerationJob], stream: bool) -> None:
        self.request, self.servable, self.jobs = request, servable, jobs
        self.state, self.timing = app_state(request), request.scope.get(TIMING)
        self.slots = _Slots(self.state, servable.info.name, len(jobs))
        self.queue: asyncio.Queue | None = None
        if stream:  # the worker tells each token as it is chosen (set before the jobs are queued)
            self.queue = asyncio.Queue()
            put = _outbox(asyncio.get_running_loop()).put
            for i, job in enumerate(jobs):
                job.emit = partial(put, self.queue, i)
        self.futures: list[asyncio.Future] = []
        try:
            for i, job in enumerate(jobs):
                self.futures.append(self._submit(job))
                if self.queue is not None:  # after its tokens: the worker settles the future after emitting them
                    self.futures[-1].add_done_callback(partial(_tell_end, self.queue, i))
        except BaseException:
            self.close()
            raise

    def _submit(self, job: GenerationJob) -> asyncio.Future:
        """Queue ``job`` on the model's worker: it joins the running batch (a run), or the jobs of the same options
        that arrive with it (an export)."""
        state, name, stepper = self.state, self.servable.info.name, self.servable.stepper
        key = ("generate",) if stepper is not None else ("generate", job.max_new_tokens, job.sampling)
        try:
            future = state.workers[name].submit(key, self.servable.generate, [job], [len(job.ids)], stepper)
        except QueueFull:
            raise HTTPException(503, f"model {name!r} is busy ({state.limits.max_queue} texts queued, --max-queue); "
                                     "retry shortly", headers={"Retry-After": str(RETRY_AFTER)}) from None
        state.metrics.job_queued(self.timing, name)
        return future

    def close(self) -> None:
        """Cancel the jobs still running and give their slots back (idempotent)."""
        for job, future in zip(self.jobs, self.futures, strict=False):
            if not future.done():
                job.cancel()
                future.cancel()
        self.slots.close()

    async def results(self) -> list[Generated]:
        """Every job's result, in order; the client going away first cancels them (:data:`~.metrics.GONE`).

        :raises HTTPException: 422 for a job's :class:`UserError`; a job's bug is raised as it is (a 500).
        """
        gone = asyncio.ensure_future(_disconnected(self.request))
        try:
            pending, failed = set(self.futures), None
            while pending and failed is None:  # one failed: the request's answer is its error, the others cancelled
                done, pending = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
                if gone in done:
                    raise HTTPException(GONE, "the client went away")  # nobody reads it; counted in the metrics
                pending.discard(gone)
                failed = next((f for f in done if f.exception() is not None), None)
            self.state.metrics.job_answered(self.timing)
            if failed is not None:
                self._result(self.jobs[self.futures.index(failed)], failed)  # raises its error
            return [self._result(job, future) for job, future in zip(self.jobs, self.futures, strict=True)]
        finally:
            gone.cancel()
            self.close()

    def _result(self, job: GenerationJob, future: asyncio.Future) -> Generated:
        try:
            result = future.result()[0]
        except UserError as e:
            raise HTTPException(422, str(e)) from None
        self.state.metrics.generation(self.servable.info.name, self.timing, job, result)
        return result

    async def happenings(self) -> AsyncIterator[list[tuple[int, Happening]]]:
        """(Streamed.) What the worker told since the last batch, in order: ``(i, {"token", "id"})`` for a token of
        job ``i``, ``(i, its result or Failure)`` when it ended; until every job has ended. What waits is taken at
        once (a client that fell behind catches up in one write)."""
        if self.queue is None:
            raise ValueError("happenings() of a flight that does not stream")
        left = len(self.jobs)
        while left:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            told: list[tuple[int, Happening]] = []
            for i, item in items:
                if isinstance(item, asyncio.Future):
                    left -= 1
                    if not left:
                        self.state.metrics.job_answered(self.timing)
                    item = self._ended(i, item)
                told.append((i, item))
            yield told

    def _ended(self, i: int, future: asyncio.Future) -> Generated | Failure:
        try:
            return self._result(self.jobs[i], future)
        except HTTPException as e:
            return Failure(e.status_code, str(e.detail))
        except Exception as e:  # a bug met by this job alone: the stream has begun, so it ends with the error
            log_internal_error(f"{self.request.method} {self.request.url.path} (streamed)", e)
            return Failure(500, f"internal error ({type(e).__name__})")


def _tell_end(queue: asyncio.Queue, i: int, future: asyncio.Future) -> None:
    queue.put_nowait((i, future))


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body was read already: what comes next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """Server-sent events (``events``) of a streamed request's :class:`Flight`. Whatever ends the response (the
    events' end, an error, or the client going away before the first event, when the events' own ``finally`` never
    runs), the flight is closed: its jobs still running are cancelled and its slots given back."""

    def __init__(self, flight: Flight, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.flight = flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.flight.close()


def event(data: Any) -> bytes:
    """One server-sent event of ``data`` as JSON."""
    return b"data: " + encode_json(data).encode() + b"\n\n"
