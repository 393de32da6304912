"""Decoding: greedy and beam search over a model's single-step decoder interface.

The search knows nothing about tokenizers or model internals. It calls
``model.init_decoder(src)`` once, ``model.decode_step(prev, state)`` once per output
position, and keeps, reorders or drops batch rows with ``state.select(index)``. The RNN and
the Transformer decoders both implement this contract (:class:`StepDecoder`).

Conventions, shared by both searches:

* ``src`` is (B, S) long, right-padded with ``model.pad_id``; a sentence's real length is
  its number of non-pad tokens.
* A hypothesis emits at most ``max_len = floor(a * src_len + b)`` tokens, eos included
  (Vaswani et al. 2017, sec. 6.1: "maximum output length ... input length + 50"). A row
  that has emitted ``max_len`` tokens without eos is cut there and returned as is
  (``ended_with_eos=False``); its score then has no eos term.
* ``score`` is the sum of float32 log-softmax values of the emitted tokens, eos included.
* Length penalty (Wu et al. 2016, GNMT): ``lp(Y) = ((5 + |Y|) / 6) ** alpha`` and
  ``norm_score = score / lp(Y)``, with ``|Y|`` counting eos. GNMT's coverage penalty is
  not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class DecoderState(Protocol):
    """What a model carries between steps (encoder memory, source mask, RNN state, kv cache)."""

    def select(self, index: torch.Tensor) -> DecoderState:
        """Keep, reorder or repeat batch rows.

        :param index: shape (B',) long, rows of the current batch.
        :return: a state of batch size B'.
        """
        ...


class StepDecoder(Protocol):
    """A model that decodes one token at a time (implemented by the RNN and Transformer)."""

    bos_id: int
    eos_id: int
    pad_id: int

    def init_decoder(self, src: torch.Tensor) -> DecoderState:
        """Run the encoder once. :param src: shape (B, S) long, right-padded with ``pad_id``."""
        ...

    def decode_step(
        self, prev: torch.Tensor, state: DecoderState, need_weights: bool = False
    ) -> tuple[torch.Tensor, DecoderState, torch.Tensor | None]:
        """Advance one position.

        :param prev: shape (B,) long, the last emitted token (``bos_id`` at step 0).
        :return: logits (B, V), the new state, and cross-attention weights (B, S) (averaged
            over heads/layers as the model sees fit) if ``need_weights`` else None.
        """
        ...


@dataclass
class Hypothesis:
    """One decoded sentence.

    :param tokens: emitted token ids, without bos and eos.
    :param score: sum of log-probs of the emitted tokens, eos included.
    :param norm_score: ``score / length_penalty(len(tokens) + ended_with_eos, alpha)``.
    :param attention: shape (T_out, S_real), one row per decoding step (the eos step
        included, so T_out = len(tokens) + 1 when ``ended_with_eos``), columns trimmed to
        the source's real length; None unless weights were requested.
    :param ended_with_eos: False when the hypothesis was cut at its maximum length.
    """

    tokens: list[int]
    score: float
    norm_score: float
    attention: torch.Tensor | None = None
    ended_with_eos: bool = True


class Uncached(torch.nn.Module):
    """``model`` decoded without its key/value cache: every step recomputes the whole prefix.

    The baseline the cache is timed against (``benchmarks/multi30k.py``); outputs equal the cached
    model's. ``model`` must accept ``init_decoder(src, use_cache=False)`` (the Transformer does).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.pad_id, self.bos_id, self.eos_id = model.pad_id, model.bos_id, model.eos_id
        self.cfg = model.cfg  # the same position limit (attnkit.inference.translate.source_limit)

    def init_decoder(self, src: torch.Tensor) -> DecoderState:
        return self.model.init_decoder(src, use_cache=False)

    def decode_step(self, prev: torch.Tensor, state: DecoderState, need_weights: bool = False
                    ) -> tuple[torch.Tensor, DecoderState, torch.Tensor | None]:
        return self.model.decode_step(prev, state, need_weights)


#: Default output budget ``a * src_len + b``: "input length + 50" (Vaswani et al. 2017, sec. 6.1).
MAX_LEN_A, MAX_LEN_B = 1.0, 50.0

#: Default GNMT length penalty alpha (the value Vaswani et al. 2017, sec. 6.1, decode with).
LENPEN = 0.6


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ``((5 + length) / 6) ** alpha``; 1 when alpha = 0.

    :param length: emitted tokens, eos included.
    """
    return ((5 + length) / 6) ** alpha


def max_lengths(src: torch.Tensor, pad_id: int, a: float = MAX_LEN_A, b: float = MAX_LEN_B) -> torch.Tensor:
    """Per-sentence output budget ``floor(a * src_len + b)``, at least 1.

    :param src: shape (B, S) long, padded with ``pad_id``.
    :return: shape (B,) long, the maximum number of emitted tokens, eos included.
    """
    src_len = (src != pad_id).sum(dim=1)  # (B,)
    return torch.floor(a * src_len.double() + b).long().clamp(min=1)


def _check_src(src: torch.Tensor) -> None:
    if src.dim() != 2 or src.dtype != torch.long:
        raise ValueError(
            f"src must be a (B, S) long tensor of token ids, got shape {tuple(src.shape)} "
            f"and dtype {src.dtype}."
        )


def _check_weights(weights: torch.Tensor | None, rows: int, src_width: int) -> torch.Tensor:
    if weights is None or tuple(weights.shape) != (rows, src_width):
        got = None if weights is None else tuple(weights.shape)
        raise ValueError(
            f"decode_step(need_weights=True) must return weights of shape {(rows, src_width)}, got {got}."
        )
    return weights.float()


def _hypothesis(
    tokens: list[int], score: float, ended_with_eos: bool, attention: torch.Tensor | None,
    src_len: int, alpha: float,
) -> Hypothesis:
    """:param attention: shape (T_out, S) or None."""
    length = len(tokens) + int(ended_with_eos)
    trimmed = None if attention is None else attention[:, :src_len]  # (T_out, S_real)
    return Hypothesis(tokens, score, score / length_penalty(length, alpha), trimmed, ended_with_eos)


def greedy_search(
    model: StepDecoder, src: torch.Tensor, *, max_len_a: float = MAX_LEN_A, max_len_b: float = MAX_LEN_B,
    need_weights: bool = False,
) -> list[Hypothesis]:
    """Pick the most probable token at every step, batched; ``norm_score == score`` (alpha 0).

    A row leaves the batch (``state.select``) when it emits eos or reaches its max length;
    the loop ends when no row is left.

    :param src: shape (B, S) long, right-padded with ``model.pad_id``.
    :return: B hypotheses, in the order of ``src``.
    """
    _check_src(src)
    batch, device = src.size(0), src.device
    src_lens = (src != model.pad_id).sum(dim=1).tolist()
    max_lens = max_lengths(src, model.pad_id, max_len_a, max_len_b).tolist()
    state = model.init_decoder(src)
    rows = list(range(batch))  # sentence of each live row
    prev = torch.full((batch,), model.bos_id, dtype=torch.long, device=device)
    scores = torch.zeros(batch, device=device)  # (A,) float32
    tokens: list[list[int]] = [[] for _ in range(batch)]
    attention: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    results: dict[int, Hypothesis] = {}
    while rows:
        logits, state, weights = model.decode_step(prev, state, need_weights)
        if need_weights:
            weights = _check_weights(weights, len(rows), src.size(1))
        best_logp, best = F.log_softmax(logits.float(), dim=-1).max(dim=-1)  # (A,), (A,)
        scores = scores + best_logp
        keep = []
        for i, (sent, token) in enumerate(zip(rows, best.tolist(), strict=True)):
            if need_weights:
                attention[sent].append(weights[i])
            ended = token == model.eos_id
            if not ended:
                tokens[sent].append(token)
            if ended or len(tokens[sent]) >= max_lens[sent]:
                attn = torch.stack(attention[sent]) if need_weights else None  # (T_out, S)
                results[sent] = _hypothesis(tokens[sent], scores[i].item(), ended, attn, src_lens[sent], 0.0)
            else:
                keep.append(i)
        if keep and len(keep) < len(rows):
            index = torch.tensor(keep, dtype=torch.long, device=device)
            state, best, scores = state.select(index), best[index], scores[index]
        rows = [rows[i] for i in keep]
        prev = best
    return [results[sent] for sent in range(batch)]


def _split_candidates(scores: list[float], parents: list[int], tokens: list[int], k: int, eos_id: int
                      ) -> tuple[list[tuple[int, int, float]], list[tuple[int, list[int], float, bool]]]:
    """One sentence's best candidates, best first -> ``(live, ends)``: the first ``k`` that do not end (the
    next beam: parent row, token, score) and the eos candidates among the first ``k`` (parent row, no new
    token, score, True)."""
    live: list[tuple[int, int, float]] = []
    ends: list[tuple[int, list[int], float, bool]] = []
    for j, (score, parent, token) in enumerate(zip(scores, parents, tokens, strict=True)):
        if score == float("-inf"):
            break  # candidates are sorted: the rest are dead too
        if token == eos_id:
            if j < k:
                ends.append((parent, [], score, True))
        elif len(live) < k:
            live.append((parent, token, score))
    return live, ends


def beam_search(
    model: StepDecoder, src: torch.Tensor, *, beam_size: int = 4, lenpen: float = LENPEN, n_best: int = 1,
    max_len_a: float = MAX_LEN_A, max_len_b: float = MAX_LEN_B, need_weights: bool = False,
) -> list[list[Hypothesis]]:
    """Beam search with GNMT length penalty, batched over B sentences x K beams (B*K rows).

    Each step, every live beam proposes all its continuations, ranked by raw score. Of a
    sentence's 2K best candidates, an eos candidate among the first K ends a hypothesis (it
    leaves the beam for the sentence's finished list, scored ``score / lp``) and the first
    K non-eos candidates form the next beam. At step 0 only the first of the K copies is
    live, so no duplicates arise.

    Stopping (fairseq's rule, Hugging Face ``early_stopping=True``): a sentence is done once
    K hypotheses have finished, or at its max length, where its live beams are finalized
    without eos until K are finished. Its rows then leave the batch. Departure from an
    exhaustive bound: a live beam might still have reached a better length-normalized
    score; continuing for it would make ``beam_size=1`` differ from greedy search.

    :param src: shape (B, S) long, right-padded with ``model.pad_id``.
    :return: per sentence, ``n_best`` hypotheses sorted by ``norm_score``, best first
        (fewer only if the model gives -inf to every other continuation).
    """
    _check_src(src)
    if beam_size < 1 or not 1 <= n_best <= beam_size:
        raise ValueError(f"need beam_size >= 1 and 1 <= n_best <= beam_size, got {beam_size=}, {n_best=}.")
    k, batch, device = beam_size, src.size(0), src.device
    src_lens = (src != model.pad_id).sum(dim=1).tolist()
    max_lens = max_lengths(src, model.pad_id, max_len_a, max_len_b).tolist()
    state = model.init_decoder(src).select(torch.arange(batch, device=device).repeat_interleave(k))
    sents = list(range(batch))  # sentence of each live group of K rows
    prev = torch.full((batch * k,), model.bos_id, dtype=torch.long, device=device)
    scores = torch.zeros(batch, k, device=device)
    scores[:, 1:] = float("-inf")  # step 0: only the first beam of each sentence is live
    scores = scores.view(-1)  # (A*K,) float32
    history = torch.zeros(batch * k, 0, dtype=torch.long, device=device)  # (A*K, t) emitted tokens
    attn_history = torch.zeros(batch * k, 0, src.size(1), device=device) if need_weights else None
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    while sents:
        logits, state, weights = model.decode_step(prev, state, need_weights)
        if attn_history is not None:  # this step's weights join their parent row's history
            weights = _check_weights(weights, len(sents) * k, src.size(1))
            attn_history = torch.cat([attn_history, weights.unsqueeze(1)], dim=1)  # (A*K, t+1, S)
        logp = F.log_softmax(logits.float(), dim=-1)  # (A*K, V)
        vocab = logp.size(-1)
        candidates = (scores.unsqueeze(1) + logp).view(len(sents), k * vocab)  # (A, K*V)
        top_scores, top_index = candidates.topk(min(2 * k, k * vocab), dim=1)  # (A, 2K)
        group_start = k * torch.arange(len(sents), device=device).unsqueeze(1)  # (A, 1)
        parents = (top_index // vocab + group_start).tolist()  # row of the beam each extends
        top_tokens = (top_index % vocab).tolist()
        step = history.size(1)
        next_beam: list[tuple[int, int, float]] = []  # (parent row, token, score) of each row of the next step
        still_live = []
        for a, sent in enumerate(sents):
            live, ends = _split_candidates(top_scores[a].tolist(), parents[a], top_tokens[a], k, model.eos_id)
            at_max_len = step + 1 >= max_lens[sent]
            if at_max_len:  # the live beams end here too, without eos
                ends += [(parent, [token], score, False) for parent, token, score in live]
            ends.sort(key=lambda end: end[2], reverse=True)  # same length, so raw order = normalized
            for parent, new, score, eos in ends[: k - len(finished[sent])]:
                attn = None if attn_history is None else attn_history[parent]  # (t+1, S)
                tokens = history[parent].tolist() + new
                finished[sent].append(_hypothesis(tokens, score, eos, attn, src_lens[sent], lenpen))
            if at_max_len or len(finished[sent]) >= k or not live:
                continue
            still_live.append(sent)
            live += [(live[0][0], model.pad_id, float("-inf"))] * (k - len(live))  # dead fillers
            next_beam += live
        if not still_live:
            break
        new_parents, new_tokens, new_scores = zip(*next_beam, strict=True)
        index = torch.tensor(new_parents, dtype=torch.long, device=device)  # (A'*K,)
        prev = torch.tensor(new_tokens, dtype=torch.long, device=device)  # (A'*K,)
        scores = torch.tensor(new_scores, dtype=torch.float32, device=device)
        state = state.select(index)
        history = torch.cat([history[index], prev.unsqueeze(1)], dim=1)  # (A'*K, t+1)
        if attn_history is not None:
            attn_history = attn_history[index]
        sents = still_live
    return [sorted(hyps, key=lambda h: h.norm_score, reverse=True)[:n_best] for hyps in finished]
