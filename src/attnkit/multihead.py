"""Multi-head attention (SEEDS.md section 6; Vaswani et al. section 3.2.2).

    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,   head_i = attend(Q W_i^Q, K W_i^K, V W_i^V)

The layer only projects and splits heads (:meth:`MultiHeadAttention.project`), calls the kernel
:func:`attnkit.attention.attend` and merges the heads (:meth:`MultiHeadAttention.merge`). The h per-head
matrices W_i^Q (d_model x d_k) are stored stacked as one ``(h*d_k, d_model)`` matrix, and Q, K, V projections
are stacked into one ``in_proj`` matrix ``[W^Q; W^K; W^V]`` so self-attention does a single matmul (seed 3).
Cross-attention uses the same matrix split in two: queries from the decoder, keys and
values from the encoder memory.

The kernel is :func:`attnkit.attention.attend` (matmul + softmax, as the seeds write it).

Incremental decoding keeps a :class:`KVCache` per attention layer, passed in and returned:
self-attention appends the new position's key/value; cross-attention projects the
encoder memory once, on the first step, and reuses it.

Options that decoder-only models use (each off by default; :mod:`attnkit.positions` has the formulas):
``n_kv_heads < n_heads`` is grouped-query attention (fewer key/value heads, each shared by
``n_heads / n_kv_heads`` query heads; the cache holds only those), ``rotary`` rotates queries and keys
by their positions (RoPE), ``alibi`` adds ALiBi's distance bias to the scores, ``causal`` applies
the look-ahead mask inside the kernel (a kernel may then skip the masked half), and ``qkv_bias``
with ``bias=False`` keeps the biases of ``in_proj`` only (Qwen2: ``Q = x W^Q + b^Q``, likewise K and V; no b^O).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import Normalizer, ScoreName, attend
from .positions import ALiBi, RotaryPositions


@dataclass
class KVCache:
    """Projected keys and values of the positions seen so far, ``(B, H_kv, T, d_k)`` / ``(B, H_kv, T, d_v)``
    (``H_kv`` key/value heads: ``H`` unless grouped-query attention; keys after the rotary rotation)."""

    k: Tensor | None = None
    v: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> KVCache:
        """The cache with the keys and values of ``T_q`` new positions, ``(B, H_kv, T_q, d)``, appended along time;
        this one is left as it is."""
        if self.k is None or self.v is None:
            return KVCache(k, v)
        return KVCache(torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2))  # (B, H_kv, T + T_q, d)

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
    :param bias: biases on every projection, ``in_proj`` and ``out_proj`` (Llama has none).
    :param qkv_bias: biases on the query, key and value projections (``in_proj``) even without ``bias``, none on
        ``out_proj`` (Qwen2).
    :param score: ``"scaled_dot"`` (the paper's ``q.k / sqrt(d_k)``) or ``"dot"`` (unscaled, for the
        seed 003 experiment of what the scale is for).
    :param n_kv_heads: key/value heads ``H_kv`` (default ``n_heads``); must divide ``n_heads``.
    :param rotary: rotate self-attention's queries and keys by position (a module shared by the layers).
    :param alibi: add ALiBi's bias ``-m_h |t - s|`` to self-attention's scores (shared likewise).
    :param causal: self-attention sees no later position (the look-ahead mask, applied by the kernel).
    """

    def __init__(self, d_model: int, n_heads: int, *, d_k: int | None = None, d_v: int | None = None,
                 dropout: float = 0.0, bias: bool = True, qkv_bias: bool = False, score: ScoreName = "scaled_dot",
                 n_kv_heads: int | None = None, rotary: RotaryPositions | None = None, alibi: ALiBi | None = None,
                 causal: bool = False) -> None:
        super().__init__()
        if d_k is None and d_model % n_heads != 0:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; give d_k explicitly")
        if score not in ("scaled_dot", "dot"):
            raise ValueError(f"multi-head attention scores with scaled_dot or dot, not {score!r}")
        n_kv_heads = n_kv_heads or n_heads
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        self.score = score
        self.normalizer: Normalizer = "softmax"
        self.beta: float | None = None  # inverse temperature on top of the score (attention_override)
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.d_k = d_k or d_model // n_heads
        self.d_v = d_v or self.d_k
        self.rotary, self.alibi, self.causal = rotary, alibi, causal
        self.dropout = nn.Dropout(dropout)  # on the attention weights
        # [W^Q; W^K; W^V], keys and values with H_kv heads; Qwen2 (qkv_bias) biases these three and not W^O
        self.in_proj = nn.Linear(d_model, n_heads * self.d_k + n_kv_heads * (self.d_k + self.d_v),
                                 bias=bias or qkv_bias)
        self.out_proj = nn.Linear(n_heads * self.d_v, d_model, bias=bias)  # W^O

    def extra_repr(self) -> str:
        kv = f", n_kv_heads={self.n_kv_heads}" if self.n_kv_heads != self.n_heads else ""
        return f"n_heads={self.n_heads}{kv}, d_k={self.d_k}, d_v={self.d_v}, score={self.score}"

    @staticmethod
    def _split(x: Tensor, heads: int, d: int) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, heads, d).transpose(1, 2)  # (B, T, heads*d) -> (B, heads, T, d)

    def forward(
        self,
        query: Tensor,
        memory: Tensor | None = None,
        mask: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        need_weights: bool = False,
        offset: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, KVCache | None]:
        """Attend from ``query`` to itself (``memory is None``) or to ``memory``: project, attend, merge.

        :param query: ``(B, T_q, d_model)``.
        :param memory: ``(B, T_k, d_model)`` encoder output for cross-attention, else None.
        :param mask: boolean, broadcastable to ``(B, H, T_q, T_k)`` (e.g. ``(B, 1, 1, T_k)``
            padding or ``(T_q, T_k)`` causal), ``True`` = may attend. With a self-attention
            cache, ``T_k`` counts the cached positions too.
        :param cache: keys/values of earlier steps (self-attention) or of the memory
            (cross-attention, filled on first use). A new cache is returned; the input is not modified.
        :param need_weights: return per-head weights ``(B, H, T_q, T_k)``.
        :param offset: ``(B,)`` each row's position of its first query, for rows at different positions (a
            continuous batch's left-padded cache); default: the number of cached positions. Only RoPE reads it.
        :returns: ``(output (B, T_q, d_model), weights or None, new cache or None)``.
        """
        q, k, v, cache, bias = self.project(query, memory, cache, offset)
        context, weights = attend(q, k, v, mask, score=self.score, normalizer=self.normalizer, beta=self.beta,
                                  dropout=self.dropout, need_weights=need_weights, bias=bias,
                                  causal=self.causal and memory is None)  # (B, H, T_q, d_v)
        return self.merge(context), weights, cache

    def project(self, query: Tensor, memory: Tensor | None = None, cache: KVCache | None = None,
                offset: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, KVCache | None, Tensor | None]:
        """The heads' queries, keys and values (parameters as in :meth:`forward`).

        :returns: ``(q (B, H, T_q, d_k), k (B, H_kv, T_k, d_k), v (B, H_kv, T_k, d_v), new cache or None,
            ALiBi's bias (H, T_q, T_k) or None)``; keys and values include the cached positions.
        """
        H, Hkv, dk, dv = self.n_heads, self.n_kv_heads, self.d_k, self.d_v
        past = cache is not None and cache.k is not None and cache.v is not None
        bias = None
        if memory is None:  # self-attention: one fused projection
            q, k, v = self.in_proj(query).split([H * dk, Hkv * dk, Hkv * dv], dim=-1)  # (B, T_q, H*d), 2 x H_kv*d
            q, k, v = self._split(q, H, dk), self._split(k, Hkv, dk), self._split(v, Hkv, dv)  # (B, H|H_kv, T_q, d)
            if self.rotary is not None:  # RoPE: rotate by position, counting the cached positions (or each row's)
                start = offset if offset is not None else (cache.k.size(2) if past else 0)
                q, k = self.rotary(q, start), self.rotary(k, start)
            if cache is not None:
                cache = cache.append(k, v)
                k, v = cache.k, cache.v  # (B, H_kv, T_past + T_q, d)
            if self.alibi is not None:
                bias = self.alibi(q.size(2), k.size(2)).to(q.dtype)  # (H, T_q, T_k)
        else:  # cross-attention: queries from the decoder, keys/values from the memory
            W, b = self.in_proj.weight, self.in_proj.bias  # split in two: [W^Q] for the queries, [W^K; W^V]
            q = self._split(F.linear(query, W[: H * dk], None if b is None else b[: H * dk]), H, dk)
            if past:
                k, v = cache.k, cache.v  # memory projected on an earlier step
            else:
                kv = F.linear(memory, W[H * dk:], None if b is None else b[H * dk:])  # (B, T_k, H_kv*(dk+dv))
                k_, v_ = kv.split([Hkv * dk, Hkv * dv], dim=-1)
                k, v = self._split(k_, Hkv, dk), self._split(v_, Hkv, dv)  # (B, H_kv, T_k, d)
            if cache is not None:
                cache = KVCache(k, v)
        return q, k, v, cache, bias

    def merge(self, context: Tensor) -> Tensor:
        """Concat(head_1, ..., head_h) W^O: ``context`` ``(B, H, T_q, d_v)`` -> ``(B, T_q, d_model)``."""
        B, H, T_q, dv = context.shape
        return self.out_proj(context.transpose(1, 2).reshape(B, T_q, H * dv))  # (B, T_q, H*d_v) -> (B, T_q, d)
