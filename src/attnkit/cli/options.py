"""What the commands share: argparse types for numbers, and reading input lines and writing output lines."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

from ..common.errors import UserError
from ..common.log import to_stderr
from ..data.readers import read_lines, read_stream
from ..engine import MODES, PRECISIONS, QUANTIZE, Engine
from ..inference.classify import READINGS


def number(kind: type[int] | type[float], at_least: float | None = None) -> Callable[[str], int | float]:
    """An argparse ``type`` for a finite ``int`` / ``float`` option, optionally with a lower bound."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a whole' if kind is int else 'a'} number, got {text!r}") \
                from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if at_least is not None and value < at_least:
            raise argparse.ArgumentTypeError(f"must be at least {at_least:g}, got {text!r}")
        return value

    return parse



POSITIVE_INT, FINITE, NON_NEGATIVE = number(int, 1), number(float), number(float, 0)


def add_device_option(p: argparse.ArgumentParser, what: str) -> None:
    """``--device cpu | cuda``: where ``what`` runs (CPU by default, as the benchmarks measure it)."""
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help=f"where {what} runs: cpu (default) or cuda (the first GPU that torch sees)")


def add_engine_options(p: argparse.ArgumentParser, compiled: str) -> None:
    """The one switch of how a model runs (:class:`attnkit.engine.Engine`): ``--engine``, ``--precision``,
    ``--quantize``. ``compiled``: what the command runs compiled (or that it has no compiled path)."""
    p.add_argument("--engine", choices=list(MODES), default="eager",
                   help="reference: the textbook's plain torch ops, nothing of the engine; eager (default): the "
                        f"engine's kernels, the same results; compiled: {compiled}")
    p.add_argument("--precision", choices=list(PRECISIONS), default="float32",
                   help="float32 (default; outputs equal the reference's), bf16 (weights in bfloat16: faster where the "
                        "CPU has AVX512-BF16 or AMX, outputs may differ slightly) or auto (what a short measurement "
                        "of the model's own matrix shapes finds faster on this host)")
    p.add_argument("--quantize", choices=list(QUANTIZE), default="none",
                   help="none (default) or int8: linear layers with int8 weights, one scale per output row (a "
                        "quarter of the bytes to read per token; logits within rounding of the float model's); "
                        "eager or compiled")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """How a language model chooses its tokens (:func:`attnkit.sampling.choose_next`): ``--temperature``,
    ``--top-k``, ``--top-p`` and the ``--seed`` of its random numbers."""
    p.add_argument("--temperature", type=number(float), default=0.8,
                   help="softmax temperature T = 1/beta; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=number(int), default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=number(float), default=1.0, help="nucleus: the most likely tokens whose "
                                                                    "probabilities reach p, in (0, 1] (default 1)")
    p.add_argument("--seed", type=number(int), default=1, help="random seed (default 1)")


def engine_of(args: argparse.Namespace, compiled: bool = False) -> Engine:
    """The :class:`~attnkit.engine.Engine` the options of :func:`add_engine_options` ask for. ``compiled``: the command
    has a compiled path; if not, ``--engine compiled`` runs eager, and a note on standard error says so."""
    engine = Engine(args.engine, args.precision, args.quantize)
    if engine.mode == "compiled" and not compiled:
        to_stderr(f"attnkit: note: --engine compiled: `attnkit {args.command}` has no compiled path (only a "
                  "language model's generation has); it runs eager")
    return engine


def pick_device(name: str):  # -> torch.device; torch is imported here, not for --help
    """The ``torch.device`` for ``--device``; cuda where torch sees no GPU is a one-line error."""
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA GPU here (a CPU build of torch, or no driver); "
                        "use --device cpu")
    return torch.device(name)


def read_input(path: str | None) -> list[str]:
    """Lines of ``path``, or of standard input (strict UTF-8 either way)."""
    if path is None:
        return read_stream(sys.stdin.buffer, "<stdin>")
    return read_lines(path)


def write_output(path: str | None, lines: list[str]) -> None:
    """``lines`` to ``path``, or to standard output."""
    text = "".join(line + "\n" for line in lines)
    if path is None:
        sys.stdout.write(text)
        return
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise UserError(f"{path}: cannot write ({e.strerror}); check that the directory exists") from None


def add_config_arguments(p: argparse.ArgumentParser, override_example: str, run_dir_help: str) -> None:
    """The config, its ``KEY=VALUE`` overrides and ``--run-dir``: what ``prepare`` and ``train`` read."""
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=f"config overrides, e.g. {override_example}")
    p.add_argument("--run-dir", help=f"{run_dir_help} (default: runs/<config name>)")


def config_run_dir(args: argparse.Namespace) -> Path:
    """``--run-dir``, or ``runs/<config name>``."""
    return Path(args.run_dir or Path("runs") / Path(args.config).stem)


def add_reading_argument(p: argparse.ArgumentParser) -> None:
    """``--read``: how a classifier reads a text longer than its window (:mod:`attnkit.inference.classify`)."""
    p.add_argument("--read", choices=list(READINGS), default="whole",
                   help="classification: a text longer than the model's window is read whole, as overlapping "
                        "windows whose logits are averaged (default), or cut to its head or head+tail as in "
                        "training")
