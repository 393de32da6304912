"""What every task is: the :class:`Task` the trainer drives, and a :class:`TaskSpec` the registry lists.

A task owns, for one kind of model:

* its data recipe (:class:`attnkit.data.prepare.Recipe`): what ``attnkit prepare`` reads, how it
  tokenizes it and what it writes;
* its batches, objective and validation (:class:`Task`, driven by :mod:`attnkit.training.trainer`);
* its model (:attr:`TaskSpec.build_model`, the factory every command rebuilds a trained run with);
* what its runs are used for: the route that serves them, the export targets that write them, how their
  attention is read (:class:`TaskSpec`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import Tensor, nn

from ..common.errors import UserError
from ..common.files import atomic_write_text
from ..config.schema import RunConfig
from ..data.batching import Batches, EpochBatches
from ..data.prepare import Prepared, Recipe, prepare_data
from ..data.tokenizer import Tokenizer
from ..inference.attention_maps import AttentionReader
from ..runs.layout import CLASSES_FILE, DATA_DIR
from ..runs.load import ModelFactory

Log = Callable[[str], None]
#: The routes of ``attnkit serve`` a task's runs may answer (:attr:`TaskSpec.serves`).
Serves = Literal["translate", "classify", "generate"]


class Task(Protocol):
    """What the trainer needs from a task."""

    name: str
    rate_unit: str  # what the loss is averaged over, as the progress line counts it per second: "tok" -> tok_s

    def build_model(self) -> nn.Module: ...
    def parameter_groups(self, model: nn.Module) -> list[dict]: ...  # the optimiser's groups, each with lr_scale
    def objective(self, model: nn.Module) -> nn.Module: ...
    def batches(self, epoch: int) -> Batches: ...
    def collate(self, indices: Sequence[int], device: torch.device) -> Any: ...  # the task's batch
    def loss(self, objective: nn.Module, batch: Any, label_smoothing: float) -> Tensor: ...
    def validate(self, model: nn.Module, device: torch.device) -> dict[str, float]: ...


@dataclass
class BaseRecipe:
    """What the recipes share (:class:`attnkit.data.prepare.Recipe`): their config, one ``text`` side of
    unlabelled examples, no extra settings, and a tokenizer trained on the data."""

    cfg: RunConfig
    sides: ClassVar[tuple[str, ...]] = ("text",)
    labelled: ClassVar[bool] = False
    mask: ClassVar[bool] = False

    def settings(self) -> dict:
        return {}

    def tokenizer_note(self) -> str:
        return ""

    def given_tokenizer(self, run_dir: Path, log: Log) -> Tokenizer | None:
        return None


class EpochTask:
    """What the tasks share: their prepared data, and batches made once per epoch.

    A task sets ``cfg``, ``tok``, ``classes`` (None unless it classifies) and ``_batches`` in its ``__init__``, and
    builds its model with its own factory (:attr:`TaskSpec.build_model`).
    """

    cfg: RunConfig
    tok: Tokenizer
    manifest: dict
    classes: list[str] | None = None
    _batches: EpochBatches

    def prepare(self, recipe: Recipe, run_dir: Path, log: Log, resume: bool) -> Prepared:
        """The recipe's prepared data (:func:`prepare_recipe`); sets ``tok`` and ``manifest``."""
        data = prepare_recipe(recipe, run_dir, log, resume=resume)
        self.tok, self.manifest = data.tok, data.manifest
        return data

    def parameter_groups(self, model: nn.Module) -> list[dict]:
        """The optimiser's parameter groups: one, at ``train.lr`` (``lr_scale`` 1) unless a task says otherwise; frozen
        parameters (a LoRA run's base, :mod:`attnkit.lora`) are left out."""
        return [{"params": [p for p in model.parameters() if p.requires_grad], "lr_scale": 1.0}]

    def batches(self, epoch: int) -> Batches:
        return self._batches(epoch)


def scaled_groups(model: nn.Module, prefix: str, scale: float) -> list[dict]:
    """The optimiser's parameter groups when the parameters named ``prefix...`` learn at ``scale`` times
    ``train.lr`` (ELECTRA's generator, a classifier's n-gram expert) and the rest at ``train.lr``."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not n.startswith(prefix)], "lr_scale": 1.0},
            {"params": [p for n, p in named if n.startswith(prefix)], "lr_scale": scale}]


@dataclass(frozen=True)
class TaskSpec:
    """One task in the registry (:data:`attnkit.tasks.TASKS`): everything that differs by task. Code outside
    :mod:`attnkit.tasks` asks a run's spec (``spec(run.task).generates``) and never compares task names.

    :param name: the config's ``task:`` value.
    :param make: builds the :class:`Task` for ``(cfg, run_dir, log, resume=...)``, its data prepared.
    :param recipe: the data recipe for a config.
    :param serves: the route its trained runs answer (``/translate``, ``/classify`` or ``/generate``), or None
        (a pretrained encoder is a starting point, used through a run fine-tuned from it).
    :param check: refuses a config this task cannot train (a :class:`UserError` naming the key); the
        schema checks only what holds for every task.
    :param build_model: its model for ``(cfg, tok, classes)``, freshly initialised: the trainer's new model, and
        what every command loads a trained run's weights into (:func:`attnkit.tasks.load_run`).
    :param hint: what to do with one of its runs when a command needs another kind (``use `attnkit generate```).
    :param attention_maps: how its models' attention is read (:mod:`attnkit.inference.attention_maps`), or None.
    :param exporters: the ``attnkit export --to`` targets that write its runs.
    """

    name: str
    make: Callable[..., Task]
    recipe: Callable[[RunConfig], Recipe]
    serves: Serves | None
    check: Callable[[RunConfig], None]
    build_model: ModelFactory
    hint: str
    attention_maps: AttentionReader | None = None
    exporters: tuple[str, ...] = ()

    @property
    def generates(self) -> bool:
        """Its runs continue text (a language model): they answer ``/generate``."""
        return self.serves == "generate"


def refuse_init_from(cfg: RunConfig) -> None:
    """``model.init_from`` is for fine-tuning a classifier (:mod:`attnkit.tasks.init_from`), ``model.lora`` for a
    language model."""
    if cfg.model.init_from:
        raise UserError("model.init_from is for task: classify (fine-tuning a pretrained encoder)")
    refuse_lora(cfg)


def refuse_lora(cfg: RunConfig) -> None:
    """``model.lora`` adapts a language model (``task: lm``, :mod:`attnkit.lora`)."""
    if cfg.model.lora is not None:
        raise UserError("model.lora adapts a language model: use it in a task: lm config with model.init_from")


def prepare_recipe(recipe: Recipe, run_dir: str | Path, log: Log = print, *, resume: bool = False,
                   workers: int | None = None) -> Prepared:
    """The run's prepared data (:func:`attnkit.data.prepare.prepare_data` in its ``data/``); for labelled data
    also the class names, written to ``classes.json`` for every command that loads the run."""
    run_dir = Path(run_dir)
    data = prepare_data(recipe, run_dir, run_dir / DATA_DIR, log, resume=resume, workers=workers)
    if data.classes is not None:
        text = json.dumps(data.classes, ensure_ascii=False) + "\n"
        path = run_dir / CLASSES_FILE
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            atomic_write_text(path, text)
    return data
