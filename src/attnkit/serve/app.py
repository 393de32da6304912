"""Serving trained models over HTTP: ``attnkit serve RUN [RUN ...]``, a FastAPI app on uvicorn.

=========================  ==========================================================================
endpoint                   what it does
=========================  ==========================================================================
``GET /``                  a page: pick a model, type sentences, see the translations (or classes);
                           click one to open its attention explorer (script and style inlined)
``GET /health``            ``{"status": "ok", "api_key_required": ..., "models": {name: {"queued",
                           "batches", "texts", "batch_texts"}}}``: texts waiting; model calls
                           (continuous decoding: steps), texts run, texts summed over the calls
``GET /models``            name, task (translate, classify, generate), languages, parameters, beam defaults
                           (and classes; a language model's context) per model
``POST /translate``        ``{"model", "texts": [...], "beam", "n_best", "lenpen", "attention"}``
``POST /classify``         ``{"model", "texts": [...], "attention"}`` -> labels and probabilities
``POST /generate``         ``{"model", "prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
                           "stop": [...], "stream", "attention"}`` -> ``{"text", "tokens", "prompt_tokens",
                           "finish_reason", "seed"}``; with ``stream``, server-sent events: ``data: {"token",
                           "id"}`` per token, then ``data: {"text", "tokens", ..., "finish_reason"}``
``/v1/models``,            the OpenAI-compatible API of the language models (:mod:`attnkit.serve.openai_routes`):
``/v1/completions``,       the ``openai`` package and other clients of OpenAI's API work unchanged; errors there
``/v1/chat/completions``   are OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (422 is its 400)
``GET /metrics``           the server's own measurements in the Prometheus text format: requests by
                           route and status, latency, queued texts, batch sizes, queue wait and time
                           per stage (:mod:`attnkit.serve.metrics`)
``GET /docs``              FastAPI's OpenAPI page (``/openapi.json`` is the schema)
=========================  ==========================================================================

**Models.** Each is loaded by :func:`~attnkit.serve.servables.load_servable` into a
:class:`~attnkit.serve.servables.Servable` and served under its run directory's name. Translation
uses :func:`attnkit.inference.translate.translate_texts`, classification
:func:`attnkit.inference.classify.predict`, attention :func:`attnkit.inference.attention_maps.attention_maps`
(drawn by the explorer's own script, :mod:`attnkit.viz.explorer`): results are those of
``attnkit translate`` / ``classify`` / ``attention`` for the same inputs. Attention is serialised
in the worker, one text at a time, and joined into the response as bytes
(:func:`~attnkit.serve.routing.attention_json`):
a request's maps never sit in memory as Python objects all at once.

**Dynamic batching** (:mod:`attnkit.serve.batching`). One inference thread owns each model; concurrent
requests with the same decoding parameters are merged into one batch of at most ``max_batch``
texts and ``max_batch_tokens`` padded source tokens, those closest in length first, waiting at most
``max_wait_ms`` for more to come. With ``attnkit serve --batching continuous`` a run's greedy
translations are batched continuously instead: a request's texts join the running decoding batch at its
next step and are answered as they end (:mod:`attnkit.engine.continuous`). The event loop only parses,
checks, measures lengths and awaits.

**Language models** (``task: lm``) answer ``/generate`` (:mod:`attnkit.serve.generation`): the model's
worker runs their requests by continuous batching (:mod:`attnkit.engine.continuous_lm`): a request's prompt
is run between two decoding steps and its row joins the running batch; its tokens go to the event loop as
they are chosen (an :class:`asyncio.Queue` per streamed request), and a request whose client goes away
leaves the batch at the next step. A request samples with its own seeded generator, so its text is
``attnkit generate``'s for the same seed and options, in float32 whatever else runs beside it. A CTranslate2 export of a
language model runs the requests that arrive together with the same options as one batch.

**Routes.** ``/generate`` is :func:`~attnkit.serve.generate_route.generate_text` (:mod:`attnkit.serve.generate_route`),
the ``/v1/`` routes are :mod:`attnkit.serve.openai_routes`'s (both send their generations through
:mod:`attnkit.serve.flights`), the others are functions of this module; each reads the app's
:class:`~attnkit.serve.routing.AppState` from ``request.app.state.serve``, and what several routes share (the model
a request names, the size checks, a job on the model's worker, attention joined as bytes) is in
:mod:`attnkit.serve.routing`. :func:`create_app` registers them. The request and response shapes are in
:mod:`attnkit.serve.schemas` (and :mod:`attnkit.serve.openai_schemas`).

**Errors.** Every error is JSON ``{"error": "..."}`` (under ``/v1/``, OpenAI's shape) with a 4xx status: 422
for a request that does not fit the schema (naming the field), 413 for too many texts (``max_texts``;
``max_attention_texts`` when the request asks for attention), a too-long text or a too-large body,
404 for an unknown model, 401 for a missing or wrong API key, 503 with ``Retry-After`` when the
model's queue is full, 429 with ``Retry-After`` when a language model has ``max_streams`` generations in
flight; a ``/generate`` option out of range (or a prompt too long for the model's positions) is 422, a
prompt longer than ``max_chars`` 413. What a client sends is bounded before the API key is asked for
(:mod:`attnkit.serve.connections`, :class:`_Gate`): 414 and 431 for a head too large, 408 for a head or body
slower than ``read_timeout``, 503 for a connection beyond ``max_connections``. A bug is a 500 for the request
that met it alone (the workers run each request of a failed batch again alone, and a running batch lets the
failed text go), with ``Connection: close`` and one line on the log. SIGTERM (or Ctrl-C) stops accepting
connections, finishes the requests in flight, then :func:`serve` returns (``attnkit serve`` exits 0).
"""

from __future__ import annotations

import asyncio
import hmac
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from importlib.resources import files
from types import FrameType
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from ..common.errors import UserError
from ..common.memory import freeze_long_lived, share_one_heap
from ..engine import Engine
from ..viz.explorer import fill_page, script_json
from .batching import Limits, ModelWorker
from .connections import REFUSED, BoundedHttp
from .generate_route import generate_text
from .metrics import CONTENT_TYPE, Measured
from .openai_routes import register as register_openai
from .openai_schemas import OPENAI_PREFIX, error_answer, validation_answer
from .routing import (
    AppState,
    app_state,
    attention_jsons,
    check_size,
    log_internal_error,
    pick,
    run_on_worker,
    with_attention,
)
from .schemas import (
    ClassifyRequest,
    ClassifyResponse,
    GenerateResponse,
    Prediction,
    TranslateRequest,
    TranslateResponse,
)
from .servables import Servable, load_servable

__all__ = ["AppState", "create_app", "listen", "serve"]

#: Paths that need the API key when one is set; the page, /health and the OpenAPI page do not.
PROTECTED = ("/models", "/translate", "/classify", "/generate", "/metrics", OPENAI_PREFIX)
#: The page's Content-Security-Policy: it loads nothing from anywhere but this server.
PAGE_POLICY = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'"


# --------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------


#: The header that ends a connection after its answer: sent with every answer given before the request's body was
#: read whole (what is left of it cannot be told from a next request), and with every 500.
CLOSE = {"Connection": "close"}


class _Gate:
    """ASGI middleware run before FastAPI reads a request: the head's size, the API key, then the body; and the last
    word on a bug.

    A head that :class:`~attnkit.serve.connections.BoundedHttp` marked too large (:data:`~.connections.REFUSED`)
    is answered 414 or 431 first. The key is checked next (no body is read for a client without it), in constant
    time. The body is read here up to ``max_body`` bytes (413 beyond; a ``Content-Length`` above it is refused
    before reading) within ``read_timeout`` seconds (408 beyond: a body that stalls, or never ends, holds no
    connection), checked to be UTF-8 and handed on whole. An answer given before the body was read closes the
    connection (:data:`CLOSE`).

    An exception that escapes the app (FastAPI has answered it with a JSON 500 that closes the connection,
    :func:`_internal_error`) ends here, logged in one line (:func:`~.routing.log_internal_error`) instead of
    uvicorn's traceback; if nothing was answered yet, the gate answers the 500.
    """

    def __init__(self, app: Any, api_key: str | None, limits: Limits) -> None:
        self.app, self.api_key, self.limits = app, api_key, limits

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if (refused := scope.get(REFUSED)) is not None:
            await error_answer(path, *refused, CLOSE)(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length", "0")  # none: a chunked body, counted as it comes
        unread = CLOSE if length != "0" or "transfer-encoding" in headers else None  # a body follows
        if self.api_key is not None and path.startswith(PROTECTED):
            given = headers.get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""  # header bytes, decoded as latin-1
            if not hmac.compare_digest(token.encode("latin-1"), self.api_key.encode("utf-8")):
                reason = "missing" if not given else "wrong"
                await error_answer(path, 401, f"API key {reason}: send the header Authorization: Bearer KEY",
                                   {"WWW-Authenticate": "Bearer", **(unread or {})})(scope, receive, send)
                return
        if not length.isdigit():
            await error_answer(path, 400, f"Content-Length {length!r} is not a number", CLOSE)(scope, receive, send)
            return
        max_body = self.limits.max_body
        if int(length) > max_body:
            await error_answer(path, 413, f"request body of {length} bytes is more than the limit {max_body} "
                                          "(--max-body)", CLOSE)(scope, receive, send)
            return
        body = await self._body(scope, receive, send)
        if body is None:
            return
        try:
            body.decode("utf-8")  # JSON is UTF-8 (RFC 8259); say where it is not, rather than "cannot parse"
        except UnicodeDecodeError as e:
            await error_answer(path, 400, f"body: not valid UTF-8 (byte 0x{body[e.start]:02x} at position "
                                          f"{e.start}); send UTF-8 text")(scope, receive, send)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self._run(scope, replay, send)

    async def _body(self, scope: dict, receive: Callable, send: Callable) -> bytes | None:
        """The request's body, read within ``max_body`` bytes and ``read_timeout`` seconds; None once answered
        (413, 408) or when the client went away."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.read_timeout
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                await error_answer(scope["path"], 408, f"request body: not received within "
                                   f"{self.limits.read_timeout:g} s (--read-timeout)", CLOSE)(scope, receive, send)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body:
                await error_answer(scope["path"], 413, f"request body is more than the limit "
                                   f"{self.limits.max_body} bytes (--max-body)", CLOSE)(scope, receive, send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _run(self, scope: dict, receive: Callable, send: Callable) -> None:
        """The app on the request; a bug that escapes it is logged in one line and answered 500 if it was not."""
        started = False

        async def watched(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            log_internal_error(f"{scope['method']} {scope['path']}", e)
            if not started:
                await _bug(scope["path"], e)(scope, receive, send)


async def _lifespan(app: FastAPI):
    state: AppState = app.state.serve
    state.workers.update({name: ModelWorker(name, state.limits, state.metrics.on_batch(name), state.threads,
                                            servable.warm_up) for name, servable in state.models.items()})
    yield
    await asyncio.get_running_loop().run_in_executor(None, lambda: [w.close() for w in state.workers.values()])


def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return error_answer(request.url.path, exc.status_code, str(exc.detail), getattr(exc, "headers", None), exc)


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return _bug(request.url.path, exc)


def _bug(path: str, exc: Exception) -> JSONResponse:
    # a bug still answers in JSON, and ends the connection (its state is unknown); the gate logs it (_Gate._run)
    return error_answer(path, 500, f"internal error ({type(exc).__name__})", CLOSE)


async def index(request: Request) -> HTMLResponse:
    return HTMLResponse(app_state(request).page, headers={"Content-Security-Policy": PAGE_POLICY})


async def health(request: Request) -> dict:
    state = app_state(request)
    return {"status": "ok", "api_key_required": state.api_key is not None,
            "models": {name: worker.stats() for name, worker in state.workers.items()}}


async def metrics(request: Request) -> Response:
    return Response(app_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def list_models(request: Request) -> dict[str, list[dict]]:
    return {"models": [asdict(s.info) for s in app_state(request).models.values()]}


async def translate(req: TranslateRequest, request: Request) -> TranslateResponse | Response:
    state = app_state(request)
    servable = pick(state, req.model, "translate")
    check_size(state.limits, req.texts, req.attention)
    beam = servable.info.beam if req.beam is None else req.beam
    lenpen = servable.info.lenpen if req.lenpen is None else req.lenpen
    if req.n_best > beam:
        raise HTTPException(422, f"n_best: {req.n_best} is more than the beam {beam}; ask for a beam of at "
                                 "least n_best")
    greedy = beam == 1 and req.n_best == 1  # greedy translations join the continuous decoder, where there is one
    hyps = await run_on_worker(request, servable, ("translate", beam, req.n_best, lenpen),
                               partial(servable.translate, beam=beam, n_best=req.n_best, lenpen=lenpen), req.texts,
                               servable.stepper if greedy else None)
    response = TranslateResponse(model=servable.info.name, translations=[h[0] for h in hyps],
                                 n_best=hyps if req.n_best > 1 else None)
    if not req.attention:
        return response
    maps = partial(servable.attention, beam=beam, lenpen=lenpen)
    attention = await run_on_worker(request, servable, ("attention", beam, lenpen), partial(attention_jsons, maps),
                                    req.texts)
    return with_attention(response, attention, sent=state.workers[servable.info.name].release_soon)


async def classify(req: ClassifyRequest, request: Request) -> ClassifyResponse | Response:
    state = app_state(request)
    servable = pick(state, req.model, "classify")
    check_size(state.limits, req.texts, req.attention)
    classes = servable.info.classes or []
    probs = await run_on_worker(request, servable, ("classify",), servable.classify, req.texts)
    results = [Prediction(label=classes[max(range(len(p)), key=p.__getitem__)],
                          probabilities=dict(zip(classes, p, strict=True))) for p in probs]
    response = ClassifyResponse(model=servable.info.name, results=results)
    if not req.attention:
        return response
    maps = partial(servable.attention, beam=1, lenpen=0.0)
    attention = await run_on_worker(request, servable, ("attention",), partial(attention_jsons, maps), req.texts)
    return with_attention(response, attention, sent=state.workers[servable.info.name].release_soon)


def create_app(servables: list[Servable], limits: Limits | None = None, api_key: str | None = None,
               threads: int | None = None) -> Any:
    """The ASGI app serving ``servables`` (each under ``info.name``): FastAPI behind :class:`_Gate`, behind
    :class:`~attnkit.serve.metrics.Measured` (which counts and times every request, refused ones too).
    ``threads``: torch's intra-op threads on each model's worker thread (:class:`~.batching.ModelWorker`).

    Its workers start with the app (lifespan) and are drained when it shuts down.
    """
    limits = limits or Limits()
    models = {s.info.name: s for s in servables}
    if len(models) != len(servables):
        names = [s.info.name for s in servables]
        twice = sorted({n for n in names if names.count(n) > 1})
        raise UserError(f"two models are named {twice[0]!r} (a model is served under its run directory's name); "
                        "rename or link one of the directories")
    app = FastAPI(title="attnkit serve", version="1", lifespan=_lifespan,
                  description="Translation, classification and generation with attnkit models, with their "
                              "attention; an OpenAI-compatible API under /v1/. Errors are JSON {\"error\": \"...\"} "
                              "with a 4xx status (under /v1/, OpenAI's {\"error\": {\"message\", ...}}).")
    page = fill_page(files(__package__).joinpath("serve.html"), {"__ATTNKIT_LIMITS__": script_json(asdict(limits))})
    app.state.serve = AppState(models, limits, api_key, page, threads)
    app.add_exception_handler(RequestValidationError, validation_answer)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.get("/", response_class=HTMLResponse, include_in_schema=False)(index)
    app.get("/health")(health)
    app.get("/models")(list_models)
    app.post("/translate", response_model=TranslateResponse, response_model_exclude_none=True)(translate)
    app.post("/classify", response_model=ClassifyResponse, response_model_exclude_none=True)(classify)
    app.post("/generate", response_model=GenerateResponse, response_model_exclude_none=True)(generate_text)
    register_openai(app)
    app.get("/metrics", response_class=Response, include_in_schema=False)(metrics)
    return Measured(_Gate(app, api_key, limits), app.state.serve.metrics)


# --------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: a free one), for uvicorn to listen on.

    :raises UserError: the address cannot be used (in use, not this machine's, no permission).
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        # proto must say TCP: asyncio sets TCP_NODELAY on the connections only then, and without it a
        # response written in two parts waits for the client's delayed ACK (test_connections_get_tcp_nodelay)
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # connections queue from here on, before uvicorn takes the socket over
    except (OSError, OverflowError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise UserError(f"--host {host} --port {port}: cannot listen there ({reason}); pick another port "
                        "(--port 0 picks a free one)") from None
    return sock


#: CPython's GIL switch interval while serving. The model worker and the event loop are two threads of one process:
#: a thread that wants the GIL while the other runs Python waits up to this long for it. CPython's default is kept,
#: set here so that it is one explicit choice: a shorter interval did not serve faster (docs/serving.md).
SWITCH_INTERVAL_S = 0.005


class _Server(uvicorn.Server):
    """uvicorn's server, stopped by SIGTERM or Ctrl-C as uvicorn stops (no new connections; the requests in flight
    answered, within 60 s; the models' workers drained) but without raising the signal again once stopped: uvicorn
    does, so that a clean shutdown ended in death by SIGTERM (exit status 143). ``stopped_by``: the signal's
    name."""

    stopped_by: str | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.stopped_by = self.stopped_by or signal.Signals(sig).name
        if self.should_exit and sig == signal.SIGINT:  # a second Ctrl-C: stop now (uvicorn's rule)
            self.force_exit = True
        self.should_exit = True


def serve(paths: list[str], *, host: str = "127.0.0.1", port: int = 8000, threads: int | None = None,
          api_key: str | None = None, limits: Limits | None = None, engine: Engine | None = None,
          continuous: bool = False, device: torch.device | None = None) -> str | None:
    """Load the models at ``paths`` (runs run as ``engine`` says, translating greedily by continuous batching
    when ``continuous``, language models on ``device``),
    listen on ``host:port`` and serve until SIGTERM or Ctrl-C; returns the name of the signal that stopped it.

    Prints ``attnkit serve: http://HOST:PORT/ ...`` once it accepts requests (the port is the real one
    when ``port`` is 0). Connections are :class:`~attnkit.serve.connections.BoundedHttp`'s (``limits``), and no
    WebSocket is accepted.
    """
    limits = limits or Limits()
    share_one_heap()  # before the workers' threads start: then an idle trim gives back all they freed
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # Each model's worker thread computes with `threads`, the main thread (loading, the event loop) with one. OpenMP
    # keeps a pool of threads for each thread that starts a parallel region, and libgomp, managing more threads
    # than there are cores, lets idle ones sleep at once instead of spinning, so every parallel region pays to wake
    # them. One pool per model, on its worker, keeps the compute threads awake (docs/serving.md).
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(1)
    app = create_app([load_servable(p, threads, engine, continuous, device) for p in paths], limits,
                     api_key, threads)
    freeze_long_lived()  # the models and the app stay: full collections while serving need not scan them
    sock = listen(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    server = _Server(uvicorn.Config(app, http=partial(BoundedHttp, limits=limits), ws="none", log_level="warning",
                                    access_log=False, lifespan="on", timeout_graceful_shutdown=60))
    print(f"attnkit serve: http://{url_host}:{bound_port}/ (API docs: /docs; {threads} threads)",
          flush=True)
    server.run(sockets=[sock])
    return server.stopped_by
