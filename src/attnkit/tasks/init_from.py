"""Fine-tuning from a pretraining run (``model.init_from``): its tokenizer, then its encoder.

A classification run with ``model.init_from: RUN`` checks that RUN is a ``task: pretrain`` run before
anything is written (:func:`check_init_from`), copies its tokenizer files into the new run
(:func:`copy_pretrained_tokenizer`, from the classification recipe) and starts from its ``encoder.*``
weights (:func:`load_pretrained_encoder`); the classification head is new.
"""

from __future__ import annotations

import filecmp
import shutil
from dataclasses import fields
from pathlib import Path

from torch import nn

from ..common.errors import UserError
from ..config.loader import load_config
from ..config.schema import RunConfig
from ..data.tokenizer import Tokenizer
from ..runs.checkpoint import check_compatible, load_weights
from ..runs.layout import CONFIG_FILE, TOKENIZER_FILE, find_weights, tokenizer_files

#: Settings a fine-tuned encoder may change; every other ``model.transformer`` key must be the pretraining run's.
REGULARISATION = ("dropout", "attention_dropout", "activation_dropout")


def check_same_encoder(cfg: RunConfig, path: str) -> None:
    """A one-line error naming the first ``model.transformer`` key (dropout aside) in which ``cfg`` differs from
    the pretraining run ``path``: the same weights read with another activation or scale would compute something
    else without any error.

    ``max_len`` may differ unless the positions are ``learned``: a sinusoidal table has no weights, so a
    classifier may read longer windows than the pretraining did (configs/imdb-finetune.yaml does).
    """
    run_dir, _ = pretrained_run(path)
    theirs = load_config(RunConfig, run_dir / CONFIG_FILE).model.transformer
    ours = cfg.model.transformer
    free = set(REGULARISATION) | {"decoder_layers", "share_embeddings", "tie_output"}
    if ours.positions != "learned":
        free.add("max_len")
    for f in fields(ours):
        if f.name not in free and getattr(ours, f.name) != getattr(theirs, f.name):
            raise UserError(f"model.transformer.{f.name} is {getattr(ours, f.name)!r} here but "
                            f"{getattr(theirs, f.name)!r} in {run_dir} (model.init_from); copy that run's "
                            f"model.transformer (dropout may differ)")


def pretrained_run(path: str) -> tuple[Path, Path]:
    """``(run directory, weights file)`` of the pretraining run ``model.init_from`` names."""
    if not Path(path).exists():
        raise UserError(f"model.init_from: {path} does not exist; train it first with `attnkit train` and a "
                        f"`task: pretrain` config")
    try:
        run_dir, weights = find_weights(Path(path))
    except UserError as e:
        raise UserError(f"model.init_from: {e}") from None
    cfg = load_config(RunConfig, run_dir / CONFIG_FILE)
    if cfg.task != "pretrain":
        raise UserError(f"model.init_from: {run_dir} is a {cfg.task} run; give a `task: pretrain` run")
    return run_dir, weights


def check_init_from(path: str, run_dir: Path, cfg: RunConfig | None = None) -> tuple[Path, list[str]]:
    """``(pretraining run, its tokenizer files)`` after checking that ``run_dir`` holds no other tokenizer
    (and, given ``cfg``, that its encoder is the pretraining run's: :func:`check_same_encoder`).

    ``attnkit train`` calls it before it writes anything into ``run_dir``.
    """
    source, _ = pretrained_run(path)
    if cfg is not None:
        check_same_encoder(cfg, path)
    names = tokenizer_files(source)  # tokenizer.json first
    if (run_dir / TOKENIZER_FILE).exists():
        differ = [n for n in names if not (run_dir / n).exists() or not filecmp.cmp(source / n, run_dir / n, False)]
        if differ:
            raise UserError(f"model.init_from: {run_dir} holds another tokenizer than {source} ({', '.join(differ)} "
                            f"differ); choose another --run-dir")
    return source, names


def copy_pretrained_tokenizer(path: str, run_dir: Path, log=print) -> Tokenizer:
    """Copy the pretraining run's tokenizer into ``run_dir`` (or check that the one there is the same)."""
    source, names = check_init_from(path, run_dir)
    if not (run_dir / TOKENIZER_FILE).exists():
        log(f"tokenizer: {source}'s (model.init_from; data.tokenizer is not used)")
        run_dir.mkdir(parents=True, exist_ok=True)
        for n in reversed(names):  # tokenizer.json last: it marks a complete tokenizer
            shutil.copyfile(source / n, run_dir / f".{n}.tmp")
            (run_dir / f".{n}.tmp").replace(run_dir / n)
    return Tokenizer.load(run_dir)


def load_pretrained_encoder(model: nn.Module, path: str) -> list[str]:
    """Copy the ``encoder.*`` weights (embeddings included) of pretraining run ``path`` into ``model``.

    :return: the names of the copied tensors.
    :raises UserError: one line listing the missing, unexpected and mis-shaped keys (another architecture or
        vocabulary).
    """
    _, weights = pretrained_run(path)
    state, _ = load_weights(weights)
    pretrained = {k: v for k, v in state.items() if k.startswith("encoder.")}
    own = {k: v for k, v in model.state_dict().items() if k.startswith("encoder.")}
    try:
        check_compatible(own, pretrained, weights)
    except UserError as e:  # names the missing, unexpected and mis-shaped keys
        raise UserError(f"model.init_from: {e}") from None
    model.load_state_dict(pretrained, strict=False)
    return sorted(pretrained)

