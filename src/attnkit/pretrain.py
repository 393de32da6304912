"""``task: pretrain``: masked-language-model pretraining on unlabelled text, and fine-tuning from it.

    attnkit train configs/imdb-pretrain.yaml --run-dir runs/imdb-pretrain      # MLM on the review text
    attnkit train configs/imdb-finetune.yaml --run-dir runs/imdb-finetune      # model.init_from: runs/imdb-pretrain

The pretraining run has the trainer's checkpoints, exact resume, bf16, progress and DDP like any
other; its task (:class:`PretrainTask`) prepares the text like every task (:mod:`attnkit.prepare`:
streamed, a SentencePiece tokenizer with a ``<mask>`` piece, each text cut into windows of
``data.max_len`` subwords, memory-mapped) and corrupts every batch as BERT does (:mod:`attnkit.mlm`).
Validation: the MLM loss and the accuracy on the masked
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
from itertools import islice
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checkpoint import check_compatible, load_weights
from .config import load_config
from .data import Batches, TokenArrays, make_batches, padding_fraction
from .engine import FusedMLMLoss
from .errors import UserError
from .mlm import MaskedLanguageModel, MLMLoss, mask_tokens
from .prepare import prepare, pretraining_texts, text_windows
from .runconfig import RunConfig
from .tasks import CONFIG_FILE, TOKENIZER_META, EpochBatches, find_weights
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer

#: Validation always corrupts the held-out texts with this seed, so every validation scores the same task.
VALID_MASK_SEED = 12345


@dataclass
class MLMBatch:
    """Restore the original subwords ``targets`` at the ``selected`` positions of the corrupted ``tokens``."""

    tokens: Tensor  # (B, T) corrupted input, padded
    selected: Tensor  # (B, T) bool: True where a subword is to be predicted
    targets: Tensor  # (N,) the original subwords at the selected positions, N = selected.sum()
    n_targets: int  # N


def validation_windows(cfg: RunConfig, tok: Tokenizer, log=print) -> list[list[int]]:
    """At most ``mlm.valid_windows`` windows of held-out text: ``data.valid``, or the rows of the pretraining
    files held out by ``data.valid_fraction`` (streamed; reading stops once there are enough)."""
    d, m = cfg.data, cfg.mlm
    texts = pretraining_texts(cfg, [d.valid] if d.valid else [d.train, *d.extra_text], held_out=not d.valid)
    out: list[list[int]] = []
    while len(out) < m.valid_windows and (chunk := list(islice(texts, 1024))):
        out += text_windows(tok.encode_src(chunk), d.max_len, m.min_len)
    return out[: m.valid_windows]


class PretrainTask:
    """Masked-language-model pretraining of an encoder; validation MLM loss and masked accuracy."""

    name = "pretrain"

    def __init__(self, cfg: RunConfig, run_dir: Path, log=print, *, resume: bool = False) -> None:
        self.cfg = cfg
        d = cfg.data
        if cfg.model.arch != "transformer":
            raise UserError("task pretrain needs model.arch: transformer")
        data = prepare(cfg, run_dir, log, resume=resume)
        self.tok, self.manifest = data.tok, data.manifest
        if self.tok.mask_id is None:
            raise UserError(f"{run_dir / TOKENIZER_META}: this tokenizer has no <mask> piece; pretrain in a new "
                            f"--run-dir")
        self.x = data.sides["text"]  # memory-mapped windows of at most max_len subwords
        self.valid_x = TokenArrays.from_lists(validation_windows(cfg, self.tok, log))
        if not len(self.valid_x):
            raise UserError(f"{d.valid or d.train}: no validation text of at least mlm.min_len={cfg.mlm.min_len} "
                            f"subwords; set data.valid_fraction (e.g. 0.1) or data.valid")
        self._batches = EpochBatches(cfg, self.x.lengths)
        batches = self.batches(0)
        padding = padding_fraction(batches, self.x.lengths, None, cfg.train.pad_multiple)
        log(f"pretraining data: {len(self.x)} windows of at most {d.max_len} subwords "
            f"({int(self.x.lengths.sum())} subwords); {len(self.valid_x)} validation windows; {len(batches)} batches "
            f"per epoch, {padding:.1%} of positions padding")

    def build_model(self) -> nn.Module:
        return MaskedLanguageModel(self.cfg.model.transformer, self.tok.src_vocab_size)

    def objective(self, model: nn.Module) -> nn.Module:
        """The reference loss, or the engine's fused one (``train.engine``); the same value."""
        return FusedMLMLoss(model) if self.cfg.train.engine == "fast" else MLMLoss(model)

    def batches(self, epoch: int) -> Batches:
        return self._batches(epoch)

    def _corrupt(self, tokens: Tensor, device: torch.device, generator: torch.Generator | None) -> MLMBatch:
        """BERT's corruption of ``tokens`` (B, T), padded, on the CPU: the masks come from the CPU generator."""
        m = self.cfg.mlm
        inputs, selected = mask_tokens(tokens, mask_id=self.tok.mask_id, special_ids=(UNK_ID, BOS_ID, EOS_ID),
                                       vocab_size=self.tok.src_vocab_size, select=m.select, mask=m.mask,
                                       random=m.random, generator=generator)
        targets = tokens[selected]  # (N,)
        return MLMBatch(inputs.to(device), selected.to(device), targets.to(device), int(selected.sum()))

    def collate(self, indices: list[int], device: torch.device) -> MLMBatch:
        """A batch corrupted with torch's default generator, whose state every checkpoint saves (exact resume)."""
        return self._corrupt(self.x.pad(indices, PAD_ID, self.cfg.train.pad_multiple), device, None)

    def loss(self, objective: nn.Module, batch: MLMBatch, label_smoothing: float) -> Tensor:
        return objective(batch.tokens, batch.selected, batch.targets, label_smoothing)

    def validate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """MLM loss (no smoothing) and accuracy on the masked positions of the held-out windows; score = accuracy."""
        model.eval()
        generator = torch.Generator().manual_seed(VALID_MASK_SEED)
        total, correct, n = 0.0, 0, 0
        order = make_batches(self.valid_x.lengths, None, self.cfg.train.max_tokens, seed=0, epoch=0, shuffle=False)
        with torch.inference_mode():
            for b_index in range(len(order)):
                b = self._corrupt(self.valid_x.pad(order.array(b_index), PAD_ID), device, generator)
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
