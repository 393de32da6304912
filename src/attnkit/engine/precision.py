"""Precision by measurement: float32 or bfloat16, whichever computes this model's matrix products faster here.

A CPU flag does not say whether bf16 pays. With AMX a bf16 product is several times faster than a float32 one;
with AVX512-BF16 alone bf16 autocast can train slower than float32 (each product first casts its float32 weight,
and small matrices gain little from the faster kernel), and decoding under autocast casts every weight at every
step. So ``precision: auto`` times the model's own products, float32 against bf16, on this host::

    shapes    the model's nn.Linear weights grouped by shape s = (out, in): count_s matrices of each
              (a weight tied to another is one matrix)
    workload  train:   rows = the tokens of one pass; y = x W^T, then dx and dW (forward and backward),
                       float32 against bf16 autocast over float32 weights, as the trainer computes, and
                       float32 through oneDNN rather than the BLAS (:mod:`.onednn`), where torch has it
              forward: rows = a prompt's (or a batch's) tokens; y = x W^T, float32 against bf16 weights
              decode:  rows = the batch (1: one matrix-vector product per weight), float32 against bf16 weights
    timed     train, forward: one product per shape, its rows m_s <= rows and output rows o_s <= out cut down
                       to about FLOPS_PER_PRODUCT (rows first, to MIN_ROWS, then outputs, to MIN_OUTPUTS)
              decode:  the model's own matrices, k_s of each shape (or the first o_s rows of one), the same
                       share of each shape's, at most DECODE_BYTES of float32 and DECODE_FLOPS in all, so that
                       they stream from memory as a decoding step's weights do
    rounds    after a warm-up, each shape in float32 then bf16 (then oneDNN), the order reversed every other
              round, ROUNDS rounds (fewer, but MIN_ROUNDS, past TIME_LIMIT seconds); per shape the median of the
              rounds
    estimate  t_p = sum_s median_s,p * count_s / k_s * rows / m_s * out / o_s   (seconds per pass, way p)
    choice    float32's time t_32 = t_onednn when t_float32 >= MARGIN * t_onednn (then the run's float32
              linear layers compute through oneDNN), else t_float32; bf16 when t_32 >= MARGIN * t_bf16, else
              float32

Timing fewer rows than a pass has counts a product's fixed cost (autocast's cast of the weight) ``rows / m_s``
times: a bias toward float32, the side the margin errs on anyway. Only the ``nn.Linear`` products are timed:
attention's own products, norms and the loss are left out.

A choice is kept in :func:`~attnkit.common.files.cache_dir` ``("precision")``, one JSON file per key: the CPU's
model name and flags (:func:`~.native.cpu_features`), torch's version, the thread count, the workload (kind, rows,
shapes) and what is compared, so a second run on the same host skips the measurement; an unreadable file is
measured again and replaced. On CUDA nothing is measured: bf16 where the GPU supports it.

At inference bf16 means bf16 *weights* (:func:`bf16_weights`), not autocast: nothing is cast per step.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..common.errors import UserError
from ..common.files import atomic_write_text, cache_dir
from .native import cpu_features
from .onednn import available as onednn_available
from .onednn import onednn_linear

__all__ = ["BF16_LOGIT_TOLERANCE", "Choice", "MARGIN", "PRECISIONS", "WAYS", "Workload", "bf16_weights", "calibrate",
           "choose_precision", "linear_weights", "training_precision"]

Precision = Literal["float32", "bf16"]
PRECISIONS: tuple[Precision, ...] = ("float32", "bf16")
#: What a calibration may time: the precisions, and float32 through oneDNN (training workloads, where torch has it).
WAYS: tuple[str, ...] = (*PRECISIONS, "onednn")
Kind = Literal["train", "forward", "decode"]

#: bf16 (or oneDNN) is chosen only when float32 (through the BLAS) takes at least this many times as long: noise
#: must not decide.
MARGIN = 1.10
#: The floating-point operations a timed product of a train or forward workload is cut down to.
FLOPS_PER_PRODUCT = 2e8
#: A timed product keeps at least this many rows (or all of the workload's) and output rows (or all the weight's),
#: where a matrix-matrix routine runs about as fast per row as on the whole.
MIN_ROWS = 256
MIN_OUTPUTS = 256
#: The float32 weights a decode workload streams through per round and precision, and its products' operations.
DECODE_BYTES = 256 * 2 ** 20
DECODE_FLOPS = 1e9
#: A measurement repeats a shape's products until it takes about this long (timer and call overheads).
MIN_BLOCK_SECONDS = 1e-3
MAX_REPEATS = 100
#: Rounds of measurements: ROUNDS, or MIN_ROUNDS once TIME_LIMIT seconds have passed.
ROUNDS, MIN_ROUNDS, TIME_LIMIT = 7, 3, 0.3
#: The rows an inference workload has when the caller does not say: a prompt's tokens, a batch of one.
DEFAULT_ROWS: dict[str, int] = {"forward": 128, "decode": 1}
#: Part of every cache key: a change in how the calibration measures makes earlier choices stale.
CALIBRATION_VERSION = 2  # 2: training workloads time float32 through oneDNN too
#: :func:`bf16_weights`' logits differ from float32's by at most this times the largest float32 logit
#: (``tests/test_precision.py`` holds a tiny LM and a tiny translation model to it): four times bf16's relative
#: precision, 2^-8, for the roundings of a whole model.
BF16_LOGIT_TOLERANCE = 2 ** -6


@dataclass(frozen=True)
class Workload:
    """What a calibration times: ``kind`` (train, forward, decode), the ``rows`` of each product, and the model's
    matrix ``shapes`` as ``(out, in, count)``, sorted."""

    kind: Kind
    rows: int
    shapes: tuple[tuple[int, int, int], ...]

    def describe(self) -> str:
        what = {"train": "forward and backward, float32 against bf16 autocast",
                "forward": "float32 against bf16 weights", "decode": "float32 against bf16 weights"}[self.kind]
        rows = f"{self.rows} row{'s' if self.rows > 1 else ''}"
        return f"the model's {len(self.shapes)} matrix shapes at {rows} ({what})"

    def to_json(self) -> dict:
        return {"kind": self.kind, "rows": self.rows, "shapes": [list(s) for s in self.shapes]}

    @classmethod
    def from_json(cls, data: dict) -> Workload:
        if data["kind"] not in ("train", "forward", "decode"):
            raise ValueError(f"unknown workload kind {data['kind']!r}")
        shapes = tuple((int(o), int(i), int(c)) for o, i, c in data["shapes"])
        return cls(data["kind"], int(data["rows"]), shapes)


@dataclass(frozen=True)
class Choice:
    """A precision and why: ``source`` is ``measured``, ``cached`` (measured by an earlier run on this host),
    ``asked`` (set explicitly), ``cuda`` (bf16 where the GPU supports it), ``resumed`` (a resumed training run
    computes as it started) or ``no matrices`` (nothing to time). ``seconds`` are the estimated seconds of one pass's
    products per way (``t_p`` of the module docstring: ``float32``, ``bf16``, and ``onednn`` where timed),
    ``rounds`` the rounds measured; ``onednn``, whether float32 linear layers compute through oneDNN
    (:func:`~.onednn.use_onednn`)."""

    precision: Precision
    source: str
    workload: Workload | None = None
    seconds: dict[str, float] | None = None
    rounds: int = 0
    host: dict | None = None  # cpu, torch, threads: where it was measured
    onednn: bool = False

    @property
    def bf16(self) -> bool:
        """Whether the choice is bf16 (autocast in training, bf16 weights at inference)."""
        return self.precision == "bf16"

    @property
    def speedup(self) -> float | None:
        """float32's time over bf16's: above 1, bf16 is the faster."""
        if not self.seconds:
            return None
        return self.seconds["float32"] / self.seconds["bf16"]

    def describe(self) -> str:
        """One line: the precision and the timings behind it."""
        name = self.precision
        if self.bf16 and self.workload is not None:
            name = "bf16 autocast" if self.workload.kind == "train" else "bf16 weights"
        if self.onednn:
            name += " through oneDNN"
        if self.seconds is None or self.workload is None:
            return f"{name} ({self.source})"
        t32, t16, dnn = self.seconds["float32"], self.seconds["bf16"], self.seconds.get("onednn")
        onednn = "" if dnn is None else (f", float32 through oneDNN {dnn * 1e3:.3f} ms "
                                         f"({t32 / dnn:.2f}x the BLAS's speed)")
        return (f"{name} ({self.source}: {self.workload.describe()}, {self.rounds} rounds: float32 "
                f"{t32 * 1e3:.3f} ms, bf16 {t16 * 1e3:.3f} ms per pass, bf16 {t32 / t16:.2f}x float32's speed"
                f"{onednn}; either is taken from {MARGIN:.2f}x)")

    def to_json(self) -> dict:
        """What a run records (and the cache keeps)."""
        # the speedup of the timings as written, so a run that read them from the cache records the same
        seconds = None if self.seconds is None else {p: float(f"{s:.4g}") for p, s in self.seconds.items()}
        return {"precision": self.precision, "source": self.source,
                "workload": None if self.workload is None else self.workload.to_json(),
                "seconds": seconds,
                "speedup": None if seconds is None else round(seconds["float32"] / seconds["bf16"], 3),
                "margin": MARGIN,
                "rounds": self.rounds, "host": self.host, "onednn": self.onednn}

    @classmethod
    def from_json(cls, data: dict) -> Choice:
        """The choice :meth:`to_json` wrote; ValueError, KeyError or TypeError where ``data`` is not one."""
        if data["precision"] not in PRECISIONS:
            raise ValueError(f"unknown precision {data['precision']!r}")
        seconds = data.get("seconds")
        if seconds is not None:
            seconds = {p: float(seconds[p]) for p in WAYS if p in PRECISIONS or p in seconds}  # float32, bf16 needed
            if not all(math.isfinite(s) and s > 0 for s in seconds.values()):
                raise ValueError(f"timings must be positive, got {seconds}")
        workload = data.get("workload")
        host = data.get("host")
        if host is not None and not isinstance(host, dict):
            raise TypeError("host must be an object")
        onednn = data.get("onednn", False)  # absent in what runs before it recorded
        if not isinstance(onednn, bool):
            raise TypeError("onednn must be true or false")
        return cls(data["precision"], str(data["source"]), None if workload is None else Workload.from_json(workload),
                   seconds, int(data.get("rounds", 0)), host, onednn)


# -- the model's matrices ------------------------------------------------------------------------------------------


def linear_weights(model: nn.Module) -> dict[tuple[int, int], list[Tensor]]:
    """The model's ``nn.Linear`` weights by shape ``(out, in)``, in module order; a weight shared by several layers
    (an output layer tied to another) once."""
    groups: dict[tuple[int, int], list[Tensor]] = {}
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            out, inp = module.weight.shape
            groups.setdefault((out, inp), []).append(module.weight)
    return groups


def workload_of(groups: dict[tuple[int, int], list[Tensor]], kind: Kind, rows: int) -> Workload:
    """The :class:`Workload` of the matrices ``groups`` (:func:`linear_weights`)."""
    if rows < 1:
        raise ValueError(f"a workload needs at least one row, got {rows}")
    return Workload(kind, rows, tuple(sorted((out, inp, len(ws)) for (out, inp), ws in groups.items())))


# -- what is timed ---------------------------------------------------------------------------------------------------


@dataclass
class Timed:
    """One shape's timed products: a call per way (:data:`WAYS`), and ``scale``, the factor from a call's time to
    the shape's share of a pass (``count_s / k_s * rows / m_s * out / o_s``); ``repeats``, the calls per
    measurement (set by :func:`measure`)."""

    shape: tuple[int, int]
    run: dict[str, Callable[[], object]]
    scale: float
    repeats: dict[str, int] = field(default_factory=dict)


def _train_products(weight: Tensor, rows: int, outputs: int, generator: torch.Generator) -> dict:
    """Forward and backward of ``y = x W^T`` over the first ``outputs`` rows of ``weight``, float32, under bf16
    autocast (the weight stays float32 and is cast by autocast, as in training) and, where torch has it, float32
    through oneDNN (:func:`~.onednn.onednn_linear`)."""
    w = weight.detach()[:outputs].float().clone().requires_grad_()  # (o, in)
    x = torch.randn(rows, w.size(1), generator=generator).requires_grad_()  # (m, in)
    grads = {p: torch.randn(rows, outputs, generator=generator).to(dtype)
             for p, dtype in (("float32", torch.float32), ("bf16", torch.bfloat16))}  # dL/dy (m, o)

    def float32() -> object:
        return torch.autograd.grad(F.linear(x, w), (x, w), grads["float32"])

    def bf16() -> object:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = F.linear(x, w)  # (m, o) bf16
        return torch.autograd.grad(y, (x, w), grads["bf16"])

    def onednn() -> object:
        return torch.autograd.grad(onednn_linear(x, w), (x, w), grads["float32"])
    return {"float32": float32, "bf16": bf16, **({"onednn": onednn} if onednn_available() else {})}


def _inference_products(weights: list[Tensor], rows: int, outputs: int, generator: torch.Generator) -> dict:
    """``y = x W^T`` for each of ``weights`` (their first ``outputs`` rows), float32 and with the weights in bf16
    (converted once, here: a bf16 model stores them so)."""
    w32 = [w.detach()[:outputs].float().contiguous() for w in weights]  # (o, in) each, views where they can be
    w16 = [w.to(torch.bfloat16) for w in w32]
    x32 = torch.randn(rows, w32[0].size(1), generator=generator)  # (m, in)
    x16 = x32.to(torch.bfloat16)

    def run(x: Tensor, ws: list[Tensor]) -> Callable[[], object]:
        def products() -> object:
            with torch.no_grad():
                return [F.linear(x, w) for w in ws]  # (m, o) each
        return products
    return {"float32": run(x32, w32), "bf16": run(x16, w16)}


def plan(groups: dict[tuple[int, int], list[Tensor]], workload: Workload) -> list[Timed]:
    """The products that time ``workload`` (sized as the module docstring says), with their scales."""
    generator = torch.Generator().manual_seed(0)  # the calibration draws nothing from the global stream
    timed = []
    if workload.kind == "decode":
        elements = sum(len(ws) * out * inp for (out, inp), ws in groups.items())
        share = min(1.0, DECODE_BYTES / (4 * elements), DECODE_FLOPS / (2 * workload.rows * elements))
        for (out, inp), ws in groups.items():
            kept = share * len(ws) * out  # weight rows of this shape to stream
            k = max(1, min(len(ws), int(kept // out)))
            o = out if kept >= out else min(out, max(MIN_OUTPUTS, math.ceil(kept)))
            timed.append(Timed((out, inp), _inference_products(ws[:k], workload.rows, o, generator),
                               len(ws) / k * out / o))
        return timed
    passes = 3 if workload.kind == "train" else 1  # forward, then dx and dW
    for (out, inp), ws in groups.items():
        budget = FLOPS_PER_PRODUCT / (2 * passes * inp)  # rows x outputs a product may have
        m = min(workload.rows, max(MIN_ROWS, int(budget // out)))
        o = min(out, max(MIN_OUTPUTS, int(budget // m)))
        products = (_train_products(ws[0], m, o, generator) if workload.kind == "train"
                    else _inference_products(ws[:1], m, o, generator))
        timed.append(Timed((out, inp), products, len(ws) * workload.rows / m * out / o))
    return timed


def _seconds(call: Callable[[], object], repeats: int) -> float:
    """Seconds per call of ``call``, over ``repeats`` calls."""
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def measure(timed: list[Timed]) -> tuple[dict[str, float], int]:
    """``({way: estimated seconds per pass}, rounds)``: a warm-up, then rounds of measurements alternating the
    ways (the precisions, and oneDNN where timed), the median per shape and way, scaled and summed (the module
    docstring's ``t_p``)."""
    ways = [p for p in WAYS if all(p in t.run for t in timed)]
    for t in timed:
        for p in ways:
            t.run[p]()  # the first call builds the kernels and touches the memory
            once = max(_seconds(t.run[p], 1), 1e-9)
            t.repeats[p] = min(MAX_REPEATS, math.ceil(MIN_BLOCK_SECONDS / once))
    samples: dict[tuple[int, str], list[float]] = {(i, p): [] for i in range(len(timed)) for p in ways}
    start, rounds = time.perf_counter(), 0
    while rounds < ROUNDS and (rounds < MIN_ROUNDS or time.perf_counter() - start < TIME_LIMIT):
        order = ways if rounds % 2 == 0 else ways[::-1]
        for i, t in enumerate(timed):
            for p in order:
                samples[i, p].append(_seconds(t.run[p], t.repeats[p]))
        rounds += 1
    seconds = {p: sum(t.scale * statistics.median(samples[i, p]) for i, t in enumerate(timed)) for p in ways}
    return seconds, rounds


# -- the cache -------------------------------------------------------------------------------------------------------


def host() -> dict:
    """Where a measurement ran: the CPU's model name, torch's version, the threads."""
    model = next((line.split(":", 1)[1].strip() for line in cpu_features().splitlines()
                  if line.startswith("model name")), cpu_features())
    return {"cpu": model, "torch": torch.__version__, "threads": torch.get_num_threads()}


def cache_path(workload: Workload) -> Path | None:
    """The cache file of ``workload`` on this host (None where ``ATTNKIT_CACHE=off``): keyed by the CPU's model
    name and flags, torch's version, the threads, the workload and what is compared (the calibration's version)."""
    folder = cache_dir("precision")
    if folder is None:
        return None
    key = json.dumps({"version": CALIBRATION_VERSION, "margin": MARGIN, "cpu": cpu_features(),
                      "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "workload": workload.to_json()}, sort_keys=True)
    return folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def read_cached(path: Path, workload: Workload) -> Choice | None:
    """The choice cached at ``path`` for ``workload``, or None: absent, unreadable or not one (measured again)."""
    try:
        choice = Choice.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if choice.workload != workload or choice.seconds is None:
        return None
    return replace(choice, source="cached")


def write_cached(path: Path, choice: Choice) -> None:
    """Keep ``choice`` at ``path``, whole or not at all; where the cache cannot be written, nothing is kept."""
    try:
        atomic_write_text(path, json.dumps(choice.to_json(), indent=1) + "\n")
    except OSError:
        pass


# -- choosing --------------------------------------------------------------------------------------------------------


def calibrate(model: nn.Module, kind: Kind, rows: int) -> Choice:
    """The faster precision on this CPU for ``model``'s products in workload ``kind`` with ``rows`` rows: cached, or
    measured (and cached). oneDNN (where timed) only when float32 through the BLAS takes :data:`MARGIN` times as
    long; bf16 only when float32 (the faster way) takes :data:`MARGIN` times as long."""
    groups = linear_weights(model)
    if not groups:
        return Choice("float32", "no matrices")
    workload = workload_of(groups, kind, rows)
    path = cache_path(workload)
    cached = None if path is None else read_cached(path, workload)
    if cached is not None:
        return cached
    seconds, rounds = measure(plan(groups, workload))
    onednn = "onednn" in seconds and seconds["float32"] >= MARGIN * seconds["onednn"]
    float32 = seconds["onednn"] if onednn else seconds["float32"]
    precision: Precision = "bf16" if float32 >= MARGIN * seconds["bf16"] else "float32"
    choice = Choice(precision, "measured", workload, seconds, rounds, host(), onednn and precision == "float32")
    if path is not None:
        write_cached(path, choice)
    return choice


def choose_precision(model: nn.Module, device: torch.device | str, kind: Kind = "decode", *,
                     rows: int | None = None) -> Choice:
    """The precision to run ``model`` in at inference on ``device``: ``decode`` (a decoding step: ``rows`` = the
    batch, default 1) or ``forward`` (a prompt or batch: ``rows`` = its tokens, default 128). On a CPU measured
    (:func:`calibrate`, float32 against bf16 weights); on CUDA bf16 where supported. Run a bf16 choice with
    :func:`bf16_weights`."""
    if kind not in ("forward", "decode"):
        raise ValueError(f"an inference workload is forward or decode, not {kind!r}")
    device = torch.device(device)
    if device.type == "cuda":
        return Choice("bf16" if torch.cuda.is_bf16_supported() else "float32", "cuda")
    if device.type != "cpu":
        return Choice("float32", f"measured on CPUs only, not on {device.type}")
    return calibrate(model, kind, rows or DEFAULT_ROWS[kind])


def training_precision(setting: str, model: nn.Module, device: torch.device, rows: int) -> Choice:
    """What ``train.precision`` (``auto``, ``bf16``, ``float32`` or its old name ``fp32``) means for ``model`` on
    ``device``, training on passes of ``rows`` tokens: float32 or bf16 autocast. ``auto`` measures on a CPU
    (:func:`calibrate`) and takes bf16 where supported on CUDA."""
    if setting not in ("auto", "bf16", "float32", "fp32"):
        raise UserError(f"train.precision: {setting!r} is not one of auto, bf16, float32 (or fp32)")
    if setting in ("float32", "fp32"):
        return Choice("float32", "asked")
    if device.type == "cuda":
        supported = torch.cuda.is_bf16_supported()
        if setting == "bf16" and not supported:
            raise UserError("train.precision: bf16 is not supported by this GPU; use float32")
        return Choice("bf16" if supported else "float32", "asked" if setting == "bf16" else "cuda")
    if setting == "bf16":
        return Choice("bf16", "asked")
    if device.type != "cpu":
        return Choice("float32", f"measured on CPUs only, not on {device.type}")
    return calibrate(model, "train", rows)


# -- bf16 weights at inference ---------------------------------------------------------------------------------------


def bf16_weights(model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """``model`` in eval mode with its floating-point parameters and buffers in bfloat16 (a copy, unless
    ``inplace``): every product then reads bf16 weights as stored, with nothing cast per call (as autocast does).

    The activations are bf16 too, the residual stream included (autocast keeps that in float32). What stays
    sensible: torch's layer and RMS norms accumulate their statistics in float32 and round the output once;
    attention's softmax runs in float32 (:func:`attnkit.attention.soft_attention`) or, in the engine, accumulates
    in float32 and rounds once (:mod:`attnkit.engine.attention`); search and sampling read the logits as float32.
    The logits stay within :data:`BF16_LOGIT_TOLERANCE` of float32's (relative to the largest)."""
    target = model if inplace else copy.deepcopy(model)
    return cast(nn.Module, target.eval().to(torch.bfloat16))
