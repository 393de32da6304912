"""The tasks: what is learned from what. The only place a config's ``task:`` is looked up.

========================  ===============================================  =========================
``task:``                 model, objective, validation score               module
========================  ===============================================  =========================
``translate``             seq2seq (Transformer or RNN), teacher forcing,   ``tasks/translation.py``
                          label-smoothed cross-entropy; BLEU
``classify``              encoder-only classifier, cross-entropy;          ``tasks/classification.py``
                          accuracy (fine-tunes ``model.init_from``)
``pretrain``              masked-language model of an encoder;             ``tasks/pretraining.py``
                          masked accuracy
``lm``                    decoder-only language model, next-token          ``tasks/language_model.py``
                          cross-entropy; loss, perplexity, bits/char
========================  ===============================================  =========================

Each module holds its data recipe (what ``prepare`` reads and writes), its :class:`~attnkit.tasks.base.Task`
and its :class:`~attnkit.tasks.base.TaskSpec`; :data:`TASKS` maps the config's name to the spec. A new
task is a module here, one line in :data:`TASKS`, the schema's literal and (for a new kind of model) a
line in :data:`attnkit.runs.load.MODELS`.
"""

from __future__ import annotations

from pathlib import Path

from ..config.schema import RunConfig
from ..data.prepare import Prepared, Recipe
from . import classification, language_model, pretraining, translation
from .base import Log, Task, TaskSpec, prepare_recipe

__all__ = ["TASKS", "Task", "TaskSpec", "make_task", "prepare", "recipe", "spec"]

TASKS: dict[str, TaskSpec] = {s.name: s for s in (translation.SPEC, classification.SPEC, pretraining.SPEC,
                                                  language_model.SPEC)}


def spec(task: str) -> TaskSpec:
    """The registry's entry for a config's ``task:`` (the schema admits only registered names)."""
    return TASKS[task]


def recipe(cfg: RunConfig) -> Recipe:
    """The data recipe of ``cfg``'s task (after the task's checks of ``cfg``)."""
    s = spec(cfg.task)
    s.check(cfg)
    return s.recipe(cfg)


def prepare(cfg: RunConfig, run_dir: str | Path, log: Log = print, *, resume: bool = False,
            workers: int | None = None) -> Prepared:
    """``cfg``'s training data prepared (or reused) in ``run_dir`` (:func:`attnkit.data.prepare.prepare_data`)."""
    return prepare_recipe(recipe(cfg), run_dir, log, resume=resume, workers=workers)


def make_task(cfg: RunConfig, run_dir: Path, log: Log = print, *, resume: bool = False) -> Task:
    """The task of ``cfg`` (after its checks of ``cfg``), its training data prepared (or reused) in ``run_dir``."""
    s = spec(cfg.task)
    s.check(cfg)
    return s.make(cfg, run_dir, log, resume=resume)
