"""``task: lm``: a decoder-only language model (:class:`attnkit.lm.LanguageModel`) trained on plain text.

    attnkit train configs/shakespeare-char.yaml --run-dir runs/shakespeare     # characters, tiny Shakespeare
    attnkit train configs/imdb-lm.yaml --run-dir runs/imdb-lm                  # subwords, IMDB's 75k reviews

Data (``data:``): the documents of ``train`` and ``extra_text``, read as ``documents: text`` (a file is one
document of raw text) or ``documents: lines`` (one per line, or the text column of a ``.tsv`` / ``.csv``),
tokenized by characters (``tokenizer.model_type: characters``) or SentencePiece, and prepared like every task's
(:mod:`attnkit.data.prepare`): each document's ids followed by ``</s>``, stored flat and memory-mapped, so the
prepared ``text.ids.npy`` *is* the packed stream. Validation text is ``data.valid``, or held out of the training
files: with ``documents: text`` the last ``valid_fraction`` of the first file (nanoGPT's split, so the
validation text is contiguous), with ``documents: lines`` held-out rows as pretraining holds them out.

Batches: an epoch cuts the stream into blocks of ``block_size + 1`` tokens that overlap by one (the input is
the first ``block_size``, the target the last ``block_size``: every position predicts the next token), starting
at an offset drawn per epoch, in a seeded order; ``max_tokens // block_size`` blocks per batch. Every batch is
the same shape, and an epoch sees every token once.

Validation: :func:`attnkit.inference.language_model.score_stream` over the held-out text: the mean cross-entropy
of every token in non-overlapping windows of ``block_size``, its perplexity and bits per character; the score
(higher is better for the trainer) is minus the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ..common.errors import UserError
from ..config.schema import RunConfig
from ..data.batching import Batches, FilterStats
from ..data.chat_template import ChatTemplate
from ..data.documents import document_settings
from ..data.prepare import Encoded, flat
from ..data.readers import ReadStats, read_text
from ..data.tokenizer import EOS_ID, TOKENIZER_FILE, Tokenizer, save_characters
from ..engine import FusedLMLoss
from ..inference.attention_maps import lm_maps
from ..inference.language_model import LMScore, document_stream, score_stream, scored_characters
from ..lm import LanguageModel
from ..positions import ADDITIVE_POSITIONS
from .base import BaseRecipe, EpochTask, TaskSpec
from .init_from import copy_pretrained_tokenizer, load_pretrained_body
from .objectives import LanguageModelLoss
from .pretraining import pretraining_texts


def lm_documents(cfg: RunConfig, *, held_out: bool = False, stats: ReadStats | None = None,
                 log: Callable[[str], None] | None = None) -> Iterator[str]:
    """The training documents (or, ``held_out``, the validation documents) of a language-model config."""
    d = cfg.data
    if held_out and d.valid:
        yield from ([read_text(d.valid)] if d.documents == "text" else pretraining_texts(cfg, [d.valid]))
        return
    paths = [d.train, *d.extra_text]
    if d.documents == "lines":
        yield from pretraining_texts(cfg, paths, held_out=held_out, stats=stats, log=log)
        return
    first = read_text(paths[0])
    cut = int(len(first) * (1.0 - d.valid_fraction))  # nanoGPT: data[:int(n * 0.9)], data[int(n * 0.9):]
    if held_out:
        yield first[cut:]
        return
    yield first[:cut]
    for path in paths[1:]:
        yield read_text(path)


@dataclass
class LMRecipe(BaseRecipe):
    """What ``prepare`` makes of a language-model config: each training document's ids, then ``</s>``."""

    def sources(self) -> list[str]:
        return [self.cfg.data.train, *self.cfg.data.extra_text]

    def settings(self) -> dict:
        return {**document_settings(self.cfg.data), "documents": self.cfg.data.documents}

    def examples(self, stats: ReadStats | None = None, log: Callable[[str], None] | None = None
                 ) -> Iterator[tuple[str, str]]:
        return ((text, "") for text in lm_documents(self.cfg, stats=stats, log=log))

    def tokenizer_texts(self) -> tuple[Iterator[str], None]:
        """What SentencePiece learns from: the documents' lines (it reads one sentence per line)."""
        return (line for text, _ in self.examples() for line in text.splitlines() if line.strip()), None

    def given_tokenizer(self, run_dir: Path, log: Callable[[str], None]) -> Tokenizer | None:
        """The tokenizer of the run ``model.init_from`` names; else, for ``model_type: characters``, the training
        text's characters (written only when they changed)."""
        if self.cfg.model.init_from:
            return copy_pretrained_tokenizer(self.cfg, run_dir, log)
        if self.cfg.data.tokenizer.model_type != "characters":
            return None
        seen: set[str] = set()
        for text, _ in self.examples():  # streamed: the corpus is never held whole
            seen.update(text)
        characters = sorted(seen)
        if (run_dir / TOKENIZER_FILE).exists():
            tok = Tokenizer.load(run_dir)
            if tok.kind == "characters" and tok.src_pieces_from_ids(range(4, tok.src_vocab_size)) == characters:
                return tok
        tok = save_characters(run_dir, characters, where=", ".join(self.sources()))
        log(f"the tokenizer: {tok.src_vocab_size - 4} characters of the training text, each its own id")
        return tok

    def encode(self, tok: Tokenizer, chunk: list[tuple[str, str]], dtype: str) -> Encoded:
        ids = tok.encode_src([text for text, _ in chunk], threads=1)
        return Encoded([flat([x + [EOS_ID] for x in ids], dtype)])

    def finish(self, n: int, filtered: FilterStats, stats: ReadStats, log: Callable[[str], None]) -> dict:
        if n == 0:
            raise UserError(f"{', '.join(self.sources())}: no text to train a language model on")
        return {}


@dataclass
class LMBatch:
    """Blocks of the stream: ``inputs`` predict ``targets``, the same tokens one position later."""

    inputs: Tensor  # (B, T)
    targets: Tensor  # (B, T)
    n_targets: int  # B * T


def block_batches(n_tokens: int, block: int, per_batch: int, seed: int, epoch: int) -> Batches:
    """An epoch's batches of block start offsets: blocks of ``block + 1`` tokens every ``block`` tokens from an
    offset in ``[0, block)`` drawn for ``(seed, epoch)``, shuffled by the same generator, ``per_batch`` a batch."""
    rng = np.random.default_rng([seed, epoch])
    shift = int(rng.integers(block)) if n_tokens > 2 * block + 1 else 0
    starts = np.arange(shift, n_tokens - block, block, dtype=np.int64)  # a block needs tokens s .. s + block
    if not len(starts):
        raise UserError(f"the training text has {n_tokens} tokens, fewer than data.block_size + 1 = {block + 1}; "
                        f"lower data.block_size or give more text")
    order = rng.permutation(starts)
    bounds = np.arange(0, len(order), per_batch, dtype=np.int64)
    return Batches(order, bounds, np.minimum(bounds + per_batch, len(order)))


def build_language_model(cfg: RunConfig, tok: Tokenizer, classes: list[str] | None = None) -> nn.Module:
    """The decoder-only :class:`LanguageModel` over the tokenizer's vocabulary (its absent ids never output)."""
    return LanguageModel(cfg.model.transformer, tok.src_vocab_size, absent_ids=tok.absent_ids)


class LanguageModelTask(EpochTask):
    """Next-token prediction over packed blocks; validation loss, perplexity and bits per character."""

    name = "lm"
    rate_unit = "tok"  # what the loss is averaged over: every position predicts one token

    def __init__(self, cfg: RunConfig, run_dir: Path, log=print, *, resume: bool = False) -> None:
        self.cfg = cfg
        data = self.prepare(LMRecipe(cfg), run_dir, log, resume)
        self.stream = data.sides["text"].ids  # (N,) memory-mapped: every document's ids and its </s>
        self.block = cfg.data.block_size
        self.per_batch = max(cfg.train.max_tokens // self.block, 1)
        ids = document_stream(self.tok, list(lm_documents(cfg, held_out=True)))
        if len(ids) < 2:
            raise UserError(f"{cfg.data.valid or cfg.data.train}: no validation text; set data.valid_fraction "
                            f"(e.g. 0.1) or data.valid")
        if cfg.data.valid_blocks:  # a sample: the first blocks of the held-out text, so validating costs less
            ids = ids[: cfg.data.valid_blocks * self.block + 1]
        self.valid_ids = ids
        self.valid_characters = scored_characters(self.tok, ids)  # decoded once, for bits per character
        batches = self.batches(0)
        log(f"language-model data: {len(self.stream)} training tokens in {len(batches)} batches of {self.per_batch} "
            f"blocks of {self.block}; {len(self.valid_ids)} validation tokens"
            + (f" (the first {cfg.data.valid_blocks} blocks, data.valid_blocks)" if cfg.data.valid_blocks else ""))

    def build_model(self) -> nn.Module:
        """The language model, starting from the weights of the run ``model.init_from`` names, if any."""
        model = build_language_model(self.cfg, self.tok)
        if self.cfg.model.init_from:
            load_pretrained_body(model, self.cfg)
        return model

    def batches(self, epoch: int) -> Batches:
        return block_batches(len(self.stream), self.block, self.per_batch, self.cfg.train.seed, epoch)

    def objective(self, model: nn.Module) -> nn.Module:
        """The reference loss, or the engine's fused one (``train.engine``); the same value."""
        return FusedLMLoss(model) if self.cfg.train.engine != "reference" else LanguageModelLoss(model)

    def collate(self, indices: list[int], device: torch.device) -> LMBatch:
        blocks = np.stack([self.stream[s: s + self.block + 1] for s in indices]).astype(np.int64)  # (B, T + 1)
        x = torch.from_numpy(blocks)
        # to a GPU: pinned, one asynchronous copy, so the host queues on without waiting for the GPU
        x = x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x.to(device)
        return LMBatch(x[:, :-1], x[:, 1:], x.size(0) * self.block)

    def loss(self, objective: nn.Module, batch: LMBatch, label_smoothing: float) -> Tensor:
        return objective(batch.inputs, batch.targets, label_smoothing)

    def validate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Loss, perplexity and bits per character of the validation text; score = -loss."""
        s: LMScore = score_stream(model, self.valid_ids, self.block, self.cfg.train.max_tokens, self.valid_characters,
                                 device)
        return {"valid_loss": s.loss, "valid_ppl": s.perplexity, "valid_bpc": s.bits_per_character,
                "score": -s.loss}


def check(cfg: RunConfig) -> None:
    """A language model is a Transformer whose table of positions (if any) covers ``block_size``, and whose chat
    template, if it has one, parses (``model.init_from``, a ``task: lm`` run to train on, is checked by
    :func:`attnkit.tasks.init_from.check_init_from`)."""
    if cfg.model.arch != "transformer":
        raise UserError("task lm needs model.arch: transformer")
    if cfg.data.chat_template:
        ChatTemplate(cfg.data.chat_template, "data.chat_template")
    t = cfg.model.transformer
    if t.positions in ADDITIVE_POSITIONS and cfg.data.block_size > t.max_len:
        raise UserError(f"data.block_size={cfg.data.block_size} exceeds model.transformer.max_len={t.max_len} "
                        f"({t.positions} positions); raise the latter or lower the former")


SPEC = TaskSpec("lm", LanguageModelTask, LMRecipe, serves="generate", check=check, build_model=build_language_model,
                hint="use `attnkit generate`", attention_maps=lm_maps, exporters=("ctranslate2", "huggingface"))
