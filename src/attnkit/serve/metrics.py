"""``GET /metrics``: what the server measures of itself, in the Prometheus text format (prometheus_client).

=====================================  ===================  ================================================
metric                                 labels               what
=====================================  ===================  ================================================
``attnkit_serve_requests_total``       ``route``,           HTTP requests, each once (errors: status >= 400,
                                       ``status``           the gate's 401, 408, 413, 414, 431 included; 499:
                                                            its client went away before the answer ended)
``attnkit_serve_request_seconds``      ``route``            latency: request in -> last byte of the answer
``attnkit_serve_stage_seconds``        ``model``,           where a request's time goes: ``parse`` (body,
                                       ``stage``            JSON, schema, checks: in -> queued), ``queue``
                                                            (queued -> its batch taken, or it joined the
                                                            running batch), ``compute`` (its batch's model
                                                            call, or joined -> its texts ended),
                                                            ``serialise`` (answered by
                                                            the worker -> last byte sent); ``queue`` and
                                                            ``compute`` per job (a request with attention
                                                            makes two)
``attnkit_serve_queue_wait_seconds``   ``model``            per job: queued -> its batch taken
``attnkit_serve_batch_texts``          ``model``            texts per batch (one observation per batch;
                                                            continuous batching: per decoding step)
``attnkit_serve_batch_tokens``         ``model``            padded source tokens per batch: texts x longest
``attnkit_serve_queued_texts``         ``model``            texts waiting now (read when scraped)
``attnkit_serve_time_to_first_token``  ``model``            a generation (``/generate``, a ``/v1/`` choice):
``_seconds``                                                request in -> its first token chosen (queue and
                                                            prompt included)
``attnkit_serve_generated_tokens``     ``model``            generations: tokens generated (a counter:
``_total``                                                  ``rate()`` of it is the model's tokens/s)
``attnkit_serve_generation_tokens``    ``model``            per generation of two tokens or more:
``_per_second``                                             ``(tokens - 1) / (last token - first token)``,
                                                            the pace of its decoding steps
``attnkit_serve_active_streams``       ``model``            generations in flight now, streamed or not
                                                            (read when scraped; ``--max-streams``)
=====================================  ===================  ================================================

Every app has its own :class:`~prometheus_client.CollectorRegistry` (:class:`ServeMetrics`), so that
several apps in one process (the tests) do not mix. A route outside the app's own is counted as
``other`` (a scan of random paths must not grow the label set). :class:`Measured` is the ASGI
middleware outside the API-key gate that counts and times every request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from .batching import BatchRecord
from .generation import Generated, GenerationJob

__all__ = ["CONTENT_TYPE", "GONE", "ROUTES", "TIMING", "Measured", "RequestTiming", "ServeMetrics"]

#: The app's routes: the values the ``route`` label takes (else ``other``).
ROUTES = frozenset({"/", "/health", "/models", "/translate", "/classify", "/generate", "/metrics", "/docs",
                    "/openapi.json", "/v1/models", "/v1/completions", "/v1/chat/completions"})
#: Routes with a path parameter: the prefix of their paths -> their label.
ROUTE_PREFIXES = {"/v1/models/": "/v1/models/{model_id}"}
#: The ASGI scope key under which :class:`Measured` leaves a request's :class:`RequestTiming` for the routes.
TIMING = "attnkit.timing"
CONTENT_TYPE = CONTENT_TYPE_LATEST
#: Seconds: from a cached tiny model's half millisecond to a long beam search.
SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TEXTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
TOKENS_PER_SECOND = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


@dataclass
class RequestTiming:
    """One request's clock readings (``time.perf_counter``): :class:`Measured` starts it, the route fills it."""

    start: float
    model: str | None = None  # the model it was queued for
    queued: float | None = None  # its first job was queued
    answered: float | None = None  # the worker answered its last job


class _Gauge:
    """A collector reading a per-model number when scraped (``read``: model -> value)."""

    def __init__(self, name: str, documentation: str, read: Callable[[], dict[str, int]]) -> None:
        self.name, self.documentation, self.read = name, documentation, read

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.name, self.documentation, labels=["model"])]

    def collect(self) -> Iterator[Metric]:
        family = self.describe()[0]
        for model, value in sorted(self.read().items()):
            family.add_metric([model], value)
        yield family


class ServeMetrics:
    """The metrics of one app, in their own registry; ``queued()`` tells each model's queued texts, ``streams()``
    each language model's generations in flight."""

    def __init__(self, queued: Callable[[], dict[str, int]], streams: Callable[[], dict[str, int]] = dict) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("attnkit_serve_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.latency = Histogram("attnkit_serve_request_seconds", "request in -> last byte of the answer",
                                 ["route"], buckets=SECONDS, registry=r)
        self.stages = Histogram("attnkit_serve_stage_seconds", "a request's time by stage: parse, queue (per job), "
                                "compute (its batch's, per job), serialise", ["model", "stage"], buckets=SECONDS,
                                registry=r)
        self.queue_wait = Histogram("attnkit_serve_queue_wait_seconds", "per job: queued -> its batch taken",
                                    ["model"], buckets=SECONDS, registry=r)
        self.batch_texts = Histogram("attnkit_serve_batch_texts", "texts per batch", ["model"], buckets=TEXTS,
                                     registry=r)
        self.batch_tokens = Histogram("attnkit_serve_batch_tokens", "padded source tokens per batch (texts x "
                                      "longest)", ["model"], buckets=TOKENS, registry=r)
        self.first_token = Histogram("attnkit_serve_time_to_first_token_seconds", "/generate: request in -> its "
                                     "first token chosen", ["model"], buckets=SECONDS, registry=r)
        self.generated_tokens = Counter("attnkit_serve_generated_tokens", "/generate: tokens generated", ["model"],
                                        registry=r)
        self.token_rate = Histogram("attnkit_serve_generation_tokens_per_second", "/generate, per request: (tokens "
                                    "- 1) / (last token - first token)", ["model"], buckets=TOKENS_PER_SECOND,
                                    registry=r)
        r.register(_Gauge("attnkit_serve_queued_texts", "texts waiting for each model", queued))
        r.register(_Gauge("attnkit_serve_active_streams", "generations in flight (--max-streams)", streams))

    def on_batch(self, model: str) -> Callable[[BatchRecord], None]:
        """The listener for ``model``'s worker (:class:`~attnkit.serve.batching.ModelWorker`'s ``on_batch``)."""
        return partial(self._batch, model)

    def _batch(self, model: str, record: BatchRecord) -> None:
        self.batch_texts.labels(model).observe(record.texts)
        self.batch_tokens.labels(model).observe(record.tokens)
        for wait in record.waits:  # one per job
            self.queue_wait.labels(model).observe(wait)
            self.stages.labels(model, "queue").observe(wait)
            if record.finished is None:  # a whole batch: each job's compute is the batch's call
                self.stages.labels(model, "compute").observe(record.compute)
        for seconds in record.finished or ():  # continuous: each job's, from joining to its last text's end
            self.stages.labels(model, "compute").observe(seconds)

    def job_queued(self, timing: RequestTiming | None, model: str) -> None:
        """A request's job was queued for ``model``: its first ends the parse stage."""
        if timing is not None and timing.queued is None:
            timing.model, timing.queued = model, time.perf_counter()
            self.stages.labels(model, "parse").observe(timing.queued - timing.start)

    def generation(self, model: str, timing: RequestTiming | None, job: GenerationJob, result: Generated) -> None:
        """A ``/generate`` request's generation ended (not one whose client left)."""
        self.generated_tokens.labels(model).inc(result.tokens)
        if timing is not None and job.first_token is not None:
            self.first_token.labels(model).observe(job.first_token - timing.start)
        if result.tokens > 1 and job.first_token is not None and job.ended is not None and job.ended > job.first_token:
            self.token_rate.labels(model).observe((result.tokens - 1) / (job.ended - job.first_token))

    @staticmethod
    def job_answered(timing: RequestTiming | None) -> None:
        """The worker answered a request's job (its last: the serialise stage starts)."""
        if timing is not None:
            timing.answered = time.perf_counter()

    def finished(self, path: str, status: int, timing: RequestTiming) -> None:
        """The last byte of a request's answer is about to be sent."""
        route = path if path in ROUTES else next(
            (label for prefix, label in ROUTE_PREFIXES.items() if path.startswith(prefix)), "other")
        now = time.perf_counter()
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(now - timing.start)
        if timing.model is not None and timing.answered is not None:
            self.stages.labels(timing.model, "serialise").observe(now - timing.answered)

    def render(self) -> bytes:
        """The text exposition of every metric (``GET /metrics``)."""
        return generate_latest(self.registry)


#: The status a request is counted with when its answer was cut short: the client went away first (nginx's code).
GONE = 499


class Measured:
    """ASGI middleware outermost: a :class:`RequestTiming` per HTTP request (``scope[TIMING]``), and the
    request counted and timed as its last byte goes out (before it is sent: a client that has its answer
    finds it counted). A request whose answer never ended (a stream whose client went away, a request answered
    nothing) is counted once the app is done with it, with status :data:`GONE`: every request is counted once."""

    def __init__(self, app: Any, metrics: ServeMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        timing = scope[TIMING] = RequestTiming(time.perf_counter())
        status, counted = 0, False

        async def measured(message: dict) -> None:
            nonlocal status, counted
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                self.metrics.finished(scope["path"], status, timing)
                counted = True
            await send(message)

        try:
            await self.app(scope, receive, measured)
        finally:
            if not counted:
                self.metrics.finished(scope["path"], GONE, timing)
