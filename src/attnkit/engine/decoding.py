"""Beam search without copying the encoder memory: :class:`SharedMemoryState`.

The reference :class:`attnkit.transformer.TransformerState` keeps one memory row per hypothesis,
so a beam of ``k`` copies each sentence's encoder output ``k`` times and reorders the copies at
every step. Here the encoder side (memory, its mask and the cross-attention key/value caches)
stays at one row per sentence, ``A`` rows for ``B = g * A`` hypotheses kept consecutive by the
search; cross-attention then runs as grouped queries (:func:`attnkit.engine.attention.fast_attend`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..transformer import TransformerState


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
