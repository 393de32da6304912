"""``task: translate``: sequence-to-sequence with teacher forcing, for a Transformer or an RNN.

Data: parallel text (two line-aligned files, one TSV or JSONL file, or the built-in dates), one
SentencePiece tokenizer (joint) or two; pairs longer than ``data.max_len`` are filtered out.
Objective: summed label-smoothed cross-entropy over the target tokens
(:class:`~attnkit.tasks.objectives.Seq2SeqLoss`, or the engine's fused one). Validation: loss,
perplexity and greedy BLEU on the validation pairs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from operator import itemgetter
from pathlib import Path

import numpy as np
import sacrebleu
import torch
from torch import Tensor, nn

from ..common.errors import UserError
from ..config.schema import RunConfig
from ..data import dates
from ..data.arrays import TokenArrays
from ..data.batching import (
    EpochBatches,
    FilterStats,
    filter_examples,
    filter_lengths,
    make_batches,
    padding_fraction,
)
from ..data.prepare import Encoded, flat
from ..data.readers import ReadStats, iter_kept_lines, iter_parallel, read_parallel
from ..data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from ..engine import FusedSeq2SeqLoss
from ..inference.attention_maps import translation_maps
from ..inference.translate import translate_texts
from ..rnn import RNNSeq2Seq
from ..transformer import Transformer
from .base import BaseRecipe, EpochTask, TaskSpec, refuse_init_from
from .objectives import Seq2SeqLoss


@dataclass
class TranslationRecipe(BaseRecipe):
    """What ``prepare`` makes of a translation config: ``src`` and ``tgt`` ids of the pairs that fit ``max_len``."""

    sides = ("src", "tgt")

    def sources(self) -> list[str]:
        d = self.cfg.data
        if d.generate != "none":
            return []
        return [d.train] + ([d.train_tgt] if d.train_tgt else [])

    def examples(self, stats: ReadStats | None = None, log: Callable[[str], None] | None = None
                 ) -> Iterator[tuple[str, str]]:
        """``(source, target)`` pairs, streamed."""
        d = self.cfg.data
        if d.generate == "dates":
            return iter(dates.generate_pairs(d.generate_train, seed=self.cfg.train.seed, split="train"))
        return iter_parallel(d.train, d.train_tgt, stats=stats)

    def tokenizer_texts(self) -> tuple[Iterator[str], Iterator[str]]:
        """Source and target text for SentencePiece (two files: each file alone)."""
        d = self.cfg.data
        if d.generate == "none" and d.train_tgt:
            return iter_kept_lines(d.train), iter_kept_lines(d.train_tgt)
        return map(itemgetter(0), self.examples()), map(itemgetter(1), self.examples())

    def tokenizer_note(self) -> str:
        return f", joint {self.cfg.data.tokenizer.joint}"

    def encode(self, tok: Tokenizer, chunk: list[tuple[str, str]], dtype: str) -> Encoded:
        """Both sides of a chunk of pairs (one SentencePiece thread: the processes are the parallelism),
        and which pairs fit ``data.max_len``."""
        src, src_lens = flat(tok.encode_src([s for s, _ in chunk], threads=1), dtype)
        tgt, tgt_lens = flat(tok.encode_tgt([t for _, t in chunk], threads=1), dtype)
        keep, filtered = filter_lengths(src_lens, tgt_lens, self.cfg.data.max_len)
        return Encoded([(src, src_lens), (tgt, tgt_lens)], keep, filtered)

    def finish(self, n: int, filtered: FilterStats, stats: ReadStats, log: Callable[[str], None]) -> dict:
        log(f"training data: {filtered}" + (f"; skipped {stats.long_lines} line(s) longer than "
                                            f"{stats.max_line_bytes} bytes" if stats.long_lines else ""))
        if n == 0:
            raise UserError(f"{self.cfg.data.train or 'data.generate_train'}: no usable training pairs ({filtered})")
        return {"filter": asdict(filtered)}


@dataclass
class TranslationBatch:
    """Teacher forcing: predict ``targets`` at the ``scored`` positions of ``tgt_in``."""

    src: Tensor  # (B, S) x_1 .. x_S </s>, padded
    tgt_in: Tensor  # (B, T) <s> y_1 .. y_T, padded
    scored: Tensor  # (B, T) bool: True where the next token is real (not padding)
    targets: Tensor  # (N,) y_1 .. y_T </s> at the scored positions, N = scored.sum()
    n_targets: int  # what the loss is averaged over: N



def read_validation_pairs(cfg: RunConfig) -> list[tuple[str, str]]:
    """Validation sentence pairs, in memory (they are few): from files or the generator."""
    data = cfg.data
    if data.generate == "dates":
        return dates.generate_pairs(data.generate_valid, seed=cfg.train.seed, split="valid")
    return read_parallel(data.valid, data.valid_tgt)


def build_translation_model(cfg: RunConfig, tok: Tokenizer, classes: list[str] | None = None) -> nn.Module:
    """A :class:`Transformer` or :class:`RNNSeq2Seq` (``model.arch``) sized for the tokenizer's vocabularies."""
    V_src, V_tgt = tok.src_vocab_size, tok.tgt_vocab_size
    if cfg.model.arch == "rnn":
        return RNNSeq2Seq(cfg.model.rnn, V_src, V_tgt)
    tcfg = cfg.model.transformer
    if tcfg.share_embeddings and not tok.joint:
        raise UserError("model.transformer.share_embeddings needs data.tokenizer.joint: true")
    return Transformer(tcfg, V_src, V_tgt)


class TranslationTask(EpochTask):
    """Sequence-to-sequence with teacher forcing and label-smoothed cross-entropy."""

    name = "translate"
    rate_unit = "tok"  # what the loss is averaged over: target tokens

    def __init__(self, cfg: RunConfig, run_dir: Path, log=print, *, resume: bool = False) -> None:
        self.cfg = cfg
        self.valid_pairs = read_validation_pairs(cfg)
        if not self.valid_pairs:  # validation would divide by zero
            where = cfg.data.valid if cfg.data.generate == "none" else "data.generate_valid"
            raise UserError(f"{where}: no validation pairs; give at least one")
        data = self.prepare(TranslationRecipe(cfg), run_dir, log, resume)
        self.src, self.tgt = data.sides["src"], data.sides["tgt"]  # memory-mapped ids, without </s> and <s>
        v_src = self.tok.encode_src([s for s, _ in self.valid_pairs])
        v_tgt = self.tok.encode_tgt([t for _, t in self.valid_pairs])
        v_keep, v_stats = filter_examples(list(zip(v_src, v_tgt, strict=True)), cfg.data.max_len)
        if v_stats.kept < v_stats.total:
            log(f"validation data: {v_stats}")
        if not v_keep:
            raise UserError(f"{cfg.data.valid or 'data.generate_valid'}: no usable validation pairs ({v_stats})")
        self.valid_pairs = [self.valid_pairs[i] for i in v_keep]
        self.valid_src = TokenArrays.from_lists([v_src[i] for i in v_keep])
        self.valid_tgt = TokenArrays.from_lists([v_tgt[i] for i in v_keep])
        self._batches = EpochBatches(cfg, *self.lengths(self.src, self.tgt))
        batches = self.batches(0)
        padding = padding_fraction(batches, *self.lengths(self.src, self.tgt), cfg.train.pad_multiple)
        log(f"{len(batches)} batches per epoch (max_tokens {cfg.train.max_tokens}), {padding:.1%} of positions padding")

    def build_model(self) -> nn.Module:
        return build_translation_model(self.cfg, self.tok)

    @staticmethod
    def lengths(src: TokenArrays, tgt: TokenArrays) -> tuple[np.ndarray, np.ndarray]:
        """Lengths as the model reads them: source ``x </s>``, target ``<s> y`` (= ``y </s>``)."""
        return src.lengths.astype(np.int32) + 1, tgt.lengths.astype(np.int32) + 1

    def objective(self, model: nn.Module) -> nn.Module:
        """The reference loss, or the engine's fused one (``train.engine``); the same value."""
        return FusedSeq2SeqLoss(model) if self.cfg.train.engine != "reference" else Seq2SeqLoss(model)

    @staticmethod
    def _collate(src: TokenArrays, tgt: TokenArrays, indices: Sequence[int], device: torch.device,
                 multiple: int = 1) -> TranslationBatch:
        s = src.pad(indices, PAD_ID, multiple, eos=EOS_ID).to(device)  # (B, S): x_1 .. x_S </s>
        tgt_in = tgt.pad(indices, PAD_ID, multiple, bos=BOS_ID).to(device)  # (B, T): <s> y_1 .. y_T
        tgt_out = tgt.pad(indices, PAD_ID, multiple, eos=EOS_ID).to(device)  # (B, T): y_1 .. y_T </s>
        scored = tgt_out.ne(PAD_ID)  # teacher forcing: predict tgt_out[:, t] from tgt_in[:, :t+1]
        return TranslationBatch(s, tgt_in, scored, tgt_out[scored], int(scored.sum()))

    def collate(self, indices: Sequence[int], device: torch.device) -> TranslationBatch:
        return self._collate(self.src, self.tgt, indices, device, self.cfg.train.pad_multiple)

    def loss(self, objective: nn.Module, batch: TranslationBatch, label_smoothing: float) -> Tensor:
        """Sum over real target tokens of label-smoothed cross-entropy (float32); padding is never scored."""
        return objective(batch.src, batch.tgt_in, batch.scored, batch.targets, label_smoothing)

    def validate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Dev loss (no smoothing), perplexity and greedy BLEU; ``score`` = BLEU (or -loss without BLEU)."""
        model.eval()
        objective = self.objective(model)
        total, n = 0.0, 0
        order = make_batches(*self.lengths(self.valid_src, self.valid_tgt), self.cfg.train.max_tokens,
                             seed=0, epoch=0, shuffle=False)
        with torch.inference_mode():
            for idx in order:
                b = self._collate(self.valid_src, self.valid_tgt, idx, device)
                total += self.loss(objective, b, 0.0).item()
                n += b.n_targets
        loss = total / max(n, 1)
        metrics = {"valid_loss": loss, "valid_ppl": math.exp(min(loss, 50.0))}
        k = self.cfg.train.valid_bleu_sentences
        if k > 0:
            pairs = self.valid_pairs[:k]
            hyps = translate_texts(model, self.tok, [s for s, _ in pairs], beam=1, device=device)
            metrics["valid_bleu"] = sacrebleu.corpus_bleu([h[0] for h in hyps], [[t for _, t in pairs]]).score
            metrics["valid_exact"] = 100.0 * sum(h[0] == t for h, (_, t) in zip(hyps, pairs, strict=True)) / len(pairs)
        metrics["score"] = metrics.get("valid_bleu", -loss)
        model.train()
        return metrics



def check(cfg: RunConfig) -> None:
    """A translation side (with its ``</s>``) fits the positions; validation comes from ``data.valid``."""
    if cfg.data.valid_fraction:
        raise UserError("data.valid_fraction is for classification and pretraining; give data.valid")
    refuse_init_from(cfg)
    cfg.check_lengths(ends=1)


SPEC = TaskSpec("translate", TranslationTask, TranslationRecipe, serves="translate", check=check,
                build_model=build_translation_model, hint="use `attnkit translate`", attention_maps=translation_maps,
                exporters=("ctranslate2", "huggingface"))
