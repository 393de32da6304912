"""Sampling from a language model: the seeds' soft attention over the vocabulary (SEEDS.md section 3).

A language model's next-token logits ``z`` ``(V,)`` are scores of every token; choosing the next token is the
seeds' normalize step with an inverse temperature ``beta = 1 / T``::

    p = softmax(beta * z)                      # soft: sample y ~ p          (temperature T = 1 / beta)
    y = onehot(argmax(z))                      # hard: greedy decoding       (T -> 0, beta -> infinity)

and two ways to keep the sample off the long tail, applied to ``z`` before the softmax:

* **top-k** (Fan et al. 2018): only the ``k`` largest logits keep their value, the rest get probability 0;
* **top-p**, nucleus sampling (Holtzman et al. 2020): only the smallest set of most likely tokens whose
  probabilities add up to at least ``p`` (the most likely token always stays).

:func:`generate` feeds a prompt, then each chosen token, through the model's single-step interface
(:meth:`attnkit.lm.LanguageModel.step`, with its key/value cache) and yields the tokens as they come. Special
pieces other than ``</s>`` are never chosen; a row that chooses ``</s>`` (the end of a document) stops.
Random numbers come from the ``torch.Generator`` passed in, so a seed gives the same text every time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
from torch import Tensor

from .vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID

#: Never chosen: they carry no text (``</s>`` may be chosen: it ends the document).
NEVER_SAMPLED = (PAD_ID, UNK_ID, BOS_ID)


class StepModel(Protocol):
    """What :func:`generate` needs of a model (:class:`attnkit.lm.LanguageModel` has it)."""

    def parameters(self) -> Iterator[Tensor]: ...
    def init_state(self): ...
    def step(self, tokens: Tensor, state) -> tuple[Tensor, object]: ...


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """``logits`` ``(B, V)`` with every token outside the top ``k`` and outside the nucleus ``p`` set to ``-inf``
    (``top_k = 0`` and ``top_p = 1`` keep all)."""
    if top_k and top_k < logits.size(-1):
        top = torch.topk(logits, top_k, dim=-1).indices  # (B, k): exactly k, ties broken by topk
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, top, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each
        drop_sorted = before >= top_p  # already reached p without this one
        drop_sorted[..., 0] = False  # the most likely token stays, however small p (1e-46 is 0 in float32)
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


#: float32's smallest normal number and its largest: a positive Python float outside them would round to a
#: subnormal, 0 or inf in float32 (a temperature of 0 or inf gives NaN probabilities).
FLOAT32_RANGE = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)


def in_float32(x: float) -> float:
    """A positive ``x`` (a temperature, a top-p) as float32 holds it: clamped to :data:`FLOAT32_RANGE`."""
    return min(max(x, FLOAT32_RANGE[0]), FLOAT32_RANGE[1])


def tempered(logits: Tensor, temperature: float) -> Tensor:
    """``(z - max z) / T`` for logits ``z`` ``(B, V)``: what :func:`choose_next` takes the softmax of
    (``softmax(z / T)`` equals ``softmax((z - max z) / T)``), defined for every finite ``T > 0``.

    After the shift every finite logit is ``<= 0`` and the largest is 0, so the quotient is never NaN: ``-inf``
    stays ``-inf``, a quotient beyond float32's range becomes ``-inf`` (probability 0). ``T`` is clamped to
    :data:`FLOAT32_RANGE` (:func:`in_float32`): below 1.2e-38 it samples as 1.2e-38 does, all the probability on
    the largest logit (ties drawn evenly) unless another lies within about 1e-36 of it; above 3.4e38 as 3.4e38
    does, evenly over the tokens kept (logits differ by far less than 3.4e38).
    """
    return (logits - logits.amax(dim=-1, keepdim=True)) / in_float32(temperature)  # (B, V)


@functools.cache
def never_sampled(device: torch.device) -> Tensor:
    """:data:`NEVER_SAMPLED` as a tensor on ``device`` (made once: it is read at every step; an ordinary tensor,
    usable inside and outside inference mode)."""
    with torch.inference_mode(False):
        return torch.tensor(NEVER_SAMPLED, device=device)


def choose_next(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None, never: Tensor | None = None) -> Tensor:
    """The next token of every row, ``(B,)``, from logits ``(B, V)``: ``argmax`` at ``temperature == 0`` (hard
    attention), else a sample of ``softmax(filter_logits(z) / temperature)`` (soft attention, ``beta = 1 / T``),
    well defined for every finite temperature (:func:`tempered`) and every ``top_p`` in (0, 1].
    ``never``: :data:`NEVER_SAMPLED` as a tensor on the logits' device (default: :func:`never_sampled`'s)."""
    never = never_sampled(logits.device) if never is None else never
    logits = logits.float().index_fill(-1, never, float("-inf"))  # a copy: the caller's stay
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(tempered(filter_logits(logits, top_k, top_p), temperature), dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@torch.inference_mode()
def generate(model: StepModel, prompt: Sequence[Sequence[int]] | Tensor, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             generator: torch.Generator | None = None, ignore_eos: bool = False,
             choose: Callable[..., Tensor] = choose_next) -> Iterator[Tensor]:
    """Continue each prompt row; yields the tokens chosen at each step ``(B,)`` (``PAD_ID`` for a row that ended).

    :param prompt: ``(B, T)`` token ids, every row the same length (``T >= 1``).
    :param max_new_tokens: the most steps; stops earlier once every row has chosen ``</s>``.
    :param ignore_eos: no row ends at ``</s>``: exactly ``max_new_tokens`` steps (for speed measurements).
    :param choose: how the next token is chosen from the logits, :func:`choose_next` or the same choice made
        elsewhere (a compiled step that makes the greedy choice itself).
    """
    tokens = torch.as_tensor(prompt, dtype=torch.long)
    device = next(model.parameters()).device  # type: ignore[attr-defined]
    tokens = tokens.to(device)
    logits, state = model.step(tokens, model.init_state())  # the whole prompt at once: (B, V)
    done = torch.zeros(tokens.size(0), dtype=torch.bool, device=device)
    for i in range(max_new_tokens):
        nxt = choose(logits, temperature, top_k, top_p, generator)  # (B,)
        if not ignore_eos:
            nxt = nxt.masked_fill(done, PAD_ID)
            done |= nxt == EOS_ID
        yield nxt
        if i == max_new_tokens - 1 or (not ignore_eos and bool(done.all())):
            return
        logits, state = model.step(nxt[:, None], state)
