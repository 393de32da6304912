"""``task: pretrain``: masked-language-model pretraining on unlabelled text, and fine-tuning from it.

    attnkit train configs/imdb-pretrain.yaml --run-dir runs/imdb-pretrain      # MLM on the review text
    attnkit train configs/imdb-finetune.yaml --run-dir runs/imdb-finetune      # model.init_from: runs/imdb-pretrain

The pretraining run has the trainer's checkpoints, exact resume, bf16, progress and DDP like any
other; its task (:class:`PretrainTask`) reads text, trains a SentencePiece tokenizer with a
``<mask>`` piece, cuts each text into windows of ``data.max_len`` subwords and corrupts every
batch as BERT does (:mod:`attnkit.mlm`). Validation: the MLM loss and the accuracy on the masked
positions of held-out texts, under a fixed corruption.

A classification run with ``model.init_from: RUN`` copies that run's tokenizer and starts from its
encoder and embedding weights (:func:`load_pretrained_encoder`); the classification head is new.
"""

from __future__ import annotations

import filecmp
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checkpoint import check_compatible, load_weights
from .config import load_config
from .data import _base_suffix, make_batches, pad_batch, padding_fraction, read_labelled, read_lines
from .documents import clean_texts, held_out_rows
from .engine import FusedMLMLoss
from .errors import UserError
from .mlm import MaskedLanguageModel, MLMLoss, mask_tokens
from .runconfig import RunConfig
from .tasks import CONFIG_FILE, TOKENIZER_META, find_weights
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, train_tokenizer

#: Validation always corrupts the held-out texts with this seed, so every validation scores the same task.
VALID_MASK_SEED = 12345


@dataclass
class MLMBatch:
    """Restore the original subwords ``targets`` at the ``selected`` positions of the corrupted ``tokens``."""

    tokens: Tensor  # (B, T) corrupted input, padded
    selected: Tensor  # (B, T) bool: True where a subword is to be predicted
    targets: Tensor  # (N,) the original subwords at the selected positions, N = selected.sum()
    n_targets: int  # N


def read_texts(path: str, cfg: RunConfig, log=print, group_column: str | None = None) -> tuple[list[str], list[str]]:
    """``(training texts, held-out texts)`` of one pretraining file (held out: ``data.valid_fraction``).

    ``.txt`` (optionally ``.gz``): one text per line, blank lines skipped. ``.tsv`` / ``.csv``: the
    text column (``data.text_column``, or detected); the labels are not read for training.
    :raises UserError: the file has no text.
    """
    d = cfg.data
    groups = None
    if _base_suffix(Path(path)) in (".tsv", ".csv"):
        table = read_labelled(path, text_column=d.text_column, label_column=d.label_column, group_column=group_column)
        log(f"{path}: pretraining on column '{table.text_column}'; the labels in '{table.label_column}' are ignored")
        texts, groups = table.texts, table.groups
    else:
        texts = [t for t in read_lines(path) if t.strip()]
    if not texts:
        raise UserError(f"{path}: no text to pretrain on (every line is blank); give a file with one text per line")
    if not d.valid_fraction:
        return texts, []
    held = held_out_rows(len(texts), d.valid_fraction, d.valid_seed, groups)
    return [t for t, h in zip(texts, held, strict=True) if not h], [t for t, h in zip(texts, held, strict=True) if h]


def windows(ids: list[list[int]], max_len: int, min_len: int) -> list[list[int]]:
    """Every text cut into consecutive pieces of ``max_len`` subwords; pieces under ``min_len`` are dropped."""
    return [x[i: i + max_len] for x in ids for i in range(0, len(x), max_len) if len(x[i: i + max_len]) >= min_len]


class PretrainTask:
    """Masked-language-model pretraining of an encoder; validation MLM loss and masked accuracy."""

    name = "pretrain"

    def __init__(self, cfg: RunConfig, run_dir: Path, log=print) -> None:
        self.cfg = cfg
        d = cfg.data
        if cfg.model.arch != "transformer":
            raise UserError("task pretrain needs model.arch: transformer")
        train, valid = read_texts(d.train, cfg, log, d.group_column)
        for path in d.extra_text:
            more, more_valid = read_texts(path, cfg, log)
            train, valid = train + more, valid + more_valid
        if d.valid:
            valid = [t for t in read_lines(d.valid) if t.strip()] if _base_suffix(Path(d.valid)) not in (
                ".tsv", ".csv") else read_labelled(d.valid, text_column=d.text_column,
                                                   label_column=d.label_column).texts
        train, valid = clean_texts(train, d.line_break_tags), clean_texts(valid, d.line_break_tags)
        if (run_dir / TOKENIZER_META).exists():
            self.tok = Tokenizer.load(run_dir)
        else:
            t = d.tokenizer
            log(f"training a {t.model_type} SentencePiece tokenizer with <mask> (vocab {t.vocab_size})")
            self.tok = train_tokenizer(train, None, run_dir, vocab_size=t.vocab_size, model_type=t.model_type,
                                       seed=cfg.train.seed, mask=True)
        if self.tok.mask_id is None:
            raise UserError(f"{run_dir / TOKENIZER_META}: this tokenizer has no <mask> piece; pretrain in a new "
                            f"--run-dir")
        m = cfg.mlm
        self.x = windows(self.tok.encode_src(train), d.max_len, m.min_len)
        self.valid_x = windows(self.tok.encode_src(valid), d.max_len, m.min_len)[: m.valid_windows]
        files = ", ".join([d.train, *d.extra_text])
        if not self.x:
            raise UserError(f"{files}: no text of at least mlm.min_len={m.min_len} subwords to pretrain on")
        if not self.valid_x:
            raise UserError(f"{d.valid or files}: no validation text of at least mlm.min_len={m.min_len} subwords; "
                            f"set data.valid_fraction (e.g. 0.1) or data.valid")
        batches = self.batches(0)
        padding = padding_fraction(batches, [len(x) for x in self.x], None, cfg.train.pad_multiple)
        log(f"pretraining data: {len(train)} texts -> {len(self.x)} windows of at most {d.max_len} subwords "
            f"({sum(map(len, self.x))} subwords); {len(self.valid_x)} validation windows; {len(batches)} batches "
            f"per epoch, {padding:.1%} of positions padding")

    def build_model(self) -> nn.Module:
        return MaskedLanguageModel(self.cfg.model.transformer, self.tok.src_vocab_size)

    def objective(self, model: nn.Module) -> nn.Module:
        """The reference loss, or the engine's fused one (``train.engine``); the same value."""
        return FusedMLMLoss(model) if self.cfg.train.engine == "fast" else MLMLoss(model)

    def batches(self, epoch: int) -> list[list[int]]:
        return make_batches([len(x) for x in self.x], None, self.cfg.train.max_tokens,
                            seed=self.cfg.train.seed, epoch=epoch, pad_multiple=self.cfg.train.pad_multiple)

    def _collate(self, ids: list[list[int]], device: torch.device, generator: torch.Generator | None,
                 multiple: int = 1) -> MLMBatch:
        tokens = pad_batch(ids, PAD_ID, multiple)  # (B, T), on the CPU: the masks come from the CPU generator
        m = self.cfg.mlm
        inputs, selected = mask_tokens(tokens, mask_id=self.tok.mask_id, special_ids=(UNK_ID, BOS_ID, EOS_ID),
                                       vocab_size=self.tok.src_vocab_size, select=m.select, mask=m.mask,
                                       random=m.random, generator=generator)
        targets = tokens[selected]  # (N,)
        return MLMBatch(inputs.to(device), selected.to(device), targets.to(device), int(selected.sum()))

    def collate(self, indices: list[int], device: torch.device) -> MLMBatch:
        """A batch corrupted with torch's default generator, whose state every checkpoint saves (exact resume)."""
        return self._collate([self.x[i] for i in indices], device, None, self.cfg.train.pad_multiple)

    def loss(self, objective: nn.Module, batch: MLMBatch, label_smoothing: float) -> Tensor:
        return objective(batch.tokens, batch.selected, batch.targets, label_smoothing)

    def validate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """MLM loss (no smoothing) and accuracy on the masked positions of the held-out windows; score = accuracy."""
        model.eval()
        generator = torch.Generator().manual_seed(VALID_MASK_SEED)
        total, correct, n = 0.0, 0, 0
        order = make_batches([len(x) for x in self.valid_x], None, self.cfg.train.max_tokens, seed=0, epoch=0,
                             shuffle=False)
        with torch.inference_mode():
            for idx in order:
                b = self._collate([self.valid_x[i] for i in idx], device, generator)
                logits = model(b.tokens, b.selected).float()  # (N, V)
                total += F.cross_entropy(logits, b.targets, reduction="sum").item()
                correct += int((logits.argmax(-1) == b.targets).sum())
                n += b.n_targets
        model.train()
        loss, acc = total / max(n, 1), 100.0 * correct / max(n, 1)
        return {"valid_loss": loss, "valid_ppl": math.exp(min(loss, 50.0)), "valid_mlm_acc": acc, "score": acc}


# --------------------------------------------------------------------------------------
# Fine-tuning from a pretraining run (model.init_from)
# --------------------------------------------------------------------------------------


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


def check_init_from(path: str, run_dir: Path) -> tuple[Path, list[str]]:
    """``(pretraining run, its tokenizer files)`` after checking that ``run_dir`` holds no other tokenizer.

    ``attnkit train`` calls it before it writes anything into ``run_dir``.
    """
    source, _ = pretrained_run(path)
    names = [TOKENIZER_META, *sorted({m for m in json.loads((source / TOKENIZER_META).read_text()).values()
                                      if isinstance(m, str) and m.endswith(".model")})]
    if (run_dir / TOKENIZER_META).exists():
        differ = [n for n in names if not (run_dir / n).exists() or not filecmp.cmp(source / n, run_dir / n, False)]
        if differ:
            raise UserError(f"model.init_from: {run_dir} holds another tokenizer than {source} ({', '.join(differ)} "
                            f"differ); choose another --run-dir")
    return source, names


def copy_pretrained_tokenizer(path: str, run_dir: Path, log=print) -> Tokenizer:
    """Copy the pretraining run's tokenizer into ``run_dir`` (or check that the one there is the same)."""
    source, names = check_init_from(path, run_dir)
    if not (run_dir / TOKENIZER_META).exists():
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
