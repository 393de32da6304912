"""Continuous (iteration-level) greedy decoding: sentences join and leave a running batch at every step.

:func:`attnkit.search.greedy_search` decodes a batch from ``<s>`` until its last sentence ends; a
sentence that arrives meanwhile waits for the whole batch, and the batch shrinks as its sentences end.
Here (as Orca and Hugging Face's TGI serve): :meth:`ContinuousGreedy.add` encodes new sentences and runs
their first step with :meth:`~attnkit.transformer.Transformer.decode_step`, then merges them into the
running batch; :meth:`ContinuousGreedy.step` feeds every running sentence its next token at its own
position. The rows of one step are at different positions, so

* each row's key/value cache is right-aligned: a row that joined later is padded on the left, and
  ``valid`` ``(B, t)`` masks the padding (the query sees only its own keys);
* each row's position is its own: ``x = Embed(y) + PE[pos]`` with ``pos`` ``(B,)``;
* the encoder side (memory, its mask and the cross-attention caches) is padded to the longest source
  of the running rows.

The tokens are greedy search's: each row computes what it would alone (its padding is masked, so it
gets exactly zero weight); ``tests/test_continuous.py`` checks it against :func:`greedy_search`. A row
ends at ``</s>`` or at its output budget (:func:`attnkit.search.max_lengths`, cut at the model's positions
as :func:`attnkit.inference.translate.output_budget` does), and leaves the batch; the columns no row
needs any more are dropped then.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from ..layers import input_embedding
from ..multihead import KVCache
from ..search import MAX_LEN_A, MAX_LEN_B, max_lengths
from ..transformer import Transformer
from ..vocab import BOS_ID, EOS_ID, PAD_ID

__all__ = ["ContinuousGreedy", "Finished", "RunningRows", "supports_continuous"]


def supports_continuous(model: torch.nn.Module) -> bool:
    """Whether ``model`` can decode continuously: a Transformer (an RNN's state has no positions to align)."""
    return isinstance(model, Transformer)


@dataclass
class Finished:
    """A sentence that ended: its handle (from :meth:`ContinuousGreedy.add`) and its output ids (no ``</s>``)."""

    handle: int
    tokens: list[int]
    score: float  # sum of the chosen tokens' log-probabilities


@dataclass
class _Row:
    handle: int
    tokens: list[int]
    score: float
    budget: int  # most tokens it may emit, </s> included


def _pad_to(x: Tensor, dim: int, size: int, left: bool = False, value: float = 0.0) -> Tensor:
    """``x`` padded with ``value`` along ``dim`` to ``size`` (on the left or right)."""
    missing = size - x.size(dim)
    if missing <= 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + ([missing, 0] if left else [0, missing])
    return F.pad(x, pad, value=value)


class RunningRows:
    """What a continuous batch keeps of its rows, whatever decodes them (:class:`ContinuousGreedy`,
    :class:`~attnkit.engine.continuous_lm.ContinuousSampler`): the rows, each layer's self-attention cache with every
    row's keys right-aligned (``(B, H_kv, t, d)``), ``valid`` ``(B, t)`` (which columns are the row's own), the token
    each row feeds next (``prev`` ``(B,)``) and its position (``pos`` ``(B,)``). :meth:`_join` appends rows,
    :meth:`_select` keeps some; a subclass keeps what else it has (an encoder's side) in step with them.
    ``cache_type`` is the class of the caches kept (the engine's grow in place)."""

    cache_type: type[KVCache] = KVCache

    def _reset(self) -> None:
        self.rows: list = []
        self.caches: list[KVCache] = []  # per layer: keys, values (B, H_kv, t, d)
        self.valid: Tensor | None = None  # (B, t) bool: which cached keys are the row's own
        self.prev: Tensor | None = None  # (B,) the token each row feeds next
        self.pos: Tensor | None = None  # (B,) its position

    @property
    def running(self) -> int:
        """Rows being decoded."""
        return len(self.rows)

    def _join(self, caches: list[KVCache], valid: Tensor, prev: Tensor, pos: Tensor, rows: list) -> None:
        """Append ``rows``, with their caches ``(G, H_kv, L, d)``, ``valid`` ``(G, L)``, ``prev`` and ``pos``
        ``(G,)``, left-padding the shorter side's keys; all made before any is kept (a failure changes nothing)."""
        if self.rows:
            t = max(self.valid.size(1), valid.size(1))

            def joined(own: Tensor, new: Tensor) -> Tensor:
                return torch.cat([_pad_to(own, 2, t, left=True), _pad_to(new, 2, t, left=True)])  # (B + G, H, t, d)

            caches = [self.cache_type(joined(own.k, new.k), joined(own.v, new.v))
                      for own, new in zip(self.caches, caches, strict=True)]
            valid = torch.cat([_pad_to(self.valid, 1, t, left=True, value=False),
                               _pad_to(valid, 1, t, left=True, value=False)])  # (B + G, t)
            prev, pos = torch.cat([self.prev, prev]), torch.cat([self.pos, pos])
        else:
            caches = [self.cache_type(c.k, c.v) for c in caches]
        self.caches, self.valid, self.prev, self.pos = caches, valid, prev, pos
        self.rows.extend(rows)

    def _select(self, keep: list[int]) -> Tensor | None:
        """Keep only the rows ``keep`` and drop the leading key columns no kept row uses; the index of the kept rows
        (None when none is kept: the batch is empty)."""
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._reset()
            return None
        index = torch.tensor(keep, dtype=torch.long, device=self.prev.device)
        valid = self.valid.index_select(0, index)  # (B', t)
        drop = int(valid.any(dim=0).long().argmax())  # leading columns that no kept row uses
        self.valid = valid[:, drop:]
        self.caches = [self.cache_type(c.k.index_select(0, index)[:, :, drop:], c.v.index_select(0, index)[:, :, drop:])
                       for c in self.caches]
        self.prev, self.pos = self.prev.index_select(0, index), self.pos.index_select(0, index)
        return index


class ContinuousGreedy(RunningRows):
    """Greedy decoding of a changing set of sentences (see the module docstring).

    ``add(sources)`` -> handles; ``step()`` -> the sentences that ended this step. Not thread-safe: one
    thread drives it (the server's model worker). Runs under ``torch.inference_mode``.
    """

    def __init__(self, model: Transformer, *, max_len_a: float = MAX_LEN_A, max_len_b: float = MAX_LEN_B) -> None:
        if not supports_continuous(model):
            raise TypeError(f"continuous decoding needs a Transformer, got {type(model).__name__}")
        self.model = model
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self.limit = model.cfg.max_len  # positions on each side
        self._next_handle = 0
        self._reset()

    def _reset(self) -> None:
        super()._reset()
        self.memory: Tensor | None = None  # (B, S, d_model)
        self.memory_mask: Tensor | None = None  # (B, 1, 1, S)
        self.cross: list[KVCache] = []  # per layer: the cross-attention cache (B, H, S, d_k)

    @property
    def width(self) -> int:
        """Source positions of the running batch (the longest running source)."""
        return 0 if self.memory is None else self.memory.size(1)

    @torch.inference_mode()
    def add(self, sources: list[list[int]]) -> tuple[list[int], list[Finished]]:
        """Start ``sources`` (ids with ``</s>``, each at most the model's ``max_len``): encode them and run their
        first step. Returns their handles, and those that ended at once (``</s>`` or a budget of one token)."""
        model = self.model
        if model.training:  # eval() walks every module: a tenth of a millisecond per join, on a first token's path
            model.eval()
        device = next(model.parameters()).device
        handles = list(range(self._next_handle, self._next_handle + len(sources)))
        self._next_handle += len(sources)
        if not sources:
            return handles, []
        src = pad_sequence([torch.tensor(s, dtype=torch.long) for s in sources], batch_first=True,
                           padding_value=PAD_ID).to(device)  # (R, S)
        # each row's output budget, cut at the model's positions as translate_texts cuts it (output_budget)
        budgets = max_lengths(src, PAD_ID, self.max_len_a, self.max_len_b).clamp(max=self.limit).tolist()
        state = model.init_decoder(src)
        bos = torch.full((len(sources),), BOS_ID, dtype=torch.long, device=device)
        logits, state, _ = model.decode_step(bos, state)  # (R, V): the reference step, position 0
        new_rows = [_Row(h, [], 0.0, budget) for h, budget in zip(handles, budgets, strict=True)]
        self._merge(state, new_rows)
        return handles, self._choose(logits, first=len(self.rows) - len(new_rows))

    def _merge(self, state, new_rows: list[_Row]) -> None:
        """Append the rows of a fresh one-step ``state`` to the running batch, padding either side to fit (the
        sources on the right)."""
        R = len(new_rows)
        device = state.memory.device
        memory, memory_mask, cross = state.memory, state.memory_mask, [c for _, c in state.caches]
        if self.memory is not None:
            S = max(self.memory.size(1), memory.size(1))

            def sources(own: Tensor, new: Tensor, dim: int, value: float = 0.0) -> Tensor:
                return torch.cat([_pad_to(own, dim, S, value=value), _pad_to(new, dim, S, value=value)])

            memory, memory_mask = sources(self.memory, memory, 1), sources(self.memory_mask, memory_mask, 3, False)
            cross = [KVCache(sources(own.k, new.k, 2), sources(own.v, new.v, 2))
                     for own, new in zip(self.cross, cross, strict=True)]
        self._join([s for s, _ in state.caches], torch.ones(R, 1, dtype=torch.bool, device=device),  # <s>'s key
                   torch.zeros(R, dtype=torch.long, device=device), torch.ones(R, dtype=torch.long, device=device),
                   new_rows)  # the next token goes to position 1
        self.memory, self.memory_mask, self.cross = memory, memory_mask, cross

    @torch.inference_mode()
    def step(self) -> list[Finished]:
        """Feed every running sentence its next token; the sentences that ended."""
        if not self.rows:
            return []
        model = self.model
        B = len(self.rows)
        table = model.positions(int(self.pos.max()) + 1)  # (P, d_model)
        x = model.embed(self.prev[:, None]) + table[self.pos][:, None]  # (B, 1, d_model) at each row's position
        x = model.dropout(input_embedding(x, model.token_type, model.embed_norm))
        ones = torch.ones(B, 1, dtype=torch.bool, device=x.device)
        mask = torch.cat([self.valid, ones], dim=1)[:, None, None, :]  # (B, 1, 1, t + 1): own keys and the new one
        caches, cross = [], []
        for layer, own, other in zip(model.layers, self.caches, self.cross, strict=True):
            x, _, (own, other) = layer(x, self.memory, mask, self.memory_mask, cache=(own, other))
            caches.append(own)
            cross.append(other)
        hidden = model.final_norm(x) if model.final_norm is not None else x
        logits = model.out_proj(hidden[:, 0])  # (B, V)
        self.caches, self.cross, self.valid, self.pos = caches, cross, mask[:, 0, 0, :], self.pos + 1
        return self._choose(logits, first=0)

    def _choose(self, logits: Tensor, first: int) -> list[Finished]:
        """Pick each row's most probable token from ``logits`` (rows ``first..``); drop the rows that ended."""
        best_logp, best = F.log_softmax(logits.float(), dim=-1).max(dim=-1)  # (R,), (R,)
        keep, done = list(range(first)), []
        for i, (token, logp) in enumerate(zip(best.tolist(), best_logp.tolist(), strict=True), start=first):
            row = self.rows[i]
            row.score += logp
            ended = token == EOS_ID
            if not ended:
                row.tokens.append(token)
            if ended or len(row.tokens) >= row.budget:
                done.append(Finished(row.handle, row.tokens, row.score))
            else:
                keep.append(i)
        self.prev = torch.cat([self.prev[:first], best])  # (B,)
        if len(keep) < len(self.rows):
            self._keep(keep)
        return done

    def _keep(self, keep: list[int]) -> None:
        """Keep only the rows ``keep``; drop the key and source columns no kept row uses."""
        index = self._select(keep)
        if index is None:
            return
        real = self.memory_mask.index_select(0, index)[:, 0, 0, :]  # (B', S)
        S = int(real.any(dim=0).nonzero().max()) + 1  # trailing source columns that no kept row uses
        self.memory = self.memory.index_select(0, index)[:, :S]
        self.memory_mask = self.memory_mask.index_select(0, index)[..., :S]
        self.cross = [KVCache(c.k.index_select(0, index)[:, :, :S], c.v.index_select(0, index)[:, :, :S])
                      for c in self.cross]
