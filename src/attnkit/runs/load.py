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
from ..lora import apply_lora, lora_state_dict, merge_lora
from .adapters import checked_base
from .checkpoint import check_compatible, load_weights
from .layout import CLASSES_FILE, CONFIG_FILE, find_run, find_weights

__all__ = ["LoadedRun", "ModelFactory", "base_run", "inherit_chat", "languages", "load_trained", "read_classes",
           "restore_run"]

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


def load_trained(model: nn.Module, cfg: RunConfig, run_dir: Path, weights: Path) -> nn.Module:
    """Load the trained weights of the run ``run_dir`` (its config ``cfg``, its weights file ``weights``) into
    ``model``, a model its task's factory made for it -> ``model``.

    A run's weights file holds every weight; an adapted run's (``model.lora``) holds its adapters only, which go on
    its base's weights (the file :func:`~attnkit.runs.adapters.checked_base` checks; an adapted base is loaded so in
    turn) and are merged into them (:func:`~attnkit.lora.merge_lora`): the model is a plain one that computes as the
    adapted one did, at no extra cost.
    """
    state, _ = load_weights(weights)
    if cfg.model.lora is None:
        check_compatible(model.state_dict(), state, weights)
        model.load_state_dict(state)
        return model
    base = checked_base(run_dir)
    base_dir = find_run(base)
    base_cfg = load_config(RunConfig, base_dir / CONFIG_FILE)
    load_trained(model, base_cfg, base_dir, base)
    apply_lora(model, cfg.model.lora)
    check_compatible(lora_state_dict(model), state, weights)
    model.load_state_dict(state, strict=False)
    return merge_lora(model)


def base_run(cfg: RunConfig, run_dir: Path) -> Path | None:
    """The directory of the run ``run_dir`` was trained on (``model.init_from``): an adapted run's checked base
    (:func:`~attnkit.runs.adapters.checked_base`), else the run ``init_from`` names if it is still there; None."""
    if cfg.model.lora is not None:
        return find_run(checked_base(run_dir))
    start = Path(cfg.model.init_from) if cfg.model.init_from else None
    return find_weights(start)[0] if start is not None and start.exists() else None


def inherit_chat(cfg: RunConfig, run_dir: Path, depth: int = 8) -> RunConfig:
    """``cfg`` with the chat template of the run it was trained on (and so on up) where it has none of its own, and
    that run's end-of-turn pieces unless it lists some: a model fine-tuned from an instruct model speaks as that
    model (``attnkit chat``, the server and the export read them) -> ``cfg``, changed in place."""
    base = base_run(cfg, run_dir) if depth > 0 and not cfg.data.chat_template else None
    if base is not None:
        base_cfg = inherit_chat(load_config(RunConfig, base / CONFIG_FILE), base, depth - 1)
        cfg.data.chat_template = cfg.data.chat_template or base_cfg.data.chat_template
        cfg.data.end_of_turn = cfg.data.end_of_turn or list(base_cfg.data.end_of_turn)
    return cfg


def restore_run(path: str | Path, build_model: ModelFactory, device: torch.device | None = None,
                engine: Engine | None = None) -> LoadedRun:
    """Config (:func:`inherit_chat`), tokenizer and the model ``build_model`` makes for them with the trained
    weights (an adapted run's merged into its base's: :func:`load_trained`), from a run directory or checkpoint
    file, made to run as ``engine`` says (default: :class:`~attnkit.engine.Engine`'s, the engine's eager kernels in
    float32)."""
    run_dir, weights = find_weights(Path(path))
    cfg = inherit_chat(load_config(RunConfig, run_dir / CONFIG_FILE), run_dir)
    tok = Tokenizer.load(run_dir)
    classes = read_classes(run_dir / CLASSES_FILE) if (run_dir / CLASSES_FILE).exists() else None  # classifiers
    model = load_trained(build_model(cfg, tok, classes), cfg, run_dir, weights)
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
