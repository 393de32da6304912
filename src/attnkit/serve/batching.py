"""Dynamic batching for ``attnkit serve``: one worker thread per model, merging concurrent requests.

The server (:mod:`attnkit.serve`) queues each request's texts as a job with a key (what to run and
with which decoding parameters); the model's :class:`ModelWorker` takes the oldest job and the queued
jobs with the same key, up to ``max_batch`` texts, waiting at most ``max_wait_ms`` for more (after the
oldest arrived, or after the previous batch was answered), and runs them as one call. Only this
thread touches the model.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..common.errors import UserError

__all__ = ["Limits", "ModelWorker", "QueueFull"]


@dataclass(frozen=True)
class Limits:
    """What one request and one model's queue may hold (``attnkit serve --max-...``)."""

    max_texts: int = 64  # texts per request
    max_chars: int = 1000  # characters per text
    max_body: int = 1_000_000  # bytes per request body
    max_queue: int = 256  # texts waiting per model; beyond: 503
    max_batch: int = 32  # texts per model batch
    max_wait_ms: float = 5.0  # how long the oldest queued request waits for others to join its batch


class QueueFull(Exception):
    """The model's queue holds ``max_queue`` texts already (HTTP 503)."""


@dataclass
class _Job:
    key: tuple  # jobs with equal keys may share a batch: (what, decoding parameters)
    run: Callable[[list[str]], list]  # texts -> one result per text; the same for every job of a key
    texts: list[str]
    future: asyncio.Future
    arrived: float


class ModelWorker:
    """The one thread that runs a model: takes queued jobs, merges those with the same key into a batch.

    :meth:`submit` (from the event loop) queues texts and returns a future of their results; the
    thread takes the oldest job, waits up to ``max_wait_ms`` after its arrival (or after the previous
    batch was answered, if that is later) for jobs with the same key until ``max_batch`` texts are
    queued, runs them as one call and resolves each job's future with its share. A job larger than
    ``max_batch`` runs alone. :meth:`close` lets it finish what is queued, then stops it.
    """

    def __init__(self, name: str, limits: Limits) -> None:
        self.limits = limits
        self._jobs: deque[_Job] = deque()
        self._queued = 0  # texts in self._jobs
        self._closed = False
        self.batches = self.texts = 0  # run so far (written by the worker thread only)
        self._free_since = 0.0  # when the last batch was answered (time.monotonic)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name=f"attnkit-serve-{name}", daemon=True)
        self._thread.start()

    def submit(self, key: tuple, run: Callable[[list[str]], list], texts: list[str]) -> asyncio.Future:
        """Queue ``texts`` (called from the event loop); the future gets ``run``'s results for them.

        :raises QueueFull: the queue would hold more than ``max_queue`` texts, or the worker is closing.
        """
        future = asyncio.get_running_loop().create_future()
        with self._cond:
            if self._closed or self._queued + len(texts) > self.limits.max_queue:
                raise QueueFull
            self._jobs.append(_Job(key, run, texts, future, time.monotonic()))
            self._queued += len(texts)
            self._cond.notify()
        return future

    def _take(self) -> list[_Job] | None:
        """The next batch: the oldest job and the queued ones with its key (None once closed and drained)."""
        limit = self.limits.max_batch
        with self._cond:
            while not self._jobs:
                if self._closed:
                    return None
                self._cond.wait()
            first = self._jobs[0]
            # jobs that queued behind a batch wait max_wait_ms more after it: the clients it answered can
            # send their next request and join, rather than the queue splitting into alternating halves
            deadline = max(first.arrived, self._free_since) + self.limits.max_wait_ms / 1000
            while not self._closed:
                ready = sum(len(j.texts) for j in self._jobs if j.key == first.key)
                remaining = deadline - time.monotonic()
                if ready >= limit or remaining <= 0:
                    break
                self._cond.wait(remaining)
            batch, size = [], 0
            for job in self._jobs:
                if job.key == first.key and (not batch or size + len(job.texts) <= limit):
                    batch.append(job)
                    size += len(job.texts)
            taken = {id(j) for j in batch}
            self._jobs = deque(j for j in self._jobs if id(j) not in taken)
            self._queued -= size
            return batch

    def _serve(self) -> None:
        while (batch := self._take()) is not None:
            self.batches += 1
            self.texts += sum(len(job.texts) for job in batch)
            try:
                results = batch[0].run([t for job in batch for t in job.texts])
            except UserError as e:
                if len(batch) == 1:
                    self._resolve(batch[0], error=e)
                    continue
                for job in batch:  # one request's text cannot be run: the others still get their results
                    self._run_alone(job)
                continue
            except Exception as e:  # a bug: every request of the batch gets a 500 (the app logs it)
                for job in batch:
                    self._resolve(job, error=e)
                continue
            start = 0
            for job in batch:
                self._resolve(job, results[start: start + len(job.texts)])
                start += len(job.texts)
            self._free_since = time.monotonic()

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
        """Texts queued now; batches and texts run so far (texts / batches = the mean batch size)."""
        return {"queued": self._queued, "batches": self.batches, "texts": self.texts}

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued jobs, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
