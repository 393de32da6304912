"""Translating with a trained model: texts in, n-best translations out, in input order.

The sources are encoded with ``</s>``, cut to the model's positions (one warning each), sorted by
length into batches and decoded by :mod:`attnkit.search` (greedy, or beam search with a length
penalty); :func:`check_decode_options` rejects options no search can use. ``attnkit translate``,
``evaluate``, ``serve``, the trainer's validation BLEU and the CTranslate2 export (which decodes the
same way) all go through here.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from ..common.errors import UserError
from ..data.batching import pad_batch
from ..data.tokenizer import EOS_ID, PAD_ID, Tokenizer
from ..search import LENPEN, MAX_LEN_A, MAX_LEN_B, beam_search, greedy_search

log = logging.getLogger(__name__)


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

