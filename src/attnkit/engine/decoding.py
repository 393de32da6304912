"""Decoding without needless copies: :class:`SharedMemoryState` (beam search) and :class:`GrowingKVCache`.

The reference :class:`attnkit.transformer.TransformerState` keeps one memory row per hypothesis,
so a beam of ``k`` copies each sentence's encoder output ``k`` times and reorders the copies at
every step. Here the encoder side (memory, its mask and the cross-attention key/value caches)
stays at one row per sentence, ``A`` rows for ``B = g * A`` hypotheses kept consecutive by the
search; cross-attention then runs as grouped queries (:func:`attnkit.engine.attention.fast_attend`).

The reference :meth:`attnkit.multihead.KVCache.append` concatenates: each step copies the whole cache,
``O(T)`` per step and ``O(T^2)`` per sequence. :class:`GrowingKVCache` keeps the keys and values in a buffer
with room for more positions and writes each step's into it in place, doubling the room when it is full
(amortised ``O(1)`` per step); its ``k`` and ``v`` are views of the filled part, the same values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..multihead import KVCache
from ..transformer import TransformerState

#: The positions a :class:`GrowingKVCache` has room for at first.
FIRST_ROOM = 64


def shared_rows(sentence: Tensor) -> Tensor | None:
    """Group rows that share a sentence: ``sentence`` ``(B,)`` (each row's sentence) -> ``(A,)`` or None.

    Returns the sentence of each group of ``g = B / A`` consecutive rows when every group is one
    sentence (beam search keeps a sentence's hypotheses together), else None.
    """
    B = sentence.numel()
    g = int((sentence == sentence[0]).long().cumprod(0).sum()) if B else 1  # length of the first run
    if B % g:
        return None
    grouped = sentence.view(B // g, g)  # (A, g)
    return grouped[:, 0] if bool((grouped == grouped[:, :1]).all()) else None


class SharedMemoryState(TransformerState):
    """A :class:`TransformerState` whose encoder side has one row per sentence (see the module docstring)."""

    def select(self, index: Tensor) -> SharedMemoryState:
        """Keep / reorder / repeat hypothesis rows; ``index`` ``(B',)``."""
        sentence = index // (self.tokens.size(0) // self.memory.size(0))  # (B',) sentence of each new row
        keep = shared_rows(sentence)  # (A',) one memory row per group of hypotheses ...
        if keep is None:
            keep = sentence  # ... or, for an ungrouped index, one per hypothesis
        same = keep.numel() == self.memory.size(0) and bool((keep == torch.arange(keep.numel(),
                                                                                   device=keep.device)).all())
        memory, memory_mask = self.memory, self.memory_mask
        if not same:
            memory, memory_mask = memory.index_select(0, keep), memory_mask.index_select(0, keep)
        caches = None
        if self.caches is not None:
            caches = [(s.select(index), c if same else c.select(keep)) for s, c in self.caches]
        return SharedMemoryState(memory, memory_mask, self.tokens.index_select(0, index), caches)


class GrowingKVCache(KVCache):
    """A :class:`KVCache` whose ``k`` / ``v`` ``(B, H_kv, T, d)`` are the first ``T`` positions of buffers with room
    for more: :meth:`append` writes the new positions in place instead of copying the cache.

    Appending twice to the same cache would write into the same room, so a cache is extended once (decoding
    does: each step's cache replaces the last); a cache that is reordered (:meth:`select`) gets its own buffers,
    with no room: the next append makes some (so beam search, which reorders every step, is not given these).
    With gradients enabled it appends by concatenation, as the reference does (an in-place write would break
    the backward pass).
    """

    def __init__(self, k: Tensor | None = None, v: Tensor | None = None, room: tuple[Tensor, Tensor] | None = None
                 ) -> None:
        super().__init__(k, v)
        self.room = room  # (B, H_kv, capacity, d_k), (B, H_kv, capacity, d_v)

    def append(self, k: Tensor, v: Tensor) -> KVCache:
        if torch.is_grad_enabled():
            return KVCache.append(self, k, v)
        T, new = (0 if self.k is None else self.k.size(2)), k.size(2)
        room = self.room
        if room is None or T + new > room[0].size(2):  # no room left: a buffer twice as long as needed
            capacity = max(FIRST_ROOM, 2 * (T + new))
            room = tuple(x.new_empty(x.size(0), x.size(1), capacity, x.size(3)) for x in (k, v))
            if self.k is not None and self.v is not None:
                room[0][:, :, :T], room[1][:, :, :T] = self.k, self.v
        room[0][:, :, T: T + new], room[1][:, :, T: T + new] = k, v  # in place: (B, H_kv, new, d)
        return GrowingKVCache(room[0][:, :, : T + new], room[1][:, :, : T + new], room)  # views, (B, H_kv, T+new, d)

    def select(self, index: Tensor) -> KVCache:
        if self.k is None or self.v is None:
            return GrowingKVCache()
        return GrowingKVCache(self.k.index_select(0, index), self.v.index_select(0, index))
