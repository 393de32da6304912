"""A compiled decoding step for a language model: a static key/value cache and ``torch.compile``.

At batch 1 a small model's step is a few dozen matrix-vector products, and eager PyTorch spends most of it
launching operators from Python (docs/language-models.md, the generation race). A compiled step runs as one graph of
generated kernels, but a graph wants fixed shapes, and the textbook cache grows by one position per step. So:

* :class:`StaticKVCache` keeps each layer's keys and values in buffers ``(B, H_kv, capacity, d)`` allocated once.
  A step writes row ``b``'s new key and value at its position ``pos[b]``, in place, and attends over the whole
  buffer with :func:`static_mask`: key ``s`` is visible when ``s <= pos`` (written already) and, under a sliding
  window, ``s > pos - window``. A masked key gets exactly zero weight, so the step computes what the textbook's
  growing cache computes.
* RoPE rotates by each row's ``pos`` (the ``offset`` argument of the textbook's attention); a table of positions is
  read at ``pos``. ALiBi's bias is taken for a query at the buffer's last column, ``-m_h (capacity - 1 - s)``,
  which differs from the query's own ``-m_h (pos - s)`` by one constant per row and head: softmax does not see it.
* :class:`CompiledDecoder` runs the prompt through the model's own :meth:`~attnkit.lm.LanguageModel.step` (the
  prefill, eager), copies its cache into static buffers, then feeds one token at a time through
  :meth:`CompiledDecoder.decode_step`: the textbook's layers (:meth:`~attnkit.lm.LanguageModel.decode_layers`)
  with a static cache, compiled by ``torch.compile`` (inductor, with its C++ wrapper) once per batch size and
  capacity. The capacity doubles when a sequence outgrows it (64, 128, ...; at most the model's context), so a
  step attends over at most twice the keys it needs.

The compiled step and the eager one give the same logits (``tests/test_compiled_decoding.py``); compiling costs
seconds per shape, once per process, so it pays off for long or many generations (``attnkit generate --compile``).
Under bf16 autocast ALiBi's larger constant is rounded with the bias, so its logits differ a little from eager.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..lm import LanguageModel, LMState
from ..multihead import KVCache
from .attention import _fused_zeroes_empty_rows

__all__ = ["CompiledDecoder", "StaticKVCache", "embed_at", "static_mask"]

#: The first capacity of the buffers (doubled as a sequence outgrows it, up to the model's context).
FIRST_CAPACITY = 64


@dataclass
class StaticKVCache(KVCache):
    """Keys and values ``(B, H_kv, capacity, d)`` in fixed buffers; ``pos`` ``(B,)`` is where each row writes next.

    :meth:`append` writes in place and returns a cache over the same buffers, one position further: a cache is
    extended once (decoding replaces each step's cache by the next), like :class:`~.decoding.GrowingKVCache`.
    """

    pos: Tensor | None = None  # (B,) long

    def append(self, k: Tensor, v: Tensor) -> KVCache:
        if self.k is None or self.v is None or self.pos is None:
            raise ValueError("a static cache is made from a filled one (StaticKVCache.of)")
        if k.size(2) != 1:
            raise ValueError(f"a static cache takes one new position per step, got {k.size(2)}")
        rows = torch.arange(k.size(0), device=k.device)  # (B,)
        self.k[rows, :, self.pos] = k[:, :, 0]  # row b's key at its position pos[b]: (B, H_kv, d)
        self.v[rows, :, self.pos] = v[:, :, 0]
        return StaticKVCache(self.k, self.v, self.pos + 1)

    def select(self, index: Tensor) -> KVCache:
        if self.k is None or self.v is None or self.pos is None:
            return StaticKVCache()
        return StaticKVCache(self.k.index_select(0, index), self.v.index_select(0, index),
                             self.pos.index_select(0, index))

    @staticmethod
    def of(cache: KVCache, capacity: int) -> StaticKVCache:
        """A filled cache ``(B, H_kv, t, d)`` copied into buffers with room for ``capacity >= t`` positions."""
        assert cache.k is not None and cache.v is not None
        B, H, t, _ = cache.k.shape
        k = cache.k.new_zeros(B, H, capacity, cache.k.size(3))
        v = cache.v.new_zeros(B, H, capacity, cache.v.size(3))
        k[:, :, :t], v[:, :, :t] = cache.k, cache.v
        return StaticKVCache(k, v, torch.full((B,), t, dtype=torch.long, device=k.device))


def static_mask(pos: Tensor, capacity: int, window: int | None) -> Tensor:
    """Which of ``capacity`` cached keys the query at ``pos`` ``(B,)`` may see: ``s <= pos`` (the look-ahead mask;
    later columns are not written yet) and ``pos - s < window`` -> ``(B, 1, 1, capacity)``, True = may attend."""
    s = torch.arange(capacity, device=pos.device)[None, :]  # (1, capacity) key positions
    t = pos[:, None]  # (B, 1) query positions
    mask = s <= t
    if window:
        mask = mask & (t - s < window)
    return mask[:, None, None, :]  # (B, 1, 1, capacity)


def embed_at(model: LanguageModel, tokens: Tensor, pos: Tensor, table_rows: int) -> Tensor:
    """``Dropout(Embed(y) + PE[pos])`` for one token per row, ``tokens`` ``(B, 1)`` at positions ``pos`` ``(B,)``
    (each row at its own), reading the first ``table_rows > max(pos)`` rows of a position table."""
    x = model.embed(tokens)  # (B, 1, d_model)
    if model.positions is not None:
        x = x + model.positions(table_rows)[pos][:, None]  # + PE at each row's own position
    return model.dropout(x)


class CompiledDecoder:
    """Generation from ``model`` through a compiled one-token step (see the module docstring).

    It has what :func:`attnkit.sampling.generate` calls (``parameters``, ``init_state``, ``step``), so
    ``generate(CompiledDecoder(model), ...)`` gives ``generate(model, ...)``'s tokens.

    :param compile: ``torch.compile`` the step (False: the same static-cache step, eager, for tests).
    """

    def __init__(self, model: LanguageModel, *, compile: bool = True) -> None:
        if not isinstance(model, LanguageModel):
            raise TypeError(f"a compiled decoder needs a LanguageModel, got {type(model).__name__}")
        self.model = model
        device = next(model.parameters()).device
        for dtype in (torch.float32, torch.bfloat16):  # probe the fused kernel now: a probe in the graph would split it
            _fused_zeroes_empty_rows(device, dtype)
        # one graph per (batch size, capacity, dtype); dynamic=False: fixed shapes are what make it fast
        self._step = (torch.compile(self.decode_step, dynamic=False, options={"cpp_wrapper": True}) if compile
                      else self.decode_step)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def init_state(self) -> LMState:
        return self.model.init_state()

    def capacity_for(self, length: int) -> int:
        """Buffer positions for a sequence of ``length``: a power of two with room (at most the model's context).

        Every step attends over the whole buffer, so a buffer much longer than the sequence wastes work; each
        capacity is one more graph to compile, so they double."""
        capacity = FIRST_CAPACITY
        while capacity < length:
            capacity *= 2
        context = self.model.context
        return capacity if context is None else min(capacity, context)

    def step(self, tokens: Tensor, state: LMState) -> tuple[Tensor, LMState]:
        """:meth:`LanguageModel.step`: ``tokens`` ``(B, T)`` -> ``(logits of the last position (B, V), new state)``.

        A state that is not static yet (the prompt) goes through the model's own step, then into static buffers;
        afterwards each token goes through the compiled step.
        """
        if not (state.caches and isinstance(state.caches[0], StaticKVCache)):
            logits, state = self.model.step(tokens, state)  # the prefill, eager
            capacity = self.capacity_for(state.length + 1)
            return logits, LMState([StaticKVCache.of(c, capacity) for c in state.caches], state.length)
        caches = [c for c in state.caches if isinstance(c, StaticKVCache)]
        length, context = state.length, self.model.context
        logits = tokens.new_empty(0)
        for j in range(tokens.size(1)):  # one position at a time
            if context is not None and length + 1 > context:
                raise ValueError(f"position {length + 1} exceeds max_len={context}")
            if length + 1 > caches[0].k.size(2):  # out of room: copy into buffers twice as long
                capacity = self.capacity_for(length + 1)
                caches = [StaticKVCache.of(KVCache(c.k[:, :, :length], c.v[:, :, :length]), capacity) for c in caches]
            keys = [c.k for c in caches]
            values = [c.v for c in caches]
            pos = caches[0].pos
            logits = self._step(tokens[:, j: j + 1], pos, keys, values)  # writes the buffers in place
            after = pos + 1
            caches = [StaticKVCache(k, v, after) for k, v in zip(keys, values, strict=True)]
            length += 1
        return logits, LMState(list(caches), length)

    def decode_step(self, tokens: Tensor, pos: Tensor, keys: list[Tensor], values: list[Tensor]) -> Tensor:
        """One token per row, ``tokens`` ``(B, 1)`` at ``pos`` ``(B,)``, through the textbook's layers with static
        caches ``keys[l]`` / ``values[l]`` ``(B, H_kv, capacity, d)`` (written in place) -> logits ``(B, V)``."""
        model = self.model
        capacity = keys[0].size(2)
        x = embed_at(model, tokens, pos, capacity)  # (B, 1, d_model)
        mask = static_mask(pos, capacity, model.cfg.window)  # (B, 1, 1, capacity)
        caches: list[KVCache] = [StaticKVCache(k, v, pos) for k, v in zip(keys, values, strict=True)]
        hidden, _, _ = model.decode_layers(x, mask, caches, offset=pos)  # (B, 1, d_model)
        return model.out_proj(hidden[:, 0])  # (B, V)
