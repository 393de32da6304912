"""Using a trained language model: score a text (loss, perplexity, bits per character) and generate text.

Scoring (:func:`score_stream`; the ``lm`` task's validation and ``attnkit evaluate RUN --data FILE``): the text's
token ids are cut into non-overlapping windows of ``context`` tokens (the training block size unless
``--context`` says otherwise); in each window every token is predicted from the tokens before it in that
window, and the first token of each window from the last token of the window before. So every token but the
very first is scored exactly once::

    loss = (1 / N) sum_t -ln p(y_t | y_{t-c}..y_{t-1})          (nats per token, c < context)
    perplexity = exp(loss);   bits per character = N * loss / (ln 2 * characters scored)

The characters scored are those of the text the tokenizer decodes the scored tokens to
(:func:`scored_characters`): each document decoded whole, one character for each ``</s>`` between documents, less
what the first token alone decodes to. A character spelt over several tokens (a byte-level BPE's or a byte
fallback's ``é``, an emoji) counts once, and an unknown piece counts what the tokenizer writes for it.

Generation (:func:`continue_text`): the prompt's ids through :func:`attnkit.sampling.generate`, decoded as
the tokens come so the text can be streamed, stopped at ``</s>`` (or another id the caller names: an instruct
model's end of turn), a ``--stop`` string, or the token budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..common.errors import UserError
from ..config.schema import LineBreakTags
from ..data.documents import clean_text
from ..data.labelled import LabelledReader
from ..data.readers import base_suffix, read_lines, read_text
from ..data.tokenizer import EOS_ID, UNK_ID, Tokenizer
from ..runs.load import LoadedRun
from ..sampling import StepModel, choose_next, generate

#: The most tokens one prompt may ask for (``--max-new-tokens``, the server's ``max_new_tokens``).
MAX_NEW_TOKENS = 4096


@dataclass
class LMScore:
    """How well a model predicts a text."""

    loss: float  # mean cross-entropy per token, in nats
    tokens: int  # tokens scored
    characters: int  # characters those tokens spell (:func:`scored_characters`)

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))

    @property
    def bits_per_character(self) -> float:
        return self.loss * self.tokens / (math.log(2) * max(self.characters, 1))

    def __str__(self) -> str:
        return (f"loss {self.loss:.4f} nats/token | perplexity {self.perplexity:.3f} | bits/char "
                f"{self.bits_per_character:.4f} | {self.tokens} tokens, {self.characters} characters")


def stream_characters(tok: Tokenizer, ids: Sequence[int] | np.ndarray) -> int:
    """How many characters a stream of documents joined by ``</s>`` (:func:`document_stream`) spells: each
    document's ids decoded together (a character may take several tokens; a decoder may drop the space before a
    document's first word), and one character for each ``</s>`` (the line break between documents)."""
    ids = np.asarray(ids, dtype=np.int64)
    ends = np.flatnonzero(ids == EOS_ID)  # (D - 1,)
    documents = np.split(ids, ends)  # each one after the first begins with its </s>
    texts = tok.decode_src([doc[1:] if k else doc for k, doc in enumerate(documents)])
    return sum(map(len, texts)) + len(ends)


def scored_characters(tok: Tokenizer, ids: Sequence[int] | np.ndarray) -> int:
    """The characters of the tokens :func:`score_stream` scores (every one but the first): those of the whole
    stream less those of its first token alone (``<s>``: none; a piece of a character: that character)."""
    return max(stream_characters(tok, ids) - stream_characters(tok, ids[:1]), 0)


def document_stream(tok: Tokenizer, documents: Sequence[str]) -> np.ndarray:
    """The ids of ``documents`` joined by ``</s>``, as training packs them (no ``</s>`` after the last) -> ``(N,)``."""
    ids: list[int] = []
    for i, doc in enumerate(tok.encode_src(list(documents))):
        ids += ([EOS_ID] if i else []) + doc
    return np.asarray(ids, dtype=np.int64)


@torch.inference_mode()
def score_stream(model: nn.Module, ids: np.ndarray, context: int, max_tokens: int, characters: int,
                 device: torch.device | None = None) -> LMScore:
    """Score every token of ``ids`` ``(N,)`` after the first in windows of ``context`` (module docstring).

    :param max_tokens: tokens per forward pass (windows are batched).
    :param characters: the characters those tokens spell, :func:`scored_characters` (for bits per character).
    """
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    starts = list(range(0, len(ids) - 1, context))  # window w predicts ids[s + 1 : s + context + 1]
    per_batch = max(max_tokens // context, 1)
    total, n = 0.0, 0
    for b in range(0, len(starts), per_batch):
        group = starts[b: b + per_batch]
        lengths = [min(context, len(ids) - 1 - s) for s in group]
        T = max(lengths)
        inputs = torch.zeros(len(group), T, dtype=torch.long)
        targets = torch.full((len(group), T), -100, dtype=torch.long)  # -100: not scored (the last window's tail)
        for r, (s, L) in enumerate(zip(group, lengths, strict=True)):
            inputs[r, :L] = torch.from_numpy(ids[s: s + L])
            targets[r, :L] = torch.from_numpy(ids[s + 1: s + L + 1])
        logits = model(inputs.to(device)).float()  # (B, T, V)
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten().to(device),
                                                   ignore_index=-100, reduction="sum").item()
        n += sum(lengths)
    model.train(was_training)
    return LMScore(total / max(n, 1), n, characters)


def read_documents(path: str, documents: str, text_column: str | None = None,
                   line_break_tags: LineBreakTags = "newline") -> list[str]:
    """A text file's documents as a language-model run reads them: the whole file (``documents: text``), or one
    per line (``lines``; the text column of a ``.tsv`` / ``.csv``), its ``<br />`` tags read as configured."""
    if documents == "text":
        return [read_text(path)]
    if base_suffix(Path(path)) in (".tsv", ".csv"):
        texts = [text for text, _, _ in LabelledReader(path, text_column=text_column, labelled=False).keyed()]
    else:
        texts = [line for line in read_lines(path) if line.strip()]
    return [clean_text(text, line_break_tags) for text in texts]  # <br /> as training read it


def score_text_file(run: LoadedRun, path: str, context: int | None = None) -> LMScore:
    """:func:`score_stream` of a text file, read as the run's training data was (``data.documents``), in windows
    of ``context`` tokens (default: the run's ``data.block_size``)."""
    d = run.cfg.data
    context = context or d.block_size
    limit = run.model.context
    if limit is not None and context > limit:
        raise UserError(f"--context {context} exceeds the model's {limit} positions (a table of that length)")
    ids = document_stream(run.tok, read_documents(path, d.documents, d.text_column, d.line_break_tags))
    if len(ids) < 2:
        raise UserError(f"{path}: fewer than two tokens of text to score")
    return score_stream(run.model, ids, context, run.cfg.train.max_tokens, scored_characters(run.tok, ids))


#: Tokens a continuation gets when its length is not given (``attnkit generate``, ``/generate``), at most what fits.
DEFAULT_NEW_TOKENS = 256


@dataclass(frozen=True)
class ContextLimit:
    """How many positions a language model reads, a prompt and its continuation together.

    ``fixed``: its positions are a table of ``length`` rows (learned, sinusoidal), and nothing past it can be read.
    Otherwise (RoPE, ALiBi, no positions) ``length`` is the context it was trained on: it reads further, but what it
    predicts there is worse and worse (RoPE's rotations past the trained length were never seen), so going past it
    is done only on request (``--beyond-context``; ``"beyond_context": true`` in a request).
    """

    length: int
    fixed: bool

    def describe(self) -> str:
        return (f"the model's {self.length} positions (its positions are a table of that length)" if self.fixed else
                f"the {self.length} positions the model was trained on")


def context_limit(run: LoadedRun) -> ContextLimit:
    """A language-model run's :class:`ContextLimit`: its table's ``max_len``; else the trained context: an imported
    model's ``max_len`` (``max_position_embeddings``), a model trained here its ``data.block_size``."""
    model = run.model
    if model.context is not None:
        return ContextLimit(model.context, fixed=True)
    trained = run.cfg.model.transformer.max_len if run.cfg.data.imported_from else run.cfg.data.block_size
    return ContextLimit(trained, fixed=False)


def prompt_ids(tok: Tokenizer, prompt: str, limit: ContextLimit | None, max_new_tokens: int | None = None, *,
               beyond_context: bool = False, default: int = DEFAULT_NEW_TOKENS) -> tuple[list[int], int]:
    """The prompt's ids, checked, and the tokens to generate after it (:func:`new_tokens`).

    Checked: the prompt has some ids, every character is in a character vocabulary, and prompt plus continuation
    fit ``limit``.

    :raises UserError: what is wrong, with the numbers.
    """
    if max_new_tokens is not None and not 0 < max_new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"--max-new-tokens must be in 1..{MAX_NEW_TOKENS}, got {max_new_tokens}")
    ids = tok.encode_src([prompt])[0]
    if not ids:
        raise UserError("the prompt is empty: give some text to continue")
    check_characters(tok, prompt, ids, "the prompt")
    return ids, new_tokens(len(ids), limit, max_new_tokens, beyond_context=beyond_context, default=default)


def new_tokens(length: int, limit: ContextLimit | None, max_new_tokens: int | None = None, *,
               beyond_context: bool = False, default: int = DEFAULT_NEW_TOKENS, what: str = "the prompt") -> int:
    """The tokens to generate after ``what`` (a prompt of ``length`` ids): ``max_new_tokens``, checked to fit with it
    in ``limit`` (None: any length; past a trained context only with ``beyond_context``); None takes ``default``,
    at most what fits after the prompt: a default never asks for more than the model reads.

    :raises UserError: they do not fit, with the numbers.
    """
    if limit is None or (beyond_context and not limit.fixed):
        return default if max_new_tokens is None else max_new_tokens
    room = limit.length - length
    way = "" if limit.fixed else "; or pass --beyond-context to read past it"
    if room < 1:
        raise UserError(f"{what} ({length} tokens) leaves no room in {limit.describe()}; shorten {what}"
                        f"{way}")
    if max_new_tokens is None:
        return min(default, room)
    if max_new_tokens > room:
        raise UserError(f"{what} ({length} tokens) and --max-new-tokens {max_new_tokens} exceed "
                        f"{limit.describe()}; ask for at most {room} tokens or shorten {what}{way}")
    return max_new_tokens


def check_characters(tok: Tokenizer, text: str, ids: list[int], what: str) -> None:
    """:raises UserError: a character-level tokenizer met a character of ``text`` (``ids``) outside its vocabulary,
    which the model would read as ``<unk>``; ``what`` names the text."""
    if tok.kind == "characters" and UNK_ID in ids:
        bad = text[ids.index(UNK_ID)]
        raise UserError(f"{what} has the character {bad!r}, which is not in this model's vocabulary of "
                        f"{tok.src_vocab_size - 4} characters")


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """:raises UserError: a temperature below 0, a negative top-k, or a top-p outside (0, 1]."""
    if not temperature >= 0 or math.isinf(temperature):
        raise UserError(f"--temperature must be a finite number >= 0 (0 means greedy), got {temperature}")
    if top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0 keeps every token), got {top_k}")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {top_p}")


class TextStream:
    """A continuation's text as its tokens come (not ``</s>``): :meth:`add` returns what can be shown now, and
    :meth:`flush` the rest at the end; ``stopped`` once a ``stop`` string appeared (the text ends before it).

    The pieces add up to :attr:`text`. Held back for now:

    * the last ``len(longest stop) - 1`` characters, which may begin a stop string;
    * an incomplete character: a byte-level tokenizer (GPT-2's BPE, Llama's byte fallback) may spell one
      character over several tokens, and decodes the first ones as U+FFFD.

    The text is decoded after ``context`` (the prompt's last tokens), as the prompt's continuation: a
    tokenizer that strips the space before a text's first word (Llama's) keeps the one after the prompt.
    Decoding starts from an anchor that moves past the text already settled, so a step costs the same
    however long the text has grown.
    """

    #: tokens decoded before the anchor, for their spacing (more than one: a character may span two)
    CONTEXT = 4
    #: the anchor moves once this many tokens follow it
    SPAN = 32

    def __init__(self, tok: Tokenizer, stop: Sequence[str] = (), context: Sequence[int] = ()) -> None:
        self.tok, self.stop = tok, tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # what was shown so far
        self.stopped = False
        self._hold = max((len(s) for s in self.stop), default=1) - 1  # characters kept back
        self._anchor, self._settled = 0, ""  # ids[:anchor] decode to settled
        self._set_context(list(context)[-self.CONTEXT:])

    def _set_context(self, context: list[int]) -> None:
        """The tokens before the anchor, and their text (decoded once per anchor, not at every token)."""
        self._context = context
        self._before = self.tok.decode_src([context])[0] if context else ""

    def _decoded(self) -> str:
        """The whole continuation's text so far."""
        before = self._before
        after = self.tok.decode_src([self._context + self.ids[self._anchor:]])[0]
        tail = after[len(before):] if after.startswith(before) else after  # the text of ids[anchor:]
        text = self._settled + tail
        if len(self.ids) - self._anchor >= self.SPAN and not tail.endswith("\ufffd"):
            self._settled, self._anchor = text, len(self.ids)  # settle: later steps decode from here
            self._set_context(self.ids[-self.CONTEXT:])
        return text

    def add(self, token: int) -> str:
        """Take ``token`` -> the text it lets show (maybe ``""``)."""
        if self.stopped:
            raise ValueError("the text already ended at a stop string")
        self.ids.append(token)
        text = self._decoded()
        cut = min((i for i in (text.find(s, len(self.text)) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._show(text, cut) if cut > len(self.text) else ""
        if text.endswith("\ufffd"):  # an incomplete character: its next token completes it
            return ""
        safe = len(text) - self._hold
        return self._show(text, safe) if safe > len(self.text) and text.startswith(self.text) else ""

    def flush(self) -> str:
        """The text held back, at the end (none after a stop string; an incomplete last character as U+FFFD)."""
        if self.stopped or not self.ids:
            return ""
        text = self._decoded()
        return self._show(text, len(text)) if text.startswith(self.text) and len(text) > len(self.text) else ""

    def pieces(self, tokens: Iterable[int]) -> Iterator[str]:
        """Each of ``tokens`` taken (:meth:`add`), what it lets show yielded, until a stop string; then the text held
        back (:meth:`flush`). A generator of tokens is read only as far as the text goes."""
        for token in tokens:
            if piece := self.add(token):
                yield piece
            if self.stopped:
                return
        if piece := self.flush():
            yield piece

    def _show(self, text: str, end: int) -> str:
        piece, self.text = text[len(self.text): end], text[:end]
        return piece


def continue_text(model: StepModel, tok: Tokenizer, ids: list[int], max_new_tokens: int, *,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, stop: Sequence[str] = (),
                  stop_ids: Collection[int] = (), generator: torch.Generator | None = None,
                  choose: Callable[..., torch.Tensor] = choose_next) -> Iterator[str]:
    """The continuation of one prompt, yielded as text pieces as it is generated (concatenated: the whole text).

    Ends at ``</s>`` or another of ``stop_ids`` (an instruct model's end of turn), after ``max_new_tokens``, or at
    the first ``stop`` string; the token or string it ends at is not yielded. ``choose``: how each token is chosen
    (:func:`attnkit.sampling.generate`'s).
    """
    tokens = (int(token[0]) for token in generate(model, [ids], max_new_tokens, temperature=temperature, top_k=top_k,
                                                  top_p=top_p, generator=generator, choose=choose))
    ended = takewhile(lambda t: t != EOS_ID and t not in stop_ids, tokens)
    yield from TextStream(tok, stop, context=ids).pieces(ended)
