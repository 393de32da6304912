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

Each module holds its data recipe (what ``prepare`` reads and writes), its model factory, its
:class:`~attnkit.tasks.base.Task` and its :class:`~attnkit.tasks.base.TaskSpec`: everything that differs by
task (the model, the route that serves it, the export targets, how its attention is read); :data:`TASKS` maps the
config's name to the spec. A new task is a module here, one line in :data:`TASKS` and the schema's literal.

Every command reaches a trained run through here: :func:`load_run` rebuilds its model with its task's factory,
:func:`require` refuses a run of the wrong kind with its task's hint, :func:`attention_maps` reads its attention as
its task says.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..common.errors import UserError
from ..config.schema import RunConfig
from ..data.prepare import Prepared, Recipe
from ..data.tokenizer import Tokenizer
from ..engine import Engine
from ..inference.attention_maps import NEW_TOKENS, AttentionMaps, MapOptions
from ..inference.classify import Reading
from ..inference.head_scores import LOCAL_WINDOW
from ..runs.load import LoadedRun, restore_run
from ..search import LENPEN
from . import classification, language_model, pretraining, translation
from .base import Log, Serves, Task, TaskSpec, prepare_recipe

__all__ = ["TASKS", "Serves", "Task", "TaskSpec", "attention_maps", "build_model", "load_run", "make_task", "prepare",
           "recipe", "require", "served_by", "spec"]

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


def build_model(cfg: RunConfig, tok: Tokenizer, classes: list[str] | None = None) -> nn.Module:
    """The model of ``cfg.task`` and ``cfg.model``, sized for ``tok`` (and ``classes``), freshly initialised: the one
    model factory (:attr:`TaskSpec.build_model`)."""
    return spec(cfg.task).build_model(cfg, tok, classes)


def load_run(path: str | Path, device: torch.device | None = None, engine: Engine | None = None) -> LoadedRun:
    """Config, tokenizer and model with trained weights, from a run directory or checkpoint file
    (:func:`attnkit.runs.load.restore_run` with :func:`build_model`), made to run as ``engine`` says (default:
    :class:`~attnkit.engine.Engine`'s, the engine's eager kernels in float32)."""
    return restore_run(path, build_model, device, engine)


def served_by(task: object, route: Serves) -> bool:
    """Whether runs of ``task`` answer ``route``: ``task`` as read from a config or an export's manifest (any value;
    one that names no task serves nothing)."""
    found = TASKS.get(task) if isinstance(task, str) else None
    return found is not None and found.serves == route


def require(run: LoadedRun, route: Serves, name: str | Path, what: str = "model", hint: str | None = None
            ) -> LoadedRun:
    """``run`` when its task's runs answer ``route`` (``"translate"``, ``"classify"``, ``"generate"``); else a
    :class:`UserError` naming its task and what to do.

    :param name: how the user named the run (the command's argument).
    :param hint: what to say instead of the run's task's :attr:`TaskSpec.hint`.
    """
    if not served_by(run.task, route):
        raise UserError(f"{name} is a {run.task} {what}; {hint or spec(run.task).hint}")
    return run


def attention_maps(run: LoadedRun, source: str, target: str | None = None, *, beam: int = 1, lenpen: float = LENPEN,
                   reading: Reading = "whole", new_tokens: int = NEW_TOKENS, window: int = LOCAL_WINDOW
                   ) -> AttentionMaps:
    """Every attention weight the model computes for ``source``, read as its task reads it
    (:attr:`TaskSpec.attention_maps`; :mod:`attnkit.inference.attention_maps`).

    :param run: a trained run (:func:`load_run`).
    :param source: one sentence (translation), text (classification) or prompt (language model).
    :param target: translation: force-decode this target instead of the model's own output; a language model:
        show this continuation instead of the model's own.
    :param beam: beam size for the model's own translation (1 = greedy); ``lenpen``: GNMT alpha.
    :param reading: classification: how a text longer than the window is read (:mod:`attnkit.inference.classify`).
    :param new_tokens: a language model: how many tokens to continue the prompt by (greedily; 0: the prompt only).
    :param window: a language model: ``w`` of the local-window head score.
    :raises UserError: a run whose task reads no attention (a pretraining run), a target for a classifier, a beam
        for a language model, an RNN without attention, a text longer than the model's positions.
    """
    task = spec(run.task)
    if task.attention_maps is None:
        raise UserError(f"{run.run_dir or run.weights_path} is a {run.task} run, whose attention attnkit does not "
                        f"show; {task.hint}")
    options = MapOptions(beam=beam, lenpen=lenpen, reading=reading, new_tokens=new_tokens, window=window)
    return task.attention_maps(run, source, target, options)
