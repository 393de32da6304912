"""``task: pretrain``: masked-language-model (or ELECTRA) pretraining on unlabelled text, and fine-tuning from it.

    attnkit train configs/imdb-pretrain.yaml --run-dir runs/imdb-pretrain      # MLM on the review text
    attnkit train configs/imdb-finetune.yaml --run-dir runs/imdb-finetune      # model.init_from: runs/imdb-pretrain

The pretraining run has the trainer's checkpoints, exact resume, bf16, progress and DDP like any
other; its task (:class:`PretrainTask`) prepares the text like every task (:mod:`attnkit.data.prepare`:
streamed, a SentencePiece tokenizer with a ``<mask>`` piece, each text cut into windows of
``data.max_len`` subwords, memory-mapped) and corrupts every batch as BERT does (:mod:`attnkit.mlm`).
Validation: the MLM loss and the accuracy on the masked
positions of held-out texts, under a fixed corruption.

With ``mlm.objective: electra`` the encoder is trained as ELECTRA's discriminator instead
(:class:`attnkit.mlm.ReplacedTokenDetection`): collate masks every selected subword, the model's
generator samples the replacements in its forward pass (torch's default generator, so resume stays
exact), and the loss is :class:`~attnkit.mlm.ReplacedTokenDetectionLoss`; ``n_targets`` is still the
number of selected positions. Its validation reports the generator's masked accuracy and the
discriminator's loss and accuracy over every non-pad position (``score`` = that accuracy), with the
masks and the samples drawn from a fixed seed.

A classification run with ``model.init_from: RUN`` copies that run's tokenizer and starts from its
encoder and embedding weights (:mod:`attnkit.tasks.init_from`); the classification head is new.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from operator import itemgetter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..common.errors import UserError
from ..config.schema import RunConfig
from ..data.arrays import TokenArrays
from ..data.batching import EpochBatches, FilterStats, make_batches, padding_fraction
from ..data.documents import clean_text, document_settings, split_rows, text_windows
from ..data.labelled import LABEL_COLUMN_NAMES, LabelledReader
from ..data.prepare import Encoded, flat
from ..data.readers import ReadStats, base_suffix, iter_lines
from ..data.tokenizer import BOS_ID, EOS_ID, PAD_ID, TOKENIZER_FILE, UNK_ID, Tokenizer
from ..engine import FusedMLMLoss
from ..mlm import (
    MaskedLanguageModel,
    MLMLoss,
    ReplacedTokenDetection,
    ReplacedTokenDetectionLoss,
    mask_tokens,
    replaced_labels,
)
from .base import BaseRecipe, EpochTask, TaskSpec, refuse_init_from, scaled_groups

#: Validation always corrupts the held-out texts with this seed, so every validation scores the same task.
VALID_MASK_SEED = 12345


@dataclass
class PretrainRecipe(BaseRecipe):
    """What ``prepare`` makes of a pretraining config: ``text`` windows of at most ``data.max_len`` subwords."""

    mask = True

    def sources(self) -> list[str]:
        d = self.cfg.data
        return [d.train, *d.extra_text] if d.generate == "none" else []

    def settings(self) -> dict:
        return {**document_settings(self.cfg.data), "min_len": self.cfg.mlm.min_len}

    def examples(self, stats: ReadStats | None = None, log: Callable[[str], None] | None = None
                 ) -> Iterator[tuple[str, str]]:
        """``(text, "")`` of every training text (cleaned), streamed."""
        return ((text, "") for text in pretraining_texts(self.cfg, self.sources(), stats=stats, log=log))

    def tokenizer_texts(self) -> tuple[Iterator[str], None]:
        return map(itemgetter(0), self.examples()), None

    def tokenizer_note(self) -> str:
        return ", with <mask>"

    def encode(self, tok: Tokenizer, chunk: list[tuple[str, str]], dtype: str) -> Encoded:
        """Each text cut into windows (the texts come cleaned from :func:`pretraining_texts`)."""
        windows = text_windows(tok.encode_src([text for text, _ in chunk], threads=1), self.cfg.data.max_len,
                               self.cfg.mlm.min_len)
        return Encoded([flat(windows, dtype)])

    def finish(self, n: int, filtered: FilterStats, stats: ReadStats, log: Callable[[str], None]) -> dict:
        if n == 0:
            raise UserError(f"{', '.join(self.sources())}: no text of at least mlm.min_len={self.cfg.mlm.min_len} "
                            f"subwords to pretrain on; give files with one text per line")
        log(f"pretraining data: {n} windows of at most {self.cfg.data.max_len} subwords")
        return {}



@dataclass
class MLMBatch:
    """Restore the original subwords ``targets`` at the ``selected`` positions of the corrupted ``tokens``."""

    tokens: Tensor  # (B, T) corrupted input, padded
    selected: Tensor  # (B, T) bool: True where a subword is to be predicted
    targets: Tensor  # (N,) the original subwords at the selected positions, N = selected.sum()
    n_targets: int  # N



def pretraining_texts(cfg: RunConfig, paths: list[str], *, held_out: bool = False, stats: ReadStats | None = None,
                      log: Callable[[str], None] | None = None) -> Iterator[str]:
    """The texts of pretraining files on one side of ``data.valid_fraction``, ``<br />`` treated as configured.

    ``.txt`` (optionally ``.gz``): one text per line, blank lines skipped. ``.tsv`` / ``.csv``: the text column
    (``data.text_column`` or detected), labels unread (a file may have none, like IMDB's unlabelled reviews).
    With ``data.valid_fraction`` and ``data.group_column`` the rows are held out by group: in the first file
    (which must have that column) and in every other file that has it, so that a movie held out of the
    labelled reviews has none of its unlabelled reviews in pretraining either; other files by row.
    """
    d = cfg.data
    for i, path in enumerate(paths):
        if base_suffix(Path(path)) in (".tsv", ".csv"):
            reader = LabelledReader(path, text_column=d.text_column, labelled=False, stats=stats)
            group = d.group_column if d.valid_fraction and (i == 0 or d.group_column in reader.header) else None
            if group is not None:
                reader = LabelledReader(path, text_column=d.text_column, group_column=group, labelled=False,
                                        stats=stats)
            if log is not None:
                labels = [h for h in reader.header if h == d.label_column or h.lower() in LABEL_COLUMN_NAMES]
                log(f"{path}: pretraining on column '{reader.text_column}'" + (f" (held out by '{group}')" if group
                                                                               else "")
                    + (f"; the labels in '{labels[0]}' are ignored" if labels else ""))
            rows: Iterator[tuple[str, str, str]] = reader.keyed()
        else:
            lines = (line for line in iter_lines(path, stats) if line is not None and line.strip())
            rows = ((line, "", str(n)) for n, line in enumerate(lines))
        for text, _ in split_rows(rows, d, held_out=held_out):
            yield clean_text(text, d.line_break_tags)



def validation_windows(cfg: RunConfig, tok: Tokenizer, log=print) -> list[list[int]]:
    """At most ``mlm.valid_windows`` windows of held-out text: ``data.valid``, or the rows of the pretraining
    files held out by ``data.valid_fraction`` (streamed; reading stops once there are enough)."""
    d, m = cfg.data, cfg.mlm
    texts = pretraining_texts(cfg, [d.valid] if d.valid else [d.train, *d.extra_text], held_out=not d.valid)
    out: list[list[int]] = []
    while len(out) < m.valid_windows and (chunk := list(islice(texts, 1024))):
        out += text_windows(tok.encode_src(chunk), d.max_len, m.min_len)
    return out[: m.valid_windows]


def build_encoder_lm(cfg: RunConfig, tok: Tokenizer, classes: list[str] | None = None) -> nn.Module:
    """The model an encoder is pretrained as (``mlm.objective``): a :class:`MaskedLanguageModel`, or ELECTRA's
    :class:`ReplacedTokenDetection` (its generator never samples a special piece, which no target is)."""
    if cfg.model.arch != "transformer":
        raise UserError("task pretrain needs model.arch: transformer")
    if cfg.mlm.objective == "electra":
        specials = (UNK_ID, BOS_ID, EOS_ID) + ((tok.mask_id,) if tok.mask_id is not None else ())
        return ReplacedTokenDetection(cfg.model.transformer, tok.src_vocab_size,
                                      generator_width=cfg.mlm.generator_width, never_sample=specials)
    return MaskedLanguageModel(cfg.model.transformer, tok.src_vocab_size)


class PretrainTask(EpochTask):
    """Masked-language-model pretraining of an encoder; validation MLM loss and masked accuracy."""

    name = "pretrain"
    rate_unit = "targets"  # what the loss is averaged over: the selected subwords

    def __init__(self, cfg: RunConfig, run_dir: Path, log=print, *, resume: bool = False) -> None:
        self.cfg = cfg
        d = cfg.data
        data = self.prepare(PretrainRecipe(cfg), run_dir, log, resume)
        if self.tok.mask_id is None:
            raise UserError(f"{run_dir / TOKENIZER_FILE}: this tokenizer has no <mask> piece; pretrain in a new "
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
        return build_encoder_lm(self.cfg, self.tok)

    def parameter_groups(self, model: nn.Module) -> list[dict]:
        """ELECTRA: the generator's parameters at ``mlm.generator_lr`` times ``train.lr``, the rest at ``train.lr``
        (the shared embeddings are the discriminator's). MLM: one group."""
        scale = self.cfg.mlm.generator_lr
        if self.cfg.mlm.objective != "electra" or scale == 1.0:
            return super().parameter_groups(model)
        return scaled_groups(model, "generator.", scale)

    def objective(self, model: nn.Module) -> nn.Module:
        """The reference loss, or the engine's fused one (``train.engine``); the same value. ELECTRA: its loss."""
        if self.cfg.mlm.objective == "electra":
            return ReplacedTokenDetectionLoss(model, self.cfg.mlm.electra_weight)
        return FusedMLMLoss(model) if self.cfg.train.engine != "reference" else MLMLoss(model)

    def _corrupt(self, tokens: Tensor, device: torch.device, generator: torch.Generator | None) -> MLMBatch:
        """BERT's corruption of ``tokens`` (B, T), padded, on the CPU: the masks come from the CPU generator.
        ELECTRA replaces every selected subword by ``<mask>`` (its generator fills them in)."""
        m = self.cfg.mlm
        mask, random = (1.0, 0.0) if m.objective == "electra" else (m.mask, m.random)
        inputs, selected = mask_tokens(tokens, mask_id=self.tok.mask_id, special_ids=(UNK_ID, BOS_ID, EOS_ID),
                                       vocab_size=self.tok.src_vocab_size, select=m.select, mask=mask,
                                       random=random, generator=generator)
        targets = tokens[selected]  # (N,)
        return MLMBatch(inputs.to(device), selected.to(device), targets.to(device), int(selected.sum()))

    def collate(self, indices: list[int], device: torch.device) -> MLMBatch:
        """A batch corrupted with torch's default generator, whose state every checkpoint saves (exact resume)."""
        return self._corrupt(self.x.pad(indices, PAD_ID, self.cfg.train.pad_multiple), device, None)

    def loss(self, objective: nn.Module, batch: MLMBatch, label_smoothing: float) -> Tensor:
        return objective(batch.tokens, batch.selected, batch.targets, label_smoothing)

    def _valid_batches(self, device: torch.device, generator: torch.Generator) -> Iterator[MLMBatch]:
        """The held-out windows in batches, corrupted with ``generator``."""
        order = make_batches(self.valid_x.lengths, None, self.cfg.train.max_tokens, seed=0, epoch=0, shuffle=False)
        for b_index in range(len(order)):
            yield self._corrupt(self.valid_x.pad(order.array(b_index), PAD_ID), device, generator)

    def validate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """MLM loss (no smoothing) and accuracy on the masked positions of the held-out windows; score = accuracy."""
        if self.cfg.mlm.objective == "electra":
            return self._validate_electra(model, device)
        model.eval()
        generator = torch.Generator().manual_seed(VALID_MASK_SEED)
        total, correct, n = 0.0, 0, 0
        with torch.inference_mode():
            for b in self._valid_batches(device, generator):
                logits = model(b.tokens, b.selected).float()  # (N, V)
                total += F.cross_entropy(logits, b.targets, reduction="sum").item()
                correct += int((logits.argmax(-1) == b.targets).sum())
                n += b.n_targets
        model.train()
        loss, acc = total / max(n, 1), 100.0 * correct / max(n, 1)
        return {"valid_loss": loss, "valid_ppl": math.exp(min(loss, 50.0)), "valid_mlm_acc": acc, "score": acc}

    def _validate_electra(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """The generator's MLM loss and accuracy on the masked positions, the discriminator's BCE and accuracy
        on every non-pad position (masks and samples from one fixed seed); ``valid_loss`` = the training
        objective per selected position (no smoothing); score = the discriminator's accuracy."""
        model.eval()
        generator = torch.Generator().manual_seed(VALID_MASK_SEED)
        mlm, correct, n, bce, detected, m = 0.0, 0, 0, 0.0, 0, 0
        with torch.inference_mode():
            for b in self._valid_batches(device, generator):
                out = model(b.tokens, b.selected, generator)
                logits = out.generator_logits.float()  # (N, V)
                mlm += F.cross_entropy(logits, b.targets, reduction="sum").item()
                correct += int((logits.argmax(-1) == b.targets).sum())
                replaced, real = replaced_labels(out.corrupted, b.tokens.masked_scatter(b.selected, b.targets))
                scores = out.replaced_logits.float()[real]  # (M,)
                bce += F.binary_cross_entropy_with_logits(scores, replaced[real].float(), reduction="sum").item()
                detected += int(((scores > 0) == replaced[real]).sum())
                n, m = n + b.n_targets, m + int(real.sum())
        model.train()
        mlm_loss, rtd_loss, rtd_acc = mlm / max(n, 1), bce / max(m, 1), 100.0 * detected / max(m, 1)
        return {"valid_loss": mlm_loss + self.cfg.mlm.electra_weight * rtd_loss, "valid_mlm_loss": mlm_loss,
                "valid_mlm_acc": 100.0 * correct / max(n, 1), "valid_rtd_loss": rtd_loss, "valid_rtd_acc": rtd_acc,
                "score": rtd_acc}



def check(cfg: RunConfig) -> None:
    """Windows of ``data.max_len`` subwords fit the encoder's positions; ``model.init_from`` is not for pretraining."""
    refuse_init_from(cfg)
    cfg.check_lengths(ends=0)


SPEC = TaskSpec("pretrain", PretrainTask, PretrainRecipe, serves=None, check=check, build_model=build_encoder_lm,
                hint="fine-tune it (model.init_from) first")
