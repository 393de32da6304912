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

Conversations (``documents: chat``, with ``model.init_from``): a JSONL file of chats, one a row of a batch (cut
to ``block_size + 1`` tokens), laid out by the run's chat template (``data.chat_template``, else its base's) and
scored on the assistant's tokens only (:mod:`attnkit.inference.conversations`); validation is their loss on
the held-out conversations (:class:`ConversationTask`).

LoRA (``model.lora``, with ``model.init_from``): the base's weights frozen, low-rank adapters beside them
(:mod:`attnkit.lora`); the run records which weights file it adapts (:mod:`attnkit.runs.adapters`) and its
checkpoints hold the adapters only (:func:`attnkit.training.trainer.checkpoint_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from ..common.errors import UserError
from ..config.schema import RunConfig
from ..data.batching import Batches, EpochBatches, FilterStats
from ..data.chat_template import ChatTemplate
from ..data.documents import document_settings
from ..data.prepare import Encoded, flat
from ..data.readers import ReadStats, read_text
from ..data.tokenizer import EOS_ID, PAD_ID, TOKENIZER_FILE, Tokenizer, save_characters
from ..engine import FusedLMLoss
from ..inference.attention_maps import lm_maps
from ..inference.conversations import (
    conversation_messages,
    encode_conversation,
    read_conversations,
    score_conversations,
)
from ..inference.language_model import LMScore, document_stream, score_stream, scored_characters
from ..lm import LanguageModel
from ..lora import apply_lora
from ..positions import ADDITIVE_POSITIONS
from ..runs.adapters import record_base
from .base import BaseRecipe, EpochTask, TaskSpec
from .init_from import base_chat, copy_pretrained_tokenizer, load_pretrained_body, pretrained_run
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


def record_lora_base(cfg: RunConfig, run_dir: Path) -> None:
    """An adapted run's base weights file (``model.lora``), recorded in ``run_dir`` before anything trains, or checked
    against the record when the run resumes (:func:`attnkit.runs.adapters.record_base`)."""
    if cfg.model.lora is not None and cfg.model.init_from:
        record_base(run_dir, pretrained_run(cfg.model.init_from, "lm")[1])


@dataclass
class LMBatch:
    """Blocks of the stream (or conversations): ``inputs`` predict ``targets``, the same tokens one position later,
    at every position or at those ``scored`` marks (the assistant's tokens)."""

    inputs: Tensor  # (B, T)
    targets: Tensor  # (B, T)
    n_targets: int  # B * T, or the scored positions
    scored: Tensor | None = None  # (B, T) bool


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
        record_lora_base(cfg, run_dir)
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
        """The language model, starting from the weights of the run ``model.init_from`` names, if any, with LoRA
        adapters beside them (``model.lora``)."""
        model = build_language_model(self.cfg, self.tok)
        if self.cfg.model.init_from:
            load_pretrained_body(model, self.cfg)
        if self.cfg.model.lora is not None:
            apply_lora(model, self.cfg.model.lora)
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
        return objective(batch.inputs, batch.targets, label_smoothing, batch.scored)

    def validate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Loss, perplexity and bits per character of the validation text; score = -loss."""
        s: LMScore = score_stream(model, self.valid_ids, self.block, self.cfg.train.max_tokens, self.valid_characters,
                                 device)
        return {"valid_loss": s.loss, "valid_ppl": s.perplexity, "valid_bpc": s.bits_per_character,
                "score": -s.loss}


@dataclass
class ChatRecipe(BaseRecipe):
    """What ``prepare`` makes of ``documents: chat``: each training conversation's ids (side ``text``) and, per token,
    1 where it is the assistant's (side ``scored``), laid out by the chat template (:attr:`template`: the config's,
    else its base's, with the base tokenizer's special pieces)."""

    sides: ClassVar[tuple[str, ...]] = ("text", "scored")
    template: str = ""
    specials: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.template, self.specials = base_chat(self.cfg)
        if not self.template:
            raise UserError("data.documents: chat lays conversations out with a chat template: set "
                            "data.chat_template, or start from a run that has one (model.init_from)")

    def sources(self) -> list[str]:
        return [self.cfg.data.train]

    def settings(self) -> dict:
        return {"documents": "chat", "chat_template": self.template, "specials": self.specials,
                "block_size": self.cfg.data.block_size, **document_settings(self.cfg.data)}

    def examples(self, stats: ReadStats | None = None, log: Callable[[str], None] | None = None
                 ) -> Iterator[tuple[str, str]]:
        """``(line, file:line)`` of each training conversation (the held-out ones left out)."""
        d = self.cfg.data
        return ((line, where) for where, line in read_conversations(d.train, held_out=False, fraction=d.valid_fraction,
                                                                     seed=d.valid_seed, stats=stats))

    def tokenizer_texts(self) -> tuple[Iterator[str], None]:
        raise ValueError("a chat recipe trains no tokenizer: it takes model.init_from's")

    def given_tokenizer(self, run_dir: Path, log: Callable[[str], None]) -> Tokenizer | None:
        return copy_pretrained_tokenizer(self.cfg, run_dir, log)

    def encode(self, tok: Tokenizer, chunk: list[tuple[str, str]], dtype: str) -> Encoded:
        conversations = encode_lines(self, tok, chunk)
        return Encoded([flat([c.ids for c in conversations], dtype), flat([c.scored for c in conversations], dtype)])

    def finish(self, n: int, filtered: FilterStats, stats: ReadStats, log: Callable[[str], None]) -> dict:
        if n == 0:
            raise UserError(f"{self.cfg.data.train}: no conversation to train on")
        return {}


def encode_lines(recipe: ChatRecipe, tok: Tokenizer, lines: list[tuple[str, str]]) -> list:
    """``(line, file:line)`` pairs of a JSONL file as :class:`~attnkit.inference.conversations.Conversation` s, cut
    to ``block_size + 1`` tokens."""
    template = ChatTemplate(recipe.template, "data.chat_template", recipe.specials)
    return [encode_conversation(template, tok, conversation_messages(line, where), where,
                                recipe.cfg.data.block_size + 1) for line, where in lines]


class ConversationTask(LanguageModelTask):
    """The language model and objective of :class:`LanguageModelTask` on conversations (``documents: chat``): one a
    row, right-padded (the look-ahead mask keeps the padding out of every real position), batched by length up to
    ``train.max_tokens``, scored on the assistant's tokens; validated on the held-out conversations' loss."""

    def __init__(self, cfg: RunConfig, run_dir: Path, log=print, *, resume: bool = False) -> None:
        self.cfg = cfg
        record_lora_base(cfg, run_dir)
        self.recipe = ChatRecipe(cfg)
        data = self.prepare(self.recipe, run_dir, log, resume)
        self.text, self.scored = data.sides["text"], data.sides["scored"]
        self._batches = EpochBatches(cfg, np.asarray(self.text.lengths))
        d = cfg.data
        held = read_conversations(d.valid, stats=ReadStats()) if d.valid else \
            read_conversations(d.train, held_out=True, fraction=d.valid_fraction, seed=d.valid_seed)
        self.valid = encode_lines(self.recipe, self.tok, [(line, where) for where, line in held])
        if not self.valid:
            raise UserError(f"{d.valid or d.train}: no validation conversation; set data.valid_fraction (e.g. 0.1) "
                            f"or data.valid")
        log(f"conversations: {len(self.text)} to train on ({int(self.scored.ids.sum())} assistant tokens), "
            f"{len(self.valid)} to validate on")

    def batches(self, epoch: int) -> Batches:
        return self._batches(epoch)

    def collate(self, indices: list[int], device: torch.device) -> LMBatch:
        multiple = self.cfg.train.pad_multiple
        ids = self.text.pad(indices, PAD_ID, multiple).to(device)  # (B, T + 1)
        scored = self.scored.pad(indices, 0, multiple).bool().to(device)[:, 1:]  # (B, T): token t + 1 is scored
        return LMBatch(ids[:, :-1], ids[:, 1:], int(scored.sum()), scored)

    def validate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """The loss and perplexity of the held-out conversations' assistant tokens; score = -loss."""
        s = score_conversations(model, self.valid, self.cfg.train.max_tokens, device)
        return {"valid_loss": s.loss, "valid_ppl": s.perplexity, "score": -s.loss}


def make_task(cfg: RunConfig, run_dir: Path, log=print, *, resume: bool = False) -> LanguageModelTask:
    """The task of a ``task: lm`` config: blocks of text, or conversations (``documents: chat``)."""
    kind = ConversationTask if cfg.data.documents == "chat" else LanguageModelTask
    return kind(cfg, run_dir, log, resume=resume)


def recipe(cfg: RunConfig) -> BaseRecipe:
    """The data recipe of a ``task: lm`` config."""
    return ChatRecipe(cfg) if cfg.data.documents == "chat" else LMRecipe(cfg)


def check(cfg: RunConfig) -> None:
    """A language model is a Transformer whose table of positions (if any) covers ``block_size``, and whose chat
    template, if it has one, parses (``model.init_from``, a ``task: lm`` run to train on, is checked by
    :func:`attnkit.tasks.init_from.check_init_from`). LoRA and conversations fine-tune a run: they need
    ``model.init_from``."""
    if cfg.model.arch != "transformer":
        raise UserError("task lm needs model.arch: transformer")
    if cfg.data.chat_template:
        ChatTemplate(cfg.data.chat_template, "data.chat_template")
    t = cfg.model.transformer
    if t.positions in ADDITIVE_POSITIONS and cfg.data.block_size > t.max_len:
        raise UserError(f"data.block_size={cfg.data.block_size} exceeds model.transformer.max_len={t.max_len} "
                        f"({t.positions} positions); raise the latter or lower the former")
    lora = cfg.model.lora
    if lora is not None and not cfg.model.init_from:
        raise UserError("model.lora adapts the weights of another run: set model.init_from (a task: lm run, trained "
                        "here or imported with `attnkit import`)")
    if lora is not None and "w3" in lora.targets and t.activation != "swiglu":
        raise UserError(f"model.lora.targets: w3 is the gated FFN's up projection (activation: swiglu); this model's "
                        f"activation is {t.activation}: adapt w1 and w2")
    if cfg.data.documents == "chat" and not cfg.model.init_from:
        raise UserError("data.documents: chat fine-tunes a run on conversations: set model.init_from (its tokenizer "
                        "reads them)")


SPEC = TaskSpec("lm", make_task, recipe, serves="generate", check=check, build_model=build_language_model,
                hint="use `attnkit generate`", attention_maps=lm_maps, exporters=("ctranslate2", "huggingface"))
