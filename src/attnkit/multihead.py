"""Multi-head attention (SEEDS.md section 6; Vaswani et al. section 3.2.2).

    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,   head_i = attend(Q W_i^Q, K W_i^K, V W_i^V)

The layer only projects, splits heads, calls the kernel :func:`attnkit.attention.attend`
and merges. The h per-head matrices W_i^Q (d_model x d_k) are stored stacked as one
``(h*d_k, d_model)`` matrix, and Q, K, V projections are stacked into one
``in_proj`` matrix ``[W^Q; W^K; W^V]`` so self-attention does a single matmul (seed 3).
Cross-attention uses the same matrix split in two: queries from the decoder, keys and
values from the encoder memory.

The kernel is :func:`attnkit.attention.attend` (matmul + softmax, as the seeds write it);
:func:`attnkit.engine.accelerate` swaps in the engine's faster kernel with the same results.

Incremental decoding keeps a :class:`KVCache` per attention layer, passed in and returned:
self-attention appends the new position's key/value; cross-attention projects the
encoder memory once, on the first step, and reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import Normalizer, ScoreName, attend


@dataclass
class KVCache:
    """Projected keys and values of the positions seen so far, ``(B, H, T, d_k)`` / ``(B, H, T, d_v)``."""

    k: Tensor | None = None
    v: Tensor | None = None

    def select(self, index: Tensor) -> KVCache:
        """Keep / reorder / repeat batch rows (beam search); ``index`` is ``(B',)`` long."""
        if self.k is None or self.v is None:
            return KVCache()
        return KVCache(self.k.index_select(0, index), self.v.index_select(0, index))


class MultiHeadAttention(nn.Module):
    """Multi-head self- or cross-attention with an optional key/value cache.

    :param d_model: model width (input and output size).
    :param n_heads: number of heads h.
    :param d_k: per-head query/key size (default ``d_model // n_heads``).
    :param d_v: per-head value size (default ``d_k``).
    :param dropout: dropout on the attention weights (training only).
    :param score: ``"scaled_dot"`` (the paper's ``q.k / sqrt(d_k)``) or ``"dot"`` (unscaled, for the
        seed 003 experiment of what the scale is for).
    """

    def __init__(self, d_model: int, n_heads: int, *, d_k: int | None = None, d_v: int | None = None,
                 dropout: float = 0.0, bias: bool = True, score: ScoreName = "scaled_dot") -> None:
        super().__init__()
        if d_k is None and d_model % n_heads != 0:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; give d_k explicitly")
        if score not in ("scaled_dot", "dot"):
            raise ValueError(f"multi-head attention scores with scaled_dot or dot, not {score!r}")
        self.score = score
        self.normalizer: Normalizer = "softmax"
        self.beta: float | None = None  # inverse temperature on top of the score (attention_override)
        self.kernel = attend  # the engine swaps in its fast kernel
        self.n_heads = n_heads
        self.d_k = d_k or d_model // n_heads
        self.d_v = d_v or self.d_k
        self.dropout = nn.Dropout(dropout)  # on the attention weights
        self.in_proj = nn.Linear(d_model, n_heads * (2 * self.d_k + self.d_v), bias=bias)  # [W^Q; W^K; W^V]
        self.out_proj = nn.Linear(n_heads * self.d_v, d_model, bias=bias)  # W^O

    def extra_repr(self) -> str:
        kernel = self.kernel.__name__
        return f"n_heads={self.n_heads}, d_k={self.d_k}, d_v={self.d_v}, score={self.score}, kernel={kernel}"

    def _split(self, x: Tensor, d: int) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.n_heads, d).transpose(1, 2)  # (B, T, H*d) -> (B, H, T, d)

    def forward(
        self,
        query: Tensor,
        memory: Tensor | None = None,
        mask: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None, KVCache | None]:
        """Attend from ``query`` to itself (``memory is None``) or to ``memory``.

        :param query: ``(B, T_q, d_model)``.
        :param memory: ``(B, T_k, d_model)`` encoder output for cross-attention, else None.
        :param mask: boolean, broadcastable to ``(B, H, T_q, T_k)`` (e.g. ``(B, 1, 1, T_k)``
            padding or ``(T_q, T_k)`` causal), ``True`` = may attend. With a self-attention
            cache, ``T_k`` counts the cached positions too.
        :param cache: keys/values of earlier steps (self-attention) or of the memory
            (cross-attention, filled on first use). A new cache is returned; the input is not modified.
        :param need_weights: return per-head weights ``(B, H, T_q, T_k)`` (disables the fused kernel).
        :returns: ``(output (B, T_q, d_model), weights or None, new cache or None)``.
        """
        H, dk, dv = self.n_heads, self.d_k, self.d_v
        W, b = self.in_proj.weight, self.in_proj.bias
        if memory is None:  # self-attention: one fused projection
            q, k, v = self.in_proj(query).split([H * dk, H * dk, H * dv], dim=-1)  # 3 x (B, T_q, H*d)
            q, k, v = self._split(q, dk), self._split(k, dk), self._split(v, dv)  # (B, H, T_q, d)
            if cache is not None and cache.k is not None and cache.v is not None:
                k = torch.cat([cache.k, k], dim=2)  # (B, H, T_past + T_q, d_k)
                v = torch.cat([cache.v, v], dim=2)
        else:  # cross-attention: queries from the decoder, keys/values from the memory
            q = self._split(F.linear(query, W[: H * dk], None if b is None else b[: H * dk]), dk)
            if cache is not None and cache.k is not None and cache.v is not None:
                k, v = cache.k, cache.v  # memory projected on an earlier step
            else:
                kv = F.linear(memory, W[H * dk:], None if b is None else b[H * dk:])  # (B, T_k, H*(dk+dv))
                k_, v_ = kv.split([H * dk, H * dv], dim=-1)
                k, v = self._split(k_, dk), self._split(v_, dv)  # (B, H, T_k, d)
        context, weights = self.kernel(q, k, v, mask, score=self.score, normalizer=self.normalizer, beta=self.beta,
                                       dropout=self.dropout, need_weights=need_weights)  # (B, H, T_q, d_v)
        B, _, T_q, _ = context.shape
        out = self.out_proj(context.transpose(1, 2).reshape(B, T_q, H * dv))  # (B, H, T_q, d_v) -> (B, T_q, H*d_v)
        return out, weights, (KVCache(k, v) if cache is not None else None)
