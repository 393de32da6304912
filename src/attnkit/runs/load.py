"""Loading a trained run: its config, tokenizer, classes and model.

:func:`restore_run` rebuilds a run's model with the factory it is given and loads the trained weights into it;
the factory is the run's task's (:attr:`attnkit.tasks.TaskSpec.build_model`), which :func:`attnkit.tasks.load_run`
gives it: the tasks sit above this package, so the registry is passed down, not looked up.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..common.errors import UserError
from ..common.log import to_stderr
from ..config.loader import load_config
from ..config.schema import RunConfig
from ..data.tokenizer import Tokenizer
from ..engine import Engine, prepare, resolve
from .checkpoint import check_compatible, load_weights
from .layout import CLASSES_FILE, CONFIG_FILE, find_weights

__all__ = ["LoadedRun", "ModelFactory", "languages", "read_classes", "restore_run"]

#: A run's model, freshly initialised, for its config, its tokenizer and (a classifier's) class names.
ModelFactory = Callable[[RunConfig, Tokenizer, list[str] | None], nn.Module]


@dataclass
class LoadedRun:
    """A trained run: ``model`` holds the weights of ``weights_path`` and decodes with the engine."""

    cfg: RunConfig
    tok: Tokenizer
    model: nn.Module
    classes: list[str] | None  # class names (classification), else None
    weights_path: Path
    run_dir: Path | None = None
    engine: Engine = field(default_factory=Engine)  # how ``model`` runs

    @property
    def task(self) -> str:
        return self.cfg.task


def read_classes(path: Path) -> list[str]:
    """The class names a classifier run was trained with (``classes.json``)."""
    try:
        classes = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read the class names ({type(e).__name__}); is this a complete run?") from None
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise UserError(f"{path}: expected a JSON list of class names")
    return classes


def restore_run(path: str | Path, build_model: ModelFactory, device: torch.device | None = None,
                engine: Engine | None = None) -> LoadedRun:
    """Config, tokenizer and the model ``build_model`` makes for them with the trained weights, from a run directory
    or checkpoint file, made to run as ``engine`` says (default: :class:`~attnkit.engine.Engine`'s, the engine's eager
    kernels in float32)."""
    run_dir, weights = find_weights(Path(path))
    cfg = load_config(RunConfig, run_dir / CONFIG_FILE)
    tok = Tokenizer.load(run_dir)
    classes = read_classes(run_dir / CLASSES_FILE) if (run_dir / CLASSES_FILE).exists() else None  # classifiers
    model = build_model(cfg, tok, classes)
    state, _ = load_weights(weights)
    check_compatible(model.state_dict(), state, weights)
    model.load_state_dict(state)
    model = model.to(device or torch.device("cpu"))
    engine, choice = resolve(model, engine or Engine())
    if choice is not None:
        to_stderr(f"attnkit: --precision auto: {choice.describe()}")
    model = prepare(model, engine).eval()
    return LoadedRun(cfg, tok, model, classes, weights, run_dir, engine)


def language(path: str | None) -> str | None:
    """The two-letter language code in a corpus file name (``train.de.gz`` -> ``de``), if it has one."""
    suffixes = [s[1:] for s in Path(path or "").suffixes if s != ".gz"]
    return suffixes[-1] if suffixes and re.fullmatch(r"[a-z]{2}", suffixes[-1]) else None


def languages(cfg: RunConfig) -> tuple[str | None, str | None]:
    """``(source, target)`` language codes of a translation run, read from its two training file names
    (``train.de.gz``, ``train.en.gz``); None where a name has none (or the corpus is one file)."""
    data = cfg.data
    if not data.train_tgt:
        return None, None
    return language(data.train), language(data.train_tgt)
