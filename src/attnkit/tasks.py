"""What is learned from what: translation and classification tasks for the one trainer.

A task turns a :class:`~attnkit.runconfig.RunConfig` into token ids, builds its model,
collates batches, computes the training loss and validates. The trainer
(:mod:`attnkit.train`) knows nothing else about the data, so both tasks share its
optimizer, schedule, precision, checkpoints and resume logic.

Run directory layout (written by ``attnkit train``, read by every other command)::

    config.yaml            the resolved configuration
    tokenizer.json, *.model  SentencePiece model(s)
    classes.json           class names (classification)
    data/                  the prepared training data, memory-mapped (see attnkit.prepare)
    checkpoints/step-N/    model.safetensors + trainer.pt (optimizer, schedule, data position, RNG)
    best.safetensors       best validation score so far
    averaged.safetensors   mean of the last K checkpoints (written at the end of training)
    metrics.jsonl          one JSON object per validation
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import sacrebleu
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import dates
from .checkpoint import check_compatible, load_weights
from .classifier import TransformerClassifier
from .config import load_config
from .data import (
    Batches,
    LabelledData,
    TokenArrays,
    filter_examples,
    make_batches,
    pad_batch,
    padding_fraction,
    read_labelled,
    read_parallel,
)
from .engine import FusedSeq2SeqLoss, accelerate
from .errors import UserError
from .prepare import CLASSES_FILE, classifier_inputs, labelled_reader, prepare, split_rows
from .rnn import RNNSeq2Seq
from .runconfig import RunConfig
from .search import LENPEN, MAX_LEN_A, MAX_LEN_B, beam_search, greedy_search
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, TOKENIZER_FILE, Tokenizer
from .transformer import Transformer

CONFIG_FILE, TOKENIZER_META = "config.yaml", TOKENIZER_FILE
BEST_FILE, AVERAGED_FILE = "best.safetensors", "averaged.safetensors"  # written by attnkit.rundir
log = logging.getLogger(__name__)


@dataclass
class TranslationBatch:
    """Teacher forcing: predict ``targets`` at the ``scored`` positions of ``tgt_in``."""

    src: Tensor  # (B, S) x_1 .. x_S </s>, padded
    tgt_in: Tensor  # (B, T) <s> y_1 .. y_T, padded
    scored: Tensor  # (B, T) bool: True where the next token is real (not padding)
    targets: Tensor  # (N,) y_1 .. y_T </s> at the scored positions, N = scored.sum()
    n_targets: int  # what the loss is averaged over: N


@dataclass
class ClassificationBatch:
    tokens: Tensor  # (B, T), padded
    targets: Tensor  # (B,) class indices
    n_targets: int  # B


Batch = TranslationBatch | ClassificationBatch


class Task(Protocol):
    """What the trainer needs from a task."""

    name: str

    def build_model(self) -> nn.Module: ...
    def objective(self, model: nn.Module) -> nn.Module: ...
    def batches(self, epoch: int) -> Batches: ...
    def collate(self, indices: Sequence[int], device: torch.device) -> Batch: ...
    def loss(self, objective: nn.Module, batch: Batch, label_smoothing: float) -> Tensor: ...
    def validate(self, model: nn.Module, device: torch.device) -> dict[str, float]: ...


class Seq2SeqLoss(nn.Module):
    """The training objective of a sequence-to-sequence model: summed label-smoothed cross-entropy.

    ``loss = sum_i -sum_v q_iv log softmax(z_i)_v`` with ``q_i = (1 - eps) onehot(y_i) + eps / V``
    (Szegedy et al. 2016) over the scored (non-padding) positions, in float32. The engine's
    :class:`~attnkit.engine.loss.FusedSeq2SeqLoss` computes the same without keeping the logits.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, src: Tensor, tgt_in: Tensor, scored: Tensor, targets: Tensor,
                label_smoothing: float = 0.0) -> Tensor:
        logits = self.model(src, tgt_in, scored)  # (N, V)
        return F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing, reduction="sum")


class ClassificationLoss(nn.Module):
    """Summed (label-smoothed) cross-entropy of a classifier's logits, in float32."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
        logits = self.model(tokens)  # (B, C)
        return F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing, reduction="sum")


# --------------------------------------------------------------------------------------
# Translation
# --------------------------------------------------------------------------------------


def read_validation_pairs(cfg: RunConfig) -> list[tuple[str, str]]:
    """Validation sentence pairs, in memory (they are few): from files or the generator."""
    data = cfg.data
    if data.generate == "dates":
        return dates.generate_pairs(data.generate_valid, seed=cfg.train.seed, split="valid")
    return read_parallel(data.valid, data.valid_tgt)


def build_translation_model(cfg: RunConfig, tok: Tokenizer) -> nn.Module:
    """A :class:`Transformer` or :class:`RNNSeq2Seq` sized for the tokenizer's vocabularies."""
    V_src, V_tgt = tok.src_vocab_size, tok.tgt_vocab_size
    if cfg.model.arch == "rnn":
        return RNNSeq2Seq(cfg.model.rnn, V_src, V_tgt)
    tcfg = cfg.model.transformer
    if tcfg.share_embeddings and not tok.joint:
        raise UserError("model.transformer.share_embeddings needs data.tokenizer.joint: true")
    return Transformer(tcfg, V_src, V_tgt)


def source_limit(model: nn.Module) -> int | None:
    """How many source positions (``</s>`` included) the model reads: ``max_len`` for a Transformer, None for an RNN."""
    return getattr(getattr(model, "cfg", None), "max_len", None)


def _too_long(what: str, length: int, limit: int) -> str:
    return (f"{what} is {length} subwords long (with </s>) but the model reads at most {limit} "
            f"(model.transformer.max_len)")


def check_source_lengths(model: nn.Module, ids: list[list[int]], what: str | None = None) -> int | None:
    """The model's position limit (None for an RNN), after checking every source ``ids`` (with ``</s>``) fits it.

    A Transformer has positions for ``max_len`` tokens: longer inputs are a :class:`UserError`
    naming ``input line N``, or ``what`` when given (the attention plots, which must show the whole text).
    """
    limit = source_limit(model)
    for i, s in enumerate(ids if limit else []):
        if len(s) > limit:
            raise UserError(f"{_too_long(what or f'input line {i + 1}', len(s), limit)}; split the line")
    return limit


def encode_sources(tok: Tokenizer, texts: list[str], limit: int | None) -> list[list[int]]:
    """Source ids with ``</s>``, each cut to the model's ``limit`` positions (None: no limit).

    A cut text logs one warning naming its line (1-based), so a long file still translates
    line for line. A blank text gives ``[</s>]`` alone (see :func:`translate_texts`).
    """
    ids = [s + [EOS_ID] for s in tok.encode_src(texts)]
    for i, s in enumerate(ids if limit else []):
        if len(s) > limit:
            log.warning("%s; translated its first %d subwords", _too_long(f"input line {i + 1}", len(s), limit),
                        limit - 1)
            ids[i] = s[: limit - 1] + [EOS_ID]
    return ids


def check_decode_options(*, beam: int, n_best: int, lenpen: float, max_len_a: float, max_len_b: float,
                         batch_size: int) -> None:
    """Reject decoding options no search can use (non-finite numbers included), naming the option."""
    for name, value in (("lenpen", lenpen), ("max_len_a", max_len_a), ("max_len_b", max_len_b)):
        if not math.isfinite(value):
            raise UserError(f"{name} must be a finite number, got {value}")
    if beam < 1 or batch_size < 1:
        raise UserError(f"beam ({beam}) and batch_size ({batch_size}) must be at least 1")
    if not 1 <= n_best <= beam:
        raise UserError(f"n_best {n_best} must be between 1 and beam {beam}")
    if max_len_a < 0:
        raise UserError(f"max_len_a must be at least 0, got {max_len_a}")


def output_budget(limit: int | None, src_len: int, max_len_a: float, max_len_b: float) -> tuple[float, float]:
    """``(a, b)`` for the search's output budget ``floor(a * src_len + b)``: as given, or ``(0, limit)``
    when that budget would run past the model's ``limit`` positions (outputs are cut there)."""
    if limit and math.floor(max_len_a * src_len + max_len_b) > limit:
        return 0.0, float(limit)
    return max_len_a, max_len_b


def translation_order(ids: list[list[int]], batch_size: int) -> list[list[int]]:
    """Batches of indices into ``ids``, shortest sources first; blank sources (``</s>`` alone) are left out."""
    order = sorted((i for i, s in enumerate(ids) if len(s) > 1), key=lambda i: len(ids[i]))
    return [order[start: start + batch_size] for start in range(0, len(order), batch_size)]


def translate_texts(model: nn.Module, tok: Tokenizer, texts: list[str], *, beam: int = 1, lenpen: float = LENPEN,
                    batch_size: int = 64, max_len_a: float = MAX_LEN_A, max_len_b: float = MAX_LEN_B,
                    n_best: int = 1, device: torch.device | None = None) -> list[list[str]]:
    """Translate ``texts`` (sorted by length into batches, returned in input order); n-best per sentence.

    A text longer than the model's positions is cut to them (one warning each); a blank text
    gives ``n_best`` empty translations instead of whatever the model says about nothing.
    """
    check_decode_options(beam=beam, n_best=n_best, lenpen=lenpen, max_len_a=max_len_a, max_len_b=max_len_b,
                         batch_size=batch_size)
    device = device or next(model.parameters()).device
    limit = source_limit(model)
    ids = encode_sources(tok, texts, limit)
    out: list[list[str]] = [[""] * n_best for _ in texts]
    model.eval()
    with torch.inference_mode():
        for chunk in translation_order(ids, batch_size):
            given = (max_len_a, max_len_b)
            capped = [i for i in chunk if output_budget(limit, len(ids[i]), *given) != given]
            parts = [([i for i in chunk if i not in capped], max_len_a, max_len_b), (capped, 0.0, limit)]
            for part, a, b in parts:
                if not part:
                    continue
                src = pad_batch([ids[i] for i in part], PAD_ID).to(device)
                if beam == 1 and n_best == 1:
                    hyps = [[h] for h in greedy_search(model, src, max_len_a=a, max_len_b=b)]
                else:
                    hyps = beam_search(model, src, beam_size=beam, lenpen=lenpen, n_best=n_best,
                                       max_len_a=a, max_len_b=b)
                for i, nbest in zip(part, hyps, strict=True):
                    out[i] = tok.decode_tgt([h.tokens for h in nbest])
    return out


class EpochBatches:
    """A task's training batches: length-bucketed by :func:`attnkit.data.make_batches`, shuffled per epoch,
    made once per epoch (the trainer asks for the same epoch's batches many times)."""

    def __init__(self, cfg: RunConfig, src_lens: np.ndarray, tgt_lens: np.ndarray | None = None) -> None:
        self.cfg, self.src_lens, self.tgt_lens = cfg, src_lens, tgt_lens
        self._made: tuple[int, Batches] | None = None

    def __call__(self, epoch: int) -> Batches:
        if self._made is None or self._made[0] != epoch:
            t = self.cfg.train
            self._made = epoch, make_batches(self.src_lens, self.tgt_lens, t.max_tokens, seed=t.seed, epoch=epoch,
                                             pad_multiple=t.pad_multiple)
        return self._made[1]


class TranslationTask:
    """Sequence-to-sequence with teacher forcing and label-smoothed cross-entropy."""

    name = "translate"

    def __init__(self, cfg: RunConfig, run_dir: Path, log=print, *, resume: bool = False) -> None:
        self.cfg = cfg
        self.valid_pairs = read_validation_pairs(cfg)
        if not self.valid_pairs:  # validation would divide by zero
            where = cfg.data.valid if cfg.data.generate == "none" else "data.generate_valid"
            raise UserError(f"{where}: no validation pairs; give at least one")
        data = prepare(cfg, run_dir, log, resume=resume)
        self.tok, self.manifest = data.tok, data.manifest
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

    @staticmethod
    def lengths(src: TokenArrays, tgt: TokenArrays) -> tuple[np.ndarray, np.ndarray]:
        """Lengths as the model reads them: source ``x </s>``, target ``<s> y`` (= ``y </s>``)."""
        return src.lengths.astype(np.int32) + 1, tgt.lengths.astype(np.int32) + 1

    def build_model(self) -> nn.Module:
        return build_translation_model(self.cfg, self.tok)

    def objective(self, model: nn.Module) -> nn.Module:
        """The reference loss, or the engine's fused one (``train.engine``); the same value."""
        return FusedSeq2SeqLoss(model) if self.cfg.train.engine == "fast" else Seq2SeqLoss(model)

    def batches(self, epoch: int) -> Batches:
        return self._batches(epoch)

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


# --------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------


def build_classifier(cfg: RunConfig, tok: Tokenizer, n_classes: int) -> nn.Module:
    """The encoder-only :class:`TransformerClassifier` for ``n_classes`` classes."""
    if cfg.model.arch != "transformer":
        raise UserError("task classify needs model.arch: transformer")
    return TransformerClassifier(cfg.model.transformer, tok.src_vocab_size, n_classes, pooling=cfg.model.pooling)


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


class ClassificationTask:
    """Encoder-only classifier with (label-smoothed) cross-entropy; validation accuracy as the score."""

    name = "classify"

    def __init__(self, cfg: RunConfig, run_dir: Path, log=print, *, resume: bool = False) -> None:
        self.cfg = cfg
        d = cfg.data
        data = prepare(cfg, run_dir, log, resume=resume)
        self.tok, self.manifest, self.classes = data.tok, data.manifest, data.classes or []
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
        model = build_classifier(self.cfg, self.tok, len(self.classes))
        if self.cfg.model.init_from:
            from .pretrain import load_pretrained_encoder

            load_pretrained_encoder(model, self.cfg.model.init_from)
        return model

    def objective(self, model: nn.Module) -> nn.Module:
        return ClassificationLoss(model)

    def batches(self, epoch: int) -> Batches:
        return self._batches(epoch)

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


def make_task(cfg: RunConfig, run_dir: Path, log=print, *, resume: bool = False) -> Task:
    """The task of ``cfg``, its training data prepared (or reused) in ``run_dir`` (:func:`attnkit.prepare.prepare`)."""
    if cfg.task == "pretrain":
        from .pretrain import PretrainTask

        return PretrainTask(cfg, run_dir, log, resume=resume)
    task = ClassificationTask if cfg.task == "classify" else TranslationTask
    return task(cfg, run_dir, log, resume=resume)


# --------------------------------------------------------------------------------------
# Loading a trained run
# --------------------------------------------------------------------------------------


@dataclass
class LoadedRun:
    cfg: RunConfig
    tok: Tokenizer
    model: nn.Module
    classes: list[str] | None
    weights_path: Path


def read_classes(path: Path) -> list[str]:
    """The class names a classifier run was trained with (``classes.json``)."""
    try:
        classes = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read the class names ({type(e).__name__}); is this a complete run?") from None
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise UserError(f"{path}: expected a JSON list of class names")
    return classes


def find_weights(path: Path) -> tuple[Path, Path]:
    """``(run_dir, weights file)`` for a run directory or a ``.safetensors`` file inside one.

    A run directory resolves to ``averaged.safetensors``, else ``best.safetensors``, else the newest step.
    """
    if path.is_file():
        run_dir = path.parent
        while not (run_dir / CONFIG_FILE).exists() and run_dir != run_dir.parent:
            run_dir = run_dir.parent
        if not (run_dir / CONFIG_FILE).exists():
            raise UserError(f"{path}: no {CONFIG_FILE} found beside it or above it; point at a run directory")
        return run_dir, path
    if not (path / CONFIG_FILE).exists():
        raise UserError(f"{path}: not a run directory (no {CONFIG_FILE}); train one with `attnkit train`")
    for name in (AVERAGED_FILE, BEST_FILE):
        if (path / name).exists():
            return path, path / name
    steps = sorted((path / "checkpoints").glob("step-*/model.safetensors"))
    if not steps:
        raise UserError(f"{path}: the run has no checkpoint yet")
    return path, steps[-1]


def load_run(path: str | Path, device: torch.device | None = None) -> LoadedRun:
    """Config, tokenizer and model with trained weights, from a run directory or checkpoint file."""
    run_dir, weights = find_weights(Path(path))
    cfg = load_config(RunConfig, run_dir / CONFIG_FILE)
    tok = Tokenizer.load(run_dir)
    classes = None
    if cfg.task == "classify":
        classes = read_classes(run_dir / CLASSES_FILE)
        model: nn.Module = build_classifier(cfg, tok, len(classes))
    elif cfg.task == "pretrain":
        from .mlm import MaskedLanguageModel

        model = MaskedLanguageModel(cfg.model.transformer, tok.src_vocab_size)
    else:
        model = build_translation_model(cfg, tok)
    state, _ = load_weights(weights)
    check_compatible(model.state_dict(), state, weights)
    model.load_state_dict(state)
    accelerate(model)  # inference decodes with the engine's fast paths
    model.to(device or torch.device("cpu")).eval()
    return LoadedRun(cfg, tok, model, classes, weights)
