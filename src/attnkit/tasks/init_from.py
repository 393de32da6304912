"""Fine-tuning from an earlier run (``model.init_from``): its tokenizer, then its weights.

A classification run with ``model.init_from: RUN`` starts from a pretrained body and adds a new head:

=============================  ====================  ===================================================
 ``model.classifier``           RUN must be            weights copied
=============================  ====================  ===================================================
 ``encoder`` (default)          a ``task: pretrain``   ``encoder.*`` (embeddings included)
 ``decoder``                    a ``task: lm`` run     the language model but its output layer, as ``lm.*``
=============================  ====================  ===================================================

A language-model run (``task: lm``) with ``model.init_from: RUN`` continues training a ``task: lm`` run (one
trained here, or a Hugging Face model made one by ``attnkit import``, or an adapted run, its adapters merged):
its tokenizer and every weight, all trained or (``model.lora``) frozen beside new adapters. Conversations
(``data.documents: chat``) are laid out by RUN's chat template unless the config gives one (:func:`base_chat`).

:func:`check_init_from` checks RUN before anything is written (its task, its ``model.transformer``), the
classification recipe copies its tokenizer files into the new run (:func:`copy_pretrained_tokenizer`) and
the task loads its weights (:func:`load_pretrained_body`).
"""

from __future__ import annotations

import filecmp
import shutil
from dataclasses import fields, replace
from pathlib import Path

from torch import nn

from ..common.errors import UserError
from ..config.loader import load_config
from ..config.schema import RunConfig
from ..data.chat_template import special_tokens
from ..data.tokenizer import Tokenizer
from ..runs.checkpoint import check_compatible, load_weights
from ..runs.layout import CONFIG_FILE, TOKENIZER_FILE, find_weights, tokenizer_files
from ..runs.load import inherit_chat, load_trained

#: Settings a fine-tuned encoder may change; every other ``model.transformer`` key must be the pretraining run's.
REGULARISATION = ("dropout", "attention_dropout", "activation_dropout")


def source_task(cfg: RunConfig) -> str:
    """The task of the run ``cfg.model.init_from`` must name: ``lm`` for a language model or a decoder-only
    classifier, else ``pretrain``."""
    return "lm" if cfg.task == "lm" or cfg.model.classifier == "decoder" else "pretrain"


def check_same_body(cfg: RunConfig, run_dir: Path) -> None:
    """A one-line error naming the first ``model.transformer`` key (dropout aside) in which ``cfg`` differs from
    the run ``run_dir`` it starts from: the same weights read with another activation or scale would compute
    something else without any error.

    ``max_len`` may differ unless the positions are ``learned``: a sinusoidal table has no weights (and RoPE
    and ALiBi none either), so a classifier may read longer windows than the pretraining did
    (configs/imdb-finetune.yaml does). ``norm_first`` is compared as the layers read it: unset (None) is the
    body's convention, pre-norm for a language model and post-norm (the paper's) for an encoder, so a config that
    leaves it unset starts from an imported BERT (``norm_first: false``).
    """
    theirs = load_config(RunConfig, run_dir / CONFIG_FILE).model.transformer
    ours = cfg.model.transformer
    lm_body = source_task(cfg) == "lm"  # a language model's layers: pre-norm where norm_first is None
    ours, theirs = (replace(t, norm_first=t.layer_options(norm_first_default=lm_body).norm_first)
                    for t in (ours, theirs))
    unused = "encoder_layers" if lm_body else "decoder_layers"  # the depth the body does not read
    free = set(REGULARISATION) | {unused, "share_embeddings"} | ({"tie_output"} if cfg.task != "lm" else set())
    if ours.positions != "learned":
        free.add("max_len")
    for f in fields(ours):
        if f.name not in free and getattr(ours, f.name) != getattr(theirs, f.name):
            raise UserError(f"model.transformer.{f.name} is {getattr(ours, f.name)!r} here but "
                            f"{getattr(theirs, f.name)!r} in {run_dir} (model.init_from); copy that run's "
                            f"model.transformer (dropout may differ)")


def pretrained_run(path: str, task: str = "pretrain") -> tuple[Path, Path]:
    """``(run directory, weights file)`` of the ``task`` run ``model.init_from`` names."""
    if not Path(path).exists():
        raise UserError(f"model.init_from: {path} does not exist; train it first with `attnkit train` and a "
                        f"`task: {task}` config")
    try:
        run_dir, weights = find_weights(Path(path))
    except UserError as e:
        raise UserError(f"model.init_from: {e}") from None
    cfg = load_config(RunConfig, run_dir / CONFIG_FILE)
    if cfg.task != task:
        hint = " (model.classifier: decoder starts from a `task: lm` run)" if cfg.task == "lm" else ""
        raise UserError(f"model.init_from: {run_dir} is a {cfg.task} run; give a `task: {task}` run{hint}")
    return run_dir, weights


def check_init_from(cfg: RunConfig, run_dir: Path) -> tuple[Path, list[str]]:
    """``(the run model.init_from names, its tokenizer files)`` after checking its task, that its body is the one
    ``cfg`` describes (:func:`check_same_body`) and that ``run_dir`` holds no other tokenizer.

    ``attnkit train`` calls it before it writes anything into ``run_dir``.
    """
    if cfg.model.init_from is None:
        raise ValueError("check_init_from needs a config with model.init_from")
    source, _ = pretrained_run(cfg.model.init_from, source_task(cfg))
    check_same_body(cfg, source)
    names = tokenizer_files(source)  # tokenizer.json first
    if (run_dir / TOKENIZER_FILE).exists():
        differ = [n for n in names if not (run_dir / n).exists() or not filecmp.cmp(source / n, run_dir / n, False)]
        if differ:
            raise UserError(f"model.init_from: {run_dir} holds another tokenizer than {source} ({', '.join(differ)} "
                            f"differ); choose another --run-dir")
    return source, names


def copy_pretrained_tokenizer(cfg: RunConfig, run_dir: Path, log=print) -> Tokenizer:
    """Copy the tokenizer of the run ``model.init_from`` names into ``run_dir`` (or check that the one there is
    the same)."""
    source, names = check_init_from(cfg, run_dir)
    if not (run_dir / TOKENIZER_FILE).exists():
        log(f"tokenizer: {source}'s (model.init_from; data.tokenizer is not used)")
        run_dir.mkdir(parents=True, exist_ok=True)
        for n in reversed(names):  # tokenizer.json last: it marks a complete tokenizer
            shutil.copyfile(source / n, run_dir / f".{n}.tmp")
            (run_dir / f".{n}.tmp").replace(run_dir / n)
    return Tokenizer.load(run_dir)


def load_pretrained_body(model: nn.Module, cfg: RunConfig) -> list[str]:
    """Copy the weights of the run ``model.init_from`` names into ``model``: a pretraining run's ``encoder.*``
    (embeddings included), or a language model's every weight but its output layer, under ``lm.*`` (a
    :class:`DecoderClassifier`).

    :return: the names of the copied tensors.
    :raises UserError: one line listing the missing, unexpected and mis-shaped keys (another architecture or
        vocabulary).
    """
    if cfg.model.init_from is None:
        raise ValueError("load_pretrained_body needs a config with model.init_from")
    task = source_task(cfg)
    source, weights = pretrained_run(cfg.model.init_from, task)
    if cfg.task == "lm":  # the same language model, trained on (an adapted one merged: attnkit.runs.load)
        try:
            load_trained(model, load_config(RunConfig, source / CONFIG_FILE), source, weights)
        except UserError as e:  # names the missing, unexpected and mis-shaped keys
            raise UserError(f"model.init_from: {e}") from None
        return sorted(model.state_dict())
    state, _ = load_weights(weights)
    if task == "lm":
        # every weight but the output layer (a classifier has none; tied, it is the embedding, which is copied)
        prefix, pretrained = "lm.", {f"lm.{k}": v for k, v in state.items() if not k.startswith("out_proj.")}
    else:
        prefix, pretrained = "encoder.", {k: v for k, v in state.items() if k.startswith("encoder.")}
    own = {k: v for k, v in model.state_dict().items() if k.startswith(prefix)}
    try:
        check_compatible(own, pretrained, weights)
    except UserError as e:  # names the missing, unexpected and mis-shaped keys
        raise UserError(f"model.init_from: {e}") from None
    model.load_state_dict(pretrained, strict=False)
    return sorted(pretrained)


def base_chat(cfg: RunConfig) -> tuple[str, dict[str, str]]:
    """``(chat template, special pieces)`` that a ``task: lm`` config's conversations are laid out with: its
    ``data.chat_template``, else that of the run ``model.init_from`` names (or of that run's own base:
    :func:`attnkit.runs.load.inherit_chat`), and the special pieces of that run's tokenizer."""
    if not cfg.model.init_from:
        return cfg.data.chat_template, {}
    source, _ = pretrained_run(cfg.model.init_from, "lm")
    base = inherit_chat(load_config(RunConfig, source / CONFIG_FILE), source)
    return cfg.data.chat_template or base.data.chat_template, special_tokens(Tokenizer.load(source), source)
