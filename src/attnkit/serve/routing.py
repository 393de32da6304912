"""What the routes of :mod:`attnkit.serve.app` share: the app's state, the model a request names, the size checks,
a job on the model's worker, and attention joined into a response as bytes.

==============================  ==================================================================================
name                            what it is
==============================  ==================================================================================
:class:`AppState`               what the routes read (``request.app.state.serve``; :func:`app_state`)
:func:`pick`                    the model a request names (404 unknown, 422 served by another route)
:func:`check_size`              413 for too many texts, or a text too long
:func:`run_on_worker`           ``fn(texts)`` on the model's worker, batched (503 with ``Retry-After`` when full)
:func:`attention_jsons`         each text's explorer data as JSON bytes, made on the worker text by text
:func:`with_attention`          a response's JSON with ``"attention"`` joined in as bytes
:func:`log_internal_error`      one line on the log for a bug met while answering a request
==============================  ==================================================================================
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from ..common.errors import UserError
from ..inference.attention_maps import AttentionMaps
from ..viz.explorer import explorer_data
from .batching import Limits, ModelWorker, QueueFull, Stepper
from .metrics import TIMING, ServeMetrics
from .schemas import ClassifyResponse, GenerateResponse, TranslateResponse
from .servables import Servable

__all__ = ["RETRY_AFTER", "AppState", "app_state", "attention_json", "attention_jsons", "check_size",
           "log_internal_error", "pick", "run_on_worker", "with_attention"]

#: Seconds a client is told to wait (``Retry-After``) when a model's queue is full.
RETRY_AFTER = 1


@dataclass
class AppState:
    """What the routes read (``request.app.state.serve``): the models by name and their workers (one
    per model, started and drained with the app), the limits, the API key, the page and the metrics;
    ``routes`` holds the models again under the route that serves them (``info.task``: ``translate`` or
    ``classify``, from their task's :attr:`~attnkit.tasks.TaskSpec.serves`)."""

    models: dict[str, Servable]
    limits: Limits
    api_key: str | None
    page: str
    threads: int | None = None  # torch's intra-op threads on each model's worker thread (None: as they are)
    loaded: float = field(default_factory=time.time)  # when the models were loaded (Unix seconds)
    workers: dict[str, ModelWorker] = field(default_factory=dict)
    metrics: ServeMetrics = field(init=False)
    routes: dict[str, dict[str, Servable]] = field(init=False)
    streams: dict[str, int] = field(init=False)  # a language model's generations in flight (event loop only)

    def __post_init__(self) -> None:
        self.metrics = ServeMetrics(lambda: {name: w.stats()["queued"] for name, w in self.workers.items()},
                                    lambda: dict(self.streams))
        self.routes = {}
        for name, servable in self.models.items():
            self.routes.setdefault(servable.info.task, {})[name] = servable
        self.streams = dict.fromkeys(self.routes.get("generate", {}), 0)


def app_state(request: Request) -> AppState:
    """The :class:`AppState` of the app answering ``request``."""
    return request.app.state.serve


def pick(state: AppState, name: str | None, route: str) -> Servable:
    """The model a request names (or the only one ``route`` serves)."""
    served = state.routes.get(route, {})
    if name is None:
        if len(served) == 1:
            return next(iter(served.values()))
        raise HTTPException(422, f"model: give the model's name, one of {sorted(state.models)}")
    if name not in state.models:
        raise HTTPException(404, f"model {name!r} is not served here; GET /models lists {sorted(state.models)}")
    if name not in served:  # the other route serves it, and is named after it
        other = state.models[name].info.task
        raise HTTPException(422, f"model: {name!r} is a {other} model; use /{other}")
    return served[name]


def check_size(limits: Limits, texts: list[str], attention: bool) -> None:
    if len(texts) > limits.max_texts:
        raise HTTPException(413, f"texts: {len(texts)} texts in one request, more than the limit "
                                 f"{limits.max_texts} (--max-texts); send them in several requests")
    if attention and len(texts) > limits.max_attention_texts:
        raise HTTPException(413, f"texts: attention for {len(texts)} texts in one request, more than the limit "
                                 f"{limits.max_attention_texts} (--max-attention-texts); ask for it in several "
                                 "requests")
    for i, text in enumerate(texts):
        if len(text) > limits.max_chars:
            raise HTTPException(413, f"texts[{i}]: {len(text)} characters, more than the limit "
                                     f"{limits.max_chars} (--max-chars); split the text")


async def run_on_worker(request: Request, servable: Servable, key: tuple, fn: Callable[[list[str]], list],
                        texts: list[str], stepper: Stepper | None = None) -> list:
    """``fn(texts)`` on the model's worker, batched with the queued requests of the same ``key`` and of
    similar length (in source tokens; in characters for a servable that cannot count them); or decoded by
    ``stepper``, joining its running batch (continuous batching)."""
    state, timing = app_state(request), request.scope.get(TIMING)
    measure = getattr(servable, "lengths", None)
    lengths = measure(texts) if measure is not None else None
    try:
        future = state.workers[servable.info.name].submit(key, fn, texts, lengths, stepper)
    except QueueFull:
        raise HTTPException(503, f"model {servable.info.name!r} is busy ({state.limits.max_queue} texts queued, "
                                 "--max-queue); retry shortly", headers={"Retry-After": str(RETRY_AFTER)}) from None
    state.metrics.job_queued(timing, servable.info.name)
    try:
        return await future
    except UserError as e:
        raise HTTPException(422, str(e)) from None
    finally:
        state.metrics.job_answered(timing)


def attention_json(maps: AttentionMaps) -> bytes:
    """One text's explorer data (:func:`~attnkit.viz.explorer.explorer_data`) as JSON, made in the worker text by
    text: the nested lists of one text are freed before the next is drawn, and what waits for the response is
    one block of bytes per text instead of millions of float objects (which would keep the heap grown)."""
    return json.dumps(explorer_data(maps), ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def attention_jsons(maps: Callable[[str], AttentionMaps], texts: list[str]) -> list[bytes]:
    """Each text's :func:`attention_json`, one text after the other (on the worker)."""
    return [attention_json(maps(t)) for t in texts]


def with_attention(response: TranslateResponse | ClassifyResponse | GenerateResponse, attention: list[bytes],
                   sent: Callable[[], None], one: bool = False) -> Response:
    """``response`` as its JSON (``None`` fields left out, as the routes' ``response_model_exclude_none``) with
    ``"attention": [...]`` (each text's :func:`attention_json`) added, joined as bytes. ``sent`` is called once
    the last byte is sent: the worker (``ModelWorker.release_soon``) then gives those megabytes back to the
    system, which its trim after the batch, when they were still being sent, could not. ``one``: the one text's
    data itself, not a list (``/generate``)."""
    head = response.model_dump_json(exclude_none=True).encode()  # '{...}', attention unset
    maps = attention[0] if one else b"[" + b",".join(attention) + b"]"
    return Response(head[:-1] + b',"attention":' + maps + b"}", media_type="application/json",
                    background=BackgroundTask(sent))


def log_internal_error(where: str, error: BaseException) -> None:
    """One line on the server's log for a bug met while answering a request (``where``: its method and path): the
    exception's type and the first line of its message; the traceback only at DEBUG level. A client that keeps
    sending the request that meets it fills the log line by line, not page by page."""
    logger = logging.getLogger("attnkit.serve")
    lines = str(error).strip().splitlines()
    logger.error("attnkit serve: internal error in %s: %s%s", where, type(error).__name__,
                 f": {lines[0]}" if lines else "")
    logger.debug("the traceback of that internal error", exc_info=error)
