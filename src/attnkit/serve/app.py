"""Serving trained models over HTTP: ``attnkit serve RUN [RUN ...]``, a FastAPI app on uvicorn.

=========================  ==========================================================================
endpoint                   what it does
=========================  ==========================================================================
``GET /``                  a page: pick a model, type sentences, see the translations (or classes);
                           click one to open its attention explorer (script and style inlined)
``GET /health``            ``{"status": "ok", "api_key_required": ..., "models": {name: {"queued",
                           "batches", "texts"}}}``: texts waiting, batches and texts run so far
``GET /models``            name, task, languages, parameters, beam defaults (and classes) per model
``POST /translate``        ``{"model", "texts": [...], "beam", "n_best", "lenpen", "attention"}``
``POST /classify``         ``{"model", "texts": [...], "attention"}`` -> labels and probabilities
``GET /docs``              FastAPI's OpenAPI page (``/openapi.json`` is the schema)
=========================  ==========================================================================

**Models.** Each is loaded by :func:`load_servable` into a :class:`Servable` and served under its
run directory's name. Translation uses :func:`attnkit.inference.translate.translate_texts`,
classification :func:`attnkit.inference.classify.predict`, attention
:func:`attnkit.inference.attention_maps.attention_maps` (drawn by the explorer's own script,
:mod:`attnkit.viz.explorer`): results are those of ``attnkit translate`` /
``classify`` / ``attention`` for the same inputs.

**Dynamic batching** (:mod:`attnkit.serve.batching`). One inference thread owns each model; concurrent
requests with the same decoding parameters are merged into one batch of at most ``max_batch``
texts, waiting at most ``max_wait_ms`` for more to come. The event loop only parses, checks and
awaits.

**Errors.** Every error is JSON ``{"error": "..."}`` with a 4xx status: 422 for a request that does
not fit the schema (naming the field), 413 for too many texts, a too-long text or a too-large body,
404 for an unknown model, 401 for a missing or wrong API key, 503 with ``Retry-After`` when the
model's queue is full. SIGTERM (or Ctrl-C) stops accepting connections, finishes the requests in
flight, then exits.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import re
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from ..common.errors import UserError
from ..inference.attention_maps import AttentionMaps, attention_maps
from ..inference.classify import predict
from ..inference.translate import translate_texts
from ..runs.layout import find_weights
from ..runs.load import LoadedRun, load_run
from ..viz.explorer import explorer_data, fill_page, script_json
from .batching import Limits, ModelWorker, QueueFull

__all__ = ["ModelInfo", "RunServable", "Servable", "create_app", "load_servable", "serve"]

#: Largest beam a request may ask for (the search keeps beam x texts hypotheses in memory).
MAX_BEAM = 16
#: Paths that need the API key when one is set; the page, /health and the OpenAPI page do not.
PROTECTED = ("/models", "/translate", "/classify")
#: Seconds a client is told to wait (``Retry-After``) when a model's queue is full.
RETRY_AFTER = 1


# --------------------------------------------------------------------------------------
# What is served
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """What ``GET /models`` tells about a model."""

    name: str
    task: Literal["translate", "classify"]
    architecture: str
    source_language: str | None
    target_language: str | None
    parameters: int
    beam: int | None  # decoding defaults (translation)
    lenpen: float | None
    classes: list[str] | None  # classification


class Servable(Protocol):
    """A model the server can run; :func:`load_servable` makes one from a path.

    Calls come from the model's one worker thread, never two at a time. ``translate`` returns the
    n-best list of every text, ``classify`` the class probabilities of every text (in the order of
    ``info.classes``), ``attention`` every attention map of one text (:class:`AttentionMaps`).
    Each raises :class:`UserError` for what the model cannot do.
    """

    info: ModelInfo

    def translate(self, texts: list[str], *, beam: int, n_best: int, lenpen: float) -> list[list[str]]: ...
    def classify(self, texts: list[str]) -> list[list[float]]: ...
    def attention(self, text: str, *, beam: int, lenpen: float) -> AttentionMaps: ...


def language(path: str | None) -> str | None:
    """The two-letter language code in a corpus file name (``train.de.gz`` -> ``de``), if it has one."""
    suffixes = [s[1:] for s in Path(path or "").suffixes if s != ".gz"]
    return suffixes[-1] if suffixes and re.fullmatch(r"[a-z]{2}", suffixes[-1]) else None


class RunServable:
    """A run directory of ``attnkit train`` (translation or classification), run by attnkit itself."""

    def __init__(self, run: LoadedRun, name: str) -> None:
        self.run = run
        cfg = run.cfg
        if cfg.task == "pretrain":
            raise UserError(f"{name} is a pretraining run: it neither translates nor classifies; serve a run "
                            f"fine-tuned from it (model.init_from)")
        translate = cfg.task == "translate"
        self.info = ModelInfo(
            name=name, task=cfg.task,
            architecture=cfg.model.arch if translate else "transformer classifier",
            source_language=language(cfg.data.train) if translate and cfg.data.train_tgt else None,
            target_language=language(cfg.data.train_tgt) if translate else None,
            parameters=sum(p.numel() for p in run.model.parameters()),
            beam=cfg.decode_beam if translate else None, lenpen=cfg.decode_lenpen if translate else None,
            classes=run.classes)

    def translate(self, texts: list[str], *, beam: int, n_best: int, lenpen: float) -> list[list[str]]:
        return translate_texts(self.run.model, self.run.tok, texts, beam=beam, lenpen=lenpen, n_best=n_best)

    def classify(self, texts: list[str]) -> list[list[float]]:
        return predict(self.run, texts)[0].tolist()

    def attention(self, text: str, *, beam: int, lenpen: float) -> AttentionMaps:
        return attention_maps(self.run, text, beam=beam, lenpen=lenpen)


class ExportedServable:
    """A directory written by ``attnkit export --to ctranslate2``, run by CTranslate2 (translation only)."""

    def __init__(self, path: Path, threads: int = 0) -> None:
        from ..export.ctranslate2 import ExportedTranslator

        self.translator = ExportedTranslator(path, threads=threads)
        source, target = self.translator.languages or (None, None)  # [src, tgt] as the export recorded them
        self.info = ModelInfo(
            name=Path(os.path.abspath(path)).name, task="translate",
            architecture=f"transformer (CTranslate2 {self.translator.quantization})",
            source_language=source, target_language=target,
            parameters=self.translator.parameters, beam=self.translator.decode.beam,
            lenpen=self.translator.decode.lenpen, classes=None)

    def translate(self, texts: list[str], *, beam: int, n_best: int, lenpen: float) -> list[list[str]]:
        d = self.translator.decode
        return self.translator.translate(texts, beam=beam, n_best=n_best, lenpen=lenpen, max_len_a=d.max_len_a,
                                         max_len_b=d.max_len_b)

    def classify(self, texts: list[str]) -> list[list[float]]:
        raise UserError(f"{self.info.name} is a translation model")

    def attention(self, text: str, *, beam: int, lenpen: float) -> AttentionMaps:
        raise UserError(f"{self.info.name} is a CTranslate2 export, which gives no attention weights; serve the run "
                        f"directory it was exported from to see them")


def load_servable(path: str | Path, threads: int = 0) -> Servable:
    """The model at ``path``, named after its directory: a run directory (or a ``.safetensors``
    checkpoint inside one), or a CTranslate2 export of one (``attnkit export``).

    :raises UserError: ``path`` is not something that can be served.
    """
    from ..export.ctranslate2 import is_exported

    if is_exported(Path(path)):
        return ExportedServable(Path(path), threads)
    run_dir, _ = find_weights(Path(path))
    return RunServable(load_run(path), Path(os.path.abspath(run_dir)).name)  # a symbolic link's own name


# --------------------------------------------------------------------------------------
# Requests and responses
# --------------------------------------------------------------------------------------


class _Strict(BaseModel):
    # JSON types as given (no "4" for 4, no 2.0 for 2) and no unknown fields: a misspelt field is an error
    model_config = ConfigDict(strict=True, extra="forbid")


def _texts_field() -> Any:
    return Field(min_length=1, description="the sentences (translation) or texts (classification), one per item")


def _check_unicode(texts: list[str]) -> list[str]:
    """Texts are sent as UTF-8 to the tokenizer: a lone surrogate (``"\\ud800"`` in JSON) cannot be."""
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise PydanticCustomError("lone_surrogate", "texts[{index}] holds a lone surrogate (\\ud800-\\udfff), "
                                      "which is not a character; send valid Unicode", {"index": i}) from None
    return texts


class TranslateRequest(_Strict):
    model: str | None = Field(None, description="the model's name (GET /models); optional when one "
                                                "translation model is served")
    texts: list[str] = _texts_field()
    beam: int | None = Field(None, ge=1, le=MAX_BEAM, description="beam size, 1 = greedy (default: the model's)")
    n_best: int = Field(1, ge=1, le=MAX_BEAM, description="hypotheses per text, at most beam")
    lenpen: float | None = Field(None, ge=-10.0, le=10.0, allow_inf_nan=False,
                                 description="GNMT length penalty alpha (default: the model's)")
    attention: bool = Field(False, description="also return every attention map of each text (explorer data)")

    _unicode = field_validator("texts")(_check_unicode)


class ClassifyRequest(_Strict):
    model: str | None = Field(None, description="the model's name (GET /models); optional when one "
                                                "classification model is served")
    texts: list[str] = _texts_field()
    attention: bool = Field(False, description="also return each text's attention maps (explorer data)")

    _unicode = field_validator("texts")(_check_unicode)


class TranslateResponse(BaseModel):
    model: str
    translations: list[str] = Field(description="the best translation of each text")
    n_best: list[list[str]] | None = Field(None, description="with n_best > 1: every text's hypotheses, best first")
    attention: list[dict] | None = Field(
        None, description="with attention: per text {title, views: [{kind, title, queries, keys, queries_label, "
                          "keys_label, layers: [layer][head][query][key]}]}; the cross-attention view has the "
                          "target pieces as queries and the source pieces as keys")


class Prediction(BaseModel):
    label: str
    probabilities: dict[str, float]


class ClassifyResponse(BaseModel):
    model: str
    results: list[Prediction]
    attention: list[dict] | None = None


def _error(status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status, headers=headers)


def _where(loc: tuple) -> str:
    """``("body", "texts", 3)`` -> ``texts[3]``."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    problems = []
    for e in errors:
        if e.get("type") == "json_invalid":
            problems.append(f"body: not valid JSON ({e.get('ctx', {}).get('error', 'decode error')} at character "
                            f"{e['loc'][-1]})")
            continue
        problem = f"{_where(tuple(e['loc']))}: {e['msg']}"
        if tuple(e["loc"]) == ("body",) and "json" not in request.headers.get("content-type", ""):
            problem += " (send JSON with the header Content-Type: application/json)"
        problems.append(problem)
    detail = [{"field": "body" if e.get("type") == "json_invalid" else _where(tuple(e["loc"])), "message": e["msg"],
               "type": e["type"]} for e in errors]
    return _error(422, "; ".join(problems), detail=detail)


# --------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------


class _Gate:
    """ASGI middleware run before FastAPI reads a request: the API key, then the body size.

    The key is checked first (no body is read for a client without it), in constant time. The body
    is read here up to ``max_body`` bytes (413 beyond; a ``Content-Length`` above it is refused
    before reading), checked to be UTF-8 and handed on whole.
    """

    def __init__(self, app: Any, api_key: str | None, max_body: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.api_key is not None and scope["path"].startswith(PROTECTED):
            given = headers.get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""  # header bytes, decoded as latin-1
            if not hmac.compare_digest(token.encode("latin-1"), self.api_key.encode("utf-8")):
                reason = "missing" if not given else "wrong"
                await _error(401, f"API key {reason}: send the header Authorization: Bearer KEY",
                             {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        length = headers.get("content-length", "0")  # none: a chunked body, counted as it comes
        if not length.isdigit():
            await _error(400, f"Content-Length {length!r} is not a number")(scope, receive, send)
            return
        if int(length) > self.max_body:
            await _error(413, f"request body of {length} bytes is more than the limit {self.max_body} "
                              "(--max-body)")(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await _error(413, f"request body is more than the limit {self.max_body} bytes (--max-body)")(
                    scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False
        try:
            body.decode("utf-8")  # JSON is UTF-8 (RFC 8259); say where it is not, rather than "cannot parse"
        except UnicodeDecodeError as e:
            await _error(400, f"body: not valid UTF-8 (byte 0x{body[e.start]:02x} at position {e.start}); "
                              "send UTF-8 text")(scope, receive, send)
            return

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def create_app(servables: list[Servable], limits: Limits | None = None, api_key: str | None = None) -> Any:
    """The ASGI app serving ``servables`` (each under ``info.name``): FastAPI behind :class:`_Gate`.

    Its workers start with the app (lifespan) and are drained when it shuts down.
    """
    limits = limits or Limits()
    models = {s.info.name: s for s in servables}
    if len(models) != len(servables):
        names = [s.info.name for s in servables]
        twice = sorted({n for n in names if names.count(n) > 1})
        raise UserError(f"two models are named {twice[0]!r} (a model is served under its run directory's name); "
                        "rename or link one of the directories")
    workers: dict[str, ModelWorker] = {}

    async def lifespan(app: FastAPI):
        workers.update({name: ModelWorker(name, limits) for name in models})
        yield
        await asyncio.get_running_loop().run_in_executor(None, lambda: [w.close() for w in workers.values()])

    app = FastAPI(title="attnkit serve", version="1", lifespan=lifespan,
                  description="Translation and classification with attnkit models, with their attention. "
                              "Errors are JSON {\"error\": \"...\"} with a 4xx status.")
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, lambda request, exc: _error(exc.status_code, str(exc.detail),
                                                                         getattr(exc, "headers", None)))
    # a bug still answers in JSON (uvicorn logs the traceback)
    app.add_exception_handler(Exception, lambda request, exc: _error(500, f"internal error ({type(exc).__name__})"))
    page = fill_page(files(__package__).joinpath("serve.html"), {"__ATTNKIT_LIMITS__": script_json(asdict(limits))})

    def pick(name: str | None, task: str) -> Servable:
        if name is None:
            fitting = [s for s in servables if s.info.task == task]
            if len(fitting) == 1:
                return fitting[0]
            raise HTTPException(422, f"model: give the model's name, one of {sorted(models)}")
        if name not in models:
            raise HTTPException(404, f"model {name!r} is not served here; GET /models lists {sorted(models)}")
        servable = models[name]
        if servable.info.task != task:
            other = "/classify" if task == "translate" else "/translate"
            raise HTTPException(422, f"model: {name!r} is a {servable.info.task} model; use {other}")
        return servable

    def check_size(texts: list[str]) -> None:
        if len(texts) > limits.max_texts:
            raise HTTPException(413, f"texts: {len(texts)} texts in one request, more than the limit "
                                     f"{limits.max_texts} (--max-texts); send them in several requests")
        for i, text in enumerate(texts):
            if len(text) > limits.max_chars:
                raise HTTPException(413, f"texts[{i}]: {len(text)} characters, more than the limit "
                                         f"{limits.max_chars} (--max-chars); split the text")

    async def run(servable: Servable, key: tuple, fn: Callable[[list[str]], list], texts: list[str]) -> list:
        try:
            future = workers[servable.info.name].submit(key, fn, texts)
        except QueueFull:
            raise HTTPException(503, f"model {servable.info.name!r} is busy ({limits.max_queue} texts queued, "
                                     "--max-queue); retry shortly", headers={"Retry-After": str(RETRY_AFTER)}) from None
        try:
            return await future
        except UserError as e:
            raise HTTPException(422, str(e)) from None

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        # the page loads nothing from anywhere but this server
        return HTMLResponse(page, headers={"Content-Security-Policy": "default-src 'none'; script-src "
                                           "'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'"})

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "api_key_required": api_key is not None,
                "models": {name: worker.stats() for name, worker in workers.items()}}

    @app.get("/models")
    async def list_models() -> dict[str, list[dict]]:
        return {"models": [asdict(s.info) for s in servables]}

    @app.post("/translate", response_model=TranslateResponse, response_model_exclude_none=True)
    async def translate(req: TranslateRequest) -> TranslateResponse:
        servable = pick(req.model, "translate")
        check_size(req.texts)
        beam = servable.info.beam if req.beam is None else req.beam
        lenpen = servable.info.lenpen if req.lenpen is None else req.lenpen
        if req.n_best > beam:
            raise HTTPException(422, f"n_best: {req.n_best} is more than the beam {beam}; ask for a beam of at "
                                     "least n_best")
        hyps = await run(servable, ("translate", beam, req.n_best, lenpen),
                         partial(servable.translate, beam=beam, n_best=req.n_best, lenpen=lenpen), req.texts)
        attention = None
        if req.attention:
            maps = partial(servable.attention, beam=beam, lenpen=lenpen)
            attention = await run(servable, ("attention", beam, lenpen),
                                  lambda texts: [explorer_data(maps(t)) for t in texts], req.texts)
        return TranslateResponse(model=servable.info.name, translations=[h[0] for h in hyps],
                                 n_best=hyps if req.n_best > 1 else None, attention=attention)

    @app.post("/classify", response_model=ClassifyResponse, response_model_exclude_none=True)
    async def classify(req: ClassifyRequest) -> ClassifyResponse:
        servable = pick(req.model, "classify")
        check_size(req.texts)
        classes = servable.info.classes or []
        probs = await run(servable, ("classify",), servable.classify, req.texts)
        attention = None
        if req.attention:
            maps = partial(servable.attention, beam=1, lenpen=0.0)
            attention = await run(servable, ("attention",), lambda texts: [explorer_data(maps(t)) for t in texts],
                                  req.texts)
        results = [Prediction(label=classes[max(range(len(p)), key=p.__getitem__)],
                              probabilities=dict(zip(classes, p, strict=True))) for p in probs]
        return ClassifyResponse(model=servable.info.name, results=results, attention=attention)

    return _Gate(app, api_key, limits.max_body)


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
        # response written in two parts waits for the client's delayed ACK (benchmarks/README.md)
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # connections queue from here on, before uvicorn takes the socket over
    except (OSError, OverflowError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise UserError(f"--host {host} --port {port}: cannot listen there ({reason}); pick another port "
                        "(--port 0 picks a free one)") from None
    return sock


def serve(paths: list[str], *, host: str = "127.0.0.1", port: int = 8000, threads: int | None = None,
          api_key: str | None = None, limits: Limits | None = None) -> None:
    """Load the models at ``paths``, listen on ``host:port`` and serve until SIGTERM or Ctrl-C.

    Prints ``attnkit serve: http://HOST:PORT/ ...`` once it accepts requests (the port is the real one
    when ``port`` is 0).
    """
    import uvicorn

    if threads is not None:
        torch.set_num_threads(threads)
    app = create_app([load_servable(p, threads or 0) for p in paths], limits, api_key)
    sock = listen(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=60))
    print(f"attnkit serve: http://{url_host}:{bound_port}/ (API docs: /docs; {torch.get_num_threads()} threads)",
          flush=True)
    server.run(sockets=[sock])

