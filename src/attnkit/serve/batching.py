"""Dynamic batching for ``attnkit serve``: one worker thread per model, merging concurrent requests.

The server queues each request's texts as a job with a key (what to run, with which decoding parameters) and
each text's length in source tokens; the model's :class:`ModelWorker` takes the oldest job and the queued jobs
with its key closest to it in length, up to ``max_batch`` texts and ``max_batch_tokens`` padded tokens, waiting
at most ``max_wait_ms`` for more (not at all for a lone request while one client is sending), and runs them as
one call. A job may instead bring a :class:`Stepper` (greedy translation, :class:`ContinuousTranslation
<attnkit.serve.servables.ContinuousTranslation>`; a language model's generation,
:class:`~attnkit.serve.generation.ContinuousGeneration`): its texts join the running batch at the next step, and
each job is answered as soon as its own texts have ended (continuous batching, as Orca and TGI do). Only this
thread touches the model.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..common.errors import UserError
from ..common.memory import release_free_memory

__all__ = ["BatchRecord", "Limits", "ModelWorker", "QueueFull", "Stepper"]


@dataclass(frozen=True)
class Limits:
    """What one request and one model's queue may hold (``attnkit serve --max-...``)."""

    max_texts: int = 64  # texts per request
    max_chars: int = 1000  # characters per text
    max_body: int = 1_000_000  # bytes per request body
    max_queue: int = 256  # texts waiting per model; beyond: 503
    max_batch: int = 32  # texts per model batch
    max_wait_ms: float = 5.0  # how long the oldest queued request waits for others to join its batch
    max_batch_tokens: int = 4096  # padded source tokens per model batch: texts x the longest text's tokens
    max_attention_texts: int = 8  # texts per request with attention (each text's maps run to megabytes of JSON)
    max_new_tokens: int = 512  # tokens one /generate request may ask for (at most MAX_NEW_TOKENS, 4096)
    max_streams: int = 64  # generations in flight per language model (streamed or not); beyond: 429
    max_connections: int = 512  # open connections; beyond, a new one is answered 503 and closed
    read_timeout: float = 10.0  # seconds a request's head, and then its body, may take to arrive; beyond: 408


#: Give freed memory back (:func:`~attnkit.common.memory.release_free_memory`) after this long idle, and while
#: busy at most this often: a server's RSS then follows what it holds, not the largest request it ever answered.
TRIM_EVERY_S = 1.0


class QueueFull(Exception):
    """The model's queue holds ``max_queue`` texts already (HTTP 503)."""


class Stepper(Protocol):
    """Decoding in steps that texts join and leave (continuous batching); driven by the worker thread alone.

    ``start(texts)`` begins them, a handle per text (it may raise :class:`UserError` before starting any);
    ``step()`` advances every running text and returns ``(handle, result)`` for those that ended (at ``start``
    too), an exception being that text's failure alone; ``running`` counts texts not yet returned, ``width`` the
    running batch's padded source length; ``abandon()`` drops every running text (after a failed step)."""

    @property
    def running(self) -> int: ...
    @property
    def width(self) -> int: ...
    def start(self, texts: list[str]) -> list[int]: ...
    def step(self) -> list[tuple[int, Any]]: ...
    def abandon(self) -> None: ...


@dataclass(frozen=True)
class BatchRecord:
    """What one batch was, for the server's metrics (:mod:`attnkit.serve.metrics`)."""

    texts: int  # texts in the batch
    tokens: int  # padded source tokens: texts x the longest text's length, as padding makes it
    waits: tuple[float, ...]  # per job: seconds from submit to the batch being taken
    compute: float  # seconds of the model call (the first try, when one job had to run alone after it)
    # continuous batching: a batch is one step of the running texts; ``waits`` are the jobs that joined at it, and
    # ``finished`` the seconds from joining to the last text ended of each job that ended at it (None: a whole batch)
    finished: tuple[float, ...] | None = None


@dataclass
class _Job:
    key: tuple  # jobs with equal keys may share a batch: (what, decoding parameters)
    run: Callable[[list[str]], list]  # texts -> one result per text; the same for every job of a key
    texts: list[str]
    lengths: list[int]  # each text's length (source tokens, or characters where the model cannot say)
    future: asyncio.Future
    arrived: float  # time.monotonic() at submit
    stepper: Stepper | None = None  # decodes the texts continuously (None: ``run`` them as one call)
    results: list = field(default_factory=list)  # continuous: each text's result as it ends
    pending: int = 0  # continuous: texts not ended yet
    failed: bool = False  # continuous: a text of it failed, and the job was answered with its error
    started: float = 0.0  # continuous: time.monotonic() when its texts joined the running batch

    @property
    def longest(self) -> int:
        return max(self.lengths, default=0)


def padded_tokens(jobs: list[_Job]) -> int:
    """Source tokens of ``jobs`` run as one batch: every text is padded to the longest."""
    return sum(len(j.texts) for j in jobs) * max((j.longest for j in jobs), default=0)


class ModelWorker:
    """The one thread that runs a model: takes queued jobs, merges those with the same key into a batch.

    :meth:`submit` (from the event loop) queues texts and returns a future of their results; the thread takes the
    oldest job, waits up to ``max_wait_ms`` after its arrival (or after the previous batch was answered, if that is
    later) for jobs with the same key until ``max_batch`` texts are queued, runs them as one call and resolves each
    job's future with its share; a lone request (none other queued, and the previous batch answered one request)
    runs at once, as does a job decoded continuously (later ones join it at the next step). Which jobs join the
    oldest is :meth:`_select`'s rule (closest in length, within ``max_batch`` texts and ``max_batch_tokens`` padded
    tokens). A job larger than either limit runs alone. :meth:`close` lets it finish what is queued, then stops it.
    ``on_batch`` (if given) hears of every batch, from the worker thread, before its futures are resolved. On its
    thread, ``threads`` (if given) are set as torch's (why: :func:`~.app.serve`), then ``warm_up`` runs.
    """

    def __init__(self, name: str, limits: Limits, on_batch: Callable[[BatchRecord], None] | None = None,
                 threads: int | None = None, warm_up: Callable[[], None] | None = None) -> None:
        self.limits = limits
        self.threads, self.warm_up = threads, warm_up
        self.on_batch = on_batch
        self._jobs: deque[_Job] = deque()
        self._queued = 0  # texts in self._jobs
        self._closed = False
        self.batches = self.texts = 0  # model calls (continuous: steps) and texts run so far (worker thread only)
        self.batch_texts = 0  # texts summed over the model calls (continuous: running texts summed over the steps)
        self._free_since = 0.0  # when the last batch was answered (time.monotonic)
        self._last_jobs = 0  # requests in the last batch: more than one means several clients are sending
        self._trimmed = time.monotonic()  # when freed memory was last given back
        self._dirty = False  # a batch ran since then
        self._cond = threading.Condition()
        self._stepper: Stepper | None = None  # the continuous decoder with texts in flight
        self._stepping_key: tuple | None = None  # the key of its jobs
        self._inflight: dict[int, tuple[_Job, int]] = {}  # its handle -> (job, index of the text in the job)
        self._joined: list[_Job] = []  # jobs that joined since the last step (its record tells their waits)
        self._thread = threading.Thread(target=self._serve, name=f"attnkit-serve-{name}", daemon=True)
        self._thread.start()

    def submit(self, key: tuple, run: Callable[[list[str]], list], texts: list[str],
               lengths: list[int] | None = None, stepper: Stepper | None = None) -> asyncio.Future:
        """Queue ``texts`` (called from the event loop); the future gets ``run``'s results for them.

        ``lengths``: each text's length in source tokens (default: its characters), for grouping.
        ``stepper``: decode the texts continuously with it instead (the same for every job of ``key``).

        :raises QueueFull: the queue would hold more than ``max_queue`` texts, or the worker is closing.
        """
        lengths = [len(t) for t in texts] if lengths is None else list(lengths)
        if len(lengths) != len(texts):
            raise ValueError(f"{len(lengths)} lengths for {len(texts)} texts")
        future = asyncio.get_running_loop().create_future()
        with self._cond:
            if self._closed or self._queued + len(texts) > self.limits.max_queue:
                raise QueueFull
            self._jobs.append(_Job(key, run, texts, lengths, future, time.monotonic(), stepper))
            self._queued += len(texts)
            self._cond.notify()
        return future

    def _select(self, first: _Job) -> list[_Job]:
        """The jobs to run with ``first`` (the oldest), in queue order.

        The rule (offline batching sorts by length for the same reason): the oldest job always runs;
        the queued jobs of its key join it closest in length first (the older first on a tie), each
        only if the batch stays within ``max_batch`` texts and within ``max_batch_tokens`` tokens as
        padded (texts x longest). So a long request does not pad short ones past the budget, and a job
        above a limit on its own runs alone. Called with the lock held.
        """
        limits = self.limits
        batch, size, longest = [first], len(first.texts), first.longest
        others = [j for j in self._jobs if j is not first and j.key == first.key]
        for job in sorted(others, key=lambda j: abs(j.longest - first.longest)):  # stable: older first on ties
            grown, wider = size + len(job.texts), max(longest, job.longest)
            if grown <= limits.max_batch and grown * wider <= limits.max_batch_tokens:
                batch.append(job)
                size, longest = grown, wider
        order = {id(j): i for i, j in enumerate(self._jobs)}
        return sorted(batch, key=lambda j: order[id(j)])

    def _full(self, batch: list[_Job]) -> bool:
        """No job could join ``batch``: it holds ``max_batch`` texts, or one more text would pad it past the budget."""
        size, longest = sum(len(j.texts) for j in batch), max(j.longest for j in batch)
        return size >= self.limits.max_batch or (size + 1) * longest > self.limits.max_batch_tokens

    def _take(self) -> list[_Job] | None:
        """The next batch: the oldest job and queued ones with its key (None once closed and drained)."""
        with self._cond:
            while not self._jobs:
                if self._closed:
                    return None
                if not self._dirty:
                    self._cond.wait()
                elif not self._cond.wait(TRIM_EVERY_S):  # idle for a while after work: give memory back
                    self._release()
            first = self._jobs[0]
            # jobs that queued behind a batch wait max_wait_ms more after it: the clients it answered can
            # send their next request and join, rather than the queue splitting into alternating halves.
            # A lone request (nothing else queued, and the last batch answered one request) does not wait:
            # no other client is sending, so waiting would only add max_wait_ms to its latency. Nor does a job
            # decoded continuously: the jobs that come while it decodes join it at its next step, started together
            # (_join), so waiting would batch nothing (it cost a language model's first token max_wait_ms after a
            # burst).
            lone = len(self._jobs) == 1 and self._last_jobs <= 1
            wait = 0.0 if lone or first.stepper is not None else self.limits.max_wait_ms / 1000
            deadline = max(first.arrived, self._free_since) + wait
            while not self._closed:
                remaining = deadline - time.monotonic()
                ready = sum(len(j.texts) for j in self._jobs if j.key == first.key)  # texts of its key queued
                if remaining <= 0 or ready >= self.limits.max_batch or self._full(self._select(first)):
                    break
                self._cond.wait(remaining)
            batch = self._select(first)
            self._last_jobs = len(batch)
            taken = {id(j) for j in batch}
            self._jobs = deque(j for j in self._jobs if id(j) not in taken)
            self._queued -= sum(len(j.texts) for j in batch)
            return batch

    def release_soon(self) -> None:
        """Give freed memory back once the worker has been idle :data:`TRIM_EVERY_S` (as after a batch): for memory
        freed after the worker's work, e.g. a large answer the server has just sent."""
        with self._cond:
            self._dirty = True
            self._cond.notify()

    def _release(self) -> None:
        """Give the memory freed since the last time back to the system (from the worker thread)."""
        release_free_memory()
        self._trimmed, self._dirty = time.monotonic(), False

    def _serve(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        if self.warm_up is not None:
            try:
                self.warm_up()
            except Exception as e:  # logged (a bug with its traceback); the jobs still run, and meet it again
                logging.getLogger(__name__).error("attnkit serve: warming up the model failed: %s", e,
                                                  exc_info=not isinstance(e, UserError))
        while True:
            if self._stepper is not None:  # continuous decoding in flight: admit what fits, then one step
                self._continue()
                continue
            if (batch := self._take()) is None:
                return
            self._dirty = True
            stepping = batch[0].stepper is not None
            if stepping:
                self._stepper, self._stepping_key = batch[0].stepper, batch[0].key
                self._join(batch)
            else:
                self._run_batch(batch)
            # its jobs hold their answers (attention's run to megabytes): drop them before the trim and before
            # waiting for more work, or the idle trim could not give that memory back
            del batch
            if not stepping:
                self._trim_if_due()  # a running batch trims when it drains (_continue)

    def _trim_if_due(self) -> None:
        """Busy without a pause of TRIM_EVERY_S since the last trim: trim now, once the batch is answered. Not
        before taking the next one, where a request arriving after a burst paid for it in its latency."""
        if self._dirty and time.monotonic() - self._trimmed > TRIM_EVERY_S:
            self._release()

    def _run_batch(self, batch: list[_Job]) -> None:
        """Run ``batch`` as one call and answer each job with its share. If the call fails, a batch of several jobs
        runs again job by job: a request that cannot be run (or meets a bug) fails alone."""
        started = time.monotonic()
        self.batches += 1
        texts = sum(len(job.texts) for job in batch)
        self.texts += texts
        self.batch_texts += texts
        try:
            results = batch[0].run([t for job in batch for t in job.texts])
        except Exception as e:  # a request's text cannot be run (UserError: 422), or a bug (500)
            self._record(batch, started)
            if len(batch) == 1:
                self._resolve(batch[0], error=e)
                return
            for job in batch:  # the others must not fail with it: each runs again alone
                self._run_alone(job)
            return
        self._record(batch, started)
        start = 0
        for job in batch:
            self._resolve(job, results[start: start + len(job.texts)])
            start += len(job.texts)
        self._free_since = time.monotonic()

    # -- continuous batching ---------------------------------------------------------------------------

    def _admit(self) -> list[_Job]:
        """The queued jobs that join the running batch now: oldest first, those of its key while the batch stays
        within ``max_batch`` texts and ``max_batch_tokens`` padded tokens; none past a job of another key (it
        runs when the batch has drained, so it is not starved)."""
        stepper, limits = self._stepper, self.limits
        joining: list[_Job] = []
        with self._cond:
            rows, width = stepper.running, stepper.width
            for job in self._jobs:
                if job.key != self._stepping_key:
                    break
                grown, wider = rows + len(job.texts), max(width, job.longest + 1)  # + 1: </s>
                if grown > limits.max_batch or grown * wider > limits.max_batch_tokens:
                    break
                joining.append(job)
                rows, width = grown, wider
            if joining:
                taken = {id(j) for j in joining}
                self._jobs = deque(j for j in self._jobs if id(j) not in taken)
                self._queued -= sum(len(j.texts) for j in joining)
        return joining

    def _join(self, jobs: list[_Job]) -> None:
        """Start ``jobs``' texts on the stepper in one call (a stepper may start them as one batch: a language model
        runs prompts of one length through one prefill). If it refuses a text (a :class:`UserError`, raised before
        it starts any), each job starts alone, and a job it cannot start is answered with the error."""
        if not jobs:
            return
        started = time.monotonic()
        for job in jobs:
            job.started, job.results, job.pending = started, [None] * len(job.texts), len(job.texts)
        try:
            handles = iter(self._stepper.start([text for job in jobs for text in job.texts]))
        except UserError as e:
            if len(jobs) == 1:
                self._resolve(jobs[0], error=e)
            else:
                for job in jobs:
                    self._join([job])
            return
        except Exception as e:  # a bug: these jobs and every job in flight get a 500 (the app logs it)
            for job in jobs:
                self._resolve(job, error=e)
            self._abandon(e)
            return
        for job in jobs:
            self.texts += len(job.texts)
            self._inflight.update({next(handles): (job, i) for i in range(len(job.texts))})
            self._joined.append(job)

    def _abandon(self, error: Exception) -> None:
        """Drop the running batch after a bug: every job in flight is answered with ``error``."""
        jobs = {id(job): job for job, _ in self._inflight.values()}
        self._stepper.abandon()
        self._inflight.clear()
        self._joined.clear()
        self._stepper = self._stepping_key = None
        self._free_since = time.monotonic()
        for job in jobs.values():
            self._resolve(job, error=error)

    def _continue(self) -> None:
        """Admit the queued jobs that fit, run one step, answer every job whose texts have all ended."""
        stepper = self._stepper
        self._join(self._admit())
        joined, self._joined = self._joined, []
        if stepper is not self._stepper:  # a bug while starting texts dropped the running batch
            return
        rows, width = stepper.running, stepper.width
        if rows == 0:  # every text it was given could not start
            self._stepper = self._stepping_key = None
            return
        started = time.monotonic()
        try:
            ended = stepper.step()
        except Exception as e:  # a bug: every job in flight gets a 500 (the app logs it)
            self._abandon(e)
            return
        compute, now = time.monotonic() - started, time.monotonic()
        finished = []
        for handle, result in ended:
            job, i = self._inflight.pop(handle)
            if job.failed:  # answered already: the rest of its texts is let go
                continue
            if isinstance(result, Exception):  # this text failed alone: its job gets the error, the others go on
                job.failed = True
                self._resolve(job, error=result)
                continue
            job.results[i] = result
            job.pending -= 1
            if job.pending == 0:
                finished.append(now - job.started)
                self._resolve(job, job.results)
        self.batches += 1
        self.batch_texts += rows
        # requests decoded at this step: after a lone client's request ends, its next one need not wait for others
        self._last_jobs = len({id(job) for job, _ in self._inflight.values()}) + len(finished)
        if self.on_batch is not None:
            self._tell(BatchRecord(texts=rows, tokens=rows * width, waits=tuple(j.started - j.arrived for j in joined),
                                   compute=compute, finished=tuple(finished)))
        if stepper.running == 0:
            self._stepper = self._stepping_key = None
            self._free_since = time.monotonic()
            self._trim_if_due()

    def _record(self, batch: list[_Job], started: float) -> None:
        """Tell ``on_batch`` of a batch taken at ``started`` (a failing listener does not stop the worker)."""
        if self.on_batch is None:
            return
        self._tell(BatchRecord(texts=sum(len(j.texts) for j in batch), tokens=padded_tokens(batch),
                               waits=tuple(started - j.arrived for j in batch), compute=time.monotonic() - started))

    def _tell(self, record: BatchRecord) -> None:
        try:
            self.on_batch(record)
        except Exception:  # metrics must never fail a request; a bug there is logged
            logging.getLogger(__name__).exception("attnkit serve: recording a batch failed")

    def _run_alone(self, job: _Job) -> None:
        try:
            self._resolve(job, job.run(job.texts))
        except Exception as e:
            self._resolve(job, error=e)

    @staticmethod
    def _resolve(job: _Job, result: list | None = None, error: Exception | None = None) -> None:
        def settle() -> None:
            if job.future.done():  # the request was cancelled meanwhile
                return
            if error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(error)

        job.future.get_loop().call_soon_threadsafe(settle)

    def stats(self) -> dict[str, int]:
        """Texts queued now; model calls (batches, or continuous decoding's steps), texts run, and texts summed over
        the calls so far (``batch_texts / batches`` = the mean batch size)."""
        return {"queued": self._queued, "batches": self.batches, "texts": self.texts, "batch_texts": self.batch_texts}

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued jobs, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
