"""``task: classify``: an encoder-only classifier of labelled text (the seeds' sentiment model).

Data: one labelled ``.tsv``/``.csv`` file (text and label columns, detected or configured), ``<br />``
tags and truncation as ``data:`` says (:mod:`attnkit.data.documents`); validation rows from
``data.valid`` or held out of the training file (``data.valid_fraction``, by ``data.group_column``).
Objective: summed (label-smoothed) cross-entropy. Validation: accuracy. With ``model.init_from`` the
run starts from a pretraining run's tokenizer and encoder, or (``model.classifier: decoder``) from a
language model's tokenizer and layers (:mod:`attnkit.tasks.init_from`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..classifier import DecoderClassifier, TransformerClassifier
from ..common.errors import UserError
from ..config.schema import RunConfig
from ..data.arrays import TokenArrays
from ..data.batching import EpochBatches, FilterStats, padding_fraction
from ..data.documents import classifier_inputs, clean_text, document_settings, split_rows
from ..data.labelled import LabelledData, LabelledReader, read_labelled
from ..data.prepare import Encoded, flat
from ..data.readers import ReadStats
from ..data.tokenizer import PAD_ID, Tokenizer
from ..inference.attention_maps import classifier_maps
from ..runs.layout import CLASSES_FILE
from .base import BaseRecipe, EpochTask, TaskSpec, refuse_lora, scaled_groups
from .init_from import copy_pretrained_tokenizer, load_pretrained_body
from .objectives import ClassificationLoss


def labelled_reader(cfg: RunConfig, stats: ReadStats | None = None) -> LabelledReader:
    """The reader of the classification training file, with the configured columns."""
    d = cfg.data
    return LabelledReader(d.train, text_column=d.text_column, label_column=d.label_column,
                          group_column=d.group_column, stats=stats)



@dataclass
class ClassificationRecipe(BaseRecipe):
    """What ``prepare`` makes of a classification config: the ``text`` ids (cleaned, truncated) and labels."""

    labelled = True

    def sources(self) -> list[str]:
        return [self.cfg.data.train] if self.cfg.data.generate == "none" else []

    def settings(self) -> dict:
        return {**document_settings(self.cfg.data), "truncate": self.cfg.data.truncate}

    def examples(self, stats: ReadStats | None = None, log: Callable[[str], None] | None = None
                 ) -> Iterator[tuple[str, str]]:
        """``(text, label)`` of the training rows (those ``data.valid_fraction`` does not hold out), streamed."""
        return split_rows(labelled_reader(self.cfg, stats).keyed(), self.cfg.data, held_out=False)

    def tokenizer_texts(self) -> tuple[Iterator[str], None]:
        return (clean_text(text, self.cfg.data.line_break_tags) for text, _ in self.examples()), None

    def given_tokenizer(self, run_dir: Path, log: Callable[[str], None]) -> Tokenizer | None:
        """The pretraining run's tokenizer when fine-tuning (``model.init_from``)."""
        init_from = self.cfg.model.init_from
        return copy_pretrained_tokenizer(self.cfg, run_dir, log) if init_from else None

    def encode(self, tok: Tokenizer, chunk: list[tuple[str, str]], dtype: str) -> Encoded:
        ids = classifier_inputs(tok, [text for text, _ in chunk], self.cfg.data, threads=1)
        return Encoded([flat(ids, dtype)], labels=[label for _, label in chunk])

    def finish(self, n: int, filtered: FilterStats, stats: ReadStats, log: Callable[[str], None]) -> dict:
        if n == 0:
            raise UserError(f"{self.cfg.data.train or 'data.generate_train'}: no training rows")
        return {}


@dataclass
class ClassificationBatch:
    tokens: Tensor  # (B, T), padded
    targets: Tensor  # (B,) class indices
    n_targets: int  # B



def read_validation(cfg: RunConfig, log=print) -> LabelledData:
    """The validation rows: ``data.valid``, or the rows of ``data.train`` held out (``data.valid_fraction``)."""
    d = cfg.data
    if not d.valid_fraction:
        return read_labelled(d.valid, text_column=d.text_column, label_column=d.label_column)
    reader = labelled_reader(cfg)
    rows = list(split_rows(reader.keyed(), d, held_out=True))
    by = f"grouped by column '{d.group_column}'" if d.group_column else "rows"
    log(f"validation: {len(rows)} rows of {d.train} held out (data.valid_fraction {d.valid_fraction}, {by}, "
        f"seed {d.valid_seed})")
    if not rows:
        raise UserError(f"{d.train}: data.valid_fraction {d.valid_fraction} holds out no rows; raise it")
    return LabelledData([t for t, _ in rows], [label for _, label in rows], reader.text_column, reader.label_column,
                        f"{d.train} (held-out rows)")


def build_classifier(cfg: RunConfig, tok: Tokenizer, classes: list[str] | None) -> nn.Module:
    """The classifier for the run's classes: the encoder-only :class:`TransformerClassifier`, or the
    :class:`DecoderClassifier` over a causal language model's layers (``model.classifier: decoder``)."""
    if cfg.model.arch != "transformer":
        raise UserError("task classify needs model.arch: transformer")
    if classes is None:
        raise UserError(f"a classifier needs its class names ({CLASSES_FILE}); is this a complete run?")
    if 0 < cfg.model.ngram_buckets <= tok.src_vocab_size:
        raise UserError(f"model.ngram_buckets ({cfg.model.ngram_buckets}) must exceed the vocabulary size "
                        f"({tok.src_vocab_size}): unigrams take its ids, bigrams the slots after them")
    if cfg.model.classifier == "decoder":
        return DecoderClassifier(cfg.model.transformer, tok.src_vocab_size, len(classes), pooling=cfg.model.pooling,
                                 ngram_buckets=cfg.model.ngram_buckets)
    return TransformerClassifier(cfg.model.transformer, tok.src_vocab_size, len(classes or []),
                                 pooling=cfg.model.pooling, pooler=cfg.model.pooler,
                                 ngram_buckets=cfg.model.ngram_buckets)


class ClassificationTask(EpochTask):
    """Encoder-only classifier with (label-smoothed) cross-entropy; validation accuracy as the score."""

    name = "classify"
    rate_unit = "texts"  # what the loss is averaged over: one label per text

    def __init__(self, cfg: RunConfig, run_dir: Path, log=print, *, resume: bool = False) -> None:
        self.cfg = cfg
        d = cfg.data
        data = self.prepare(ClassificationRecipe(cfg), run_dir, log, resume)
        self.classes = data.classes or []
        valid = read_validation(cfg, log)
        unknown = sorted(set(valid.labels) - set(self.classes))
        if unknown:
            raise UserError(f"{valid.path}: label(s) {unknown} in column '{valid.label_column}' do not occur in "
                            f"the training rows of {d.train}")
        index = {c: i for i, c in enumerate(self.classes)}
        self.x = data.sides["text"]  # memory-mapped ids, cut to max_len
        self.y = data.labels
        self.valid_x = TokenArrays.from_lists(classifier_inputs(self.tok, valid.texts, d))
        self.valid_y = [index[label] for label in valid.labels]
        self._batches = EpochBatches(cfg, self.x.lengths)
        batches = self.batches(0)
        padding = padding_fraction(batches, self.x.lengths, None, cfg.train.pad_multiple)
        log(f"training data: {len(self.x)} texts, {len(self.classes)} classes {self.classes}; "
            f"{len(batches)} batches per epoch, {padding:.1%} of positions padding")

    def build_model(self) -> nn.Module:
        model = build_classifier(self.cfg, self.tok, self.classes)
        if self.cfg.model.init_from:
            load_pretrained_body(model, self.cfg)
        if getattr(model, "ngrams", None) is not None:  # the n-gram expert's NB ratios, from the training texts
            model.ngrams.fit_ratios(self.labelled_batches())
        return model

    def parameter_groups(self, model: nn.Module) -> list[dict]:
        """The n-gram expert's parameters at ``model.ngram_lr`` times ``train.lr``, the rest at ``train.lr``."""
        scale = self.cfg.model.ngram_lr
        if getattr(model, "ngrams", None) is None or scale == 1.0:
            return super().parameter_groups(model)
        return scaled_groups(model, "ngrams.", scale)

    def labelled_batches(self, size: int = 256) -> Iterator[tuple[Tensor, Tensor]]:
        """Every training text as read in training (``(B, T)`` ids, padded) with its class index ``(B,)``."""
        for start in range(0, len(self.x), size):
            batch = self.collate(list(range(start, min(start + size, len(self.x)))), torch.device("cpu"))
            yield batch.tokens, batch.targets

    def objective(self, model: nn.Module) -> nn.Module:
        return ClassificationLoss(model)

    def collate(self, indices: Sequence[int], device: torch.device) -> ClassificationBatch:
        x = self.x.pad(indices, PAD_ID, self.cfg.train.pad_multiple).to(device)  # (B, T)
        y = torch.from_numpy(self.y[np.asarray(indices)].astype(np.int64)).to(device)  # (B,)
        return ClassificationBatch(x, y, len(indices))

    def loss(self, objective: nn.Module, batch: ClassificationBatch, label_smoothing: float) -> Tensor:
        return objective(batch.tokens, batch.targets, label_smoothing)

    def validate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        model.eval()
        correct, total_loss = 0, 0.0
        with torch.inference_mode():
            for start in range(0, len(self.valid_x), 256):
                idx = list(range(start, min(start + 256, len(self.valid_x))))
                x = self.valid_x.pad(idx, PAD_ID).to(device)
                y = torch.tensor([self.valid_y[i] for i in idx], device=device)
                logits = model(x).float()
                total_loss += F.cross_entropy(logits, y, reduction="sum").item()
                correct += int((logits.argmax(-1) == y).sum())
        model.train()
        acc = 100.0 * correct / max(len(self.valid_x), 1)
        return {"valid_loss": total_loss / max(len(self.valid_x), 1), "valid_acc": acc, "score": acc}



def check(cfg: RunConfig) -> None:
    """A classifier reads windows of ``data.max_len`` subwords, which must fit its positions; a decoder-only
    classifier pools a state that has read the whole text."""
    cfg.check_lengths(ends=0)
    refuse_lora(cfg)
    if not 0.0 < cfg.model.ngram_lr < float("inf"):
        raise UserError(f"model.ngram_lr must be a positive multiple of train.lr, got {cfg.model.ngram_lr}")
    if cfg.model.ngram_buckets < 0:
        raise UserError(f"model.ngram_buckets must be 0 (no n-gram expert) or a number of slots, got "
                        f"{cfg.model.ngram_buckets}")
    if cfg.model.classifier == "decoder" and cfg.model.pooling == "first":
        raise UserError("model.pooling: first reads one token in a decoder-only classifier (model.classifier: "
                        "decoder); choose last, mean or max")
    if cfg.model.classifier == "decoder" and cfg.model.pooler:
        raise UserError("model.pooler is BERT's, for model.classifier: encoder")


SPEC = TaskSpec("classify", ClassificationTask, ClassificationRecipe, serves="classify", check=check,
                build_model=build_classifier, hint="use `attnkit classify`", attention_maps=classifier_maps)
