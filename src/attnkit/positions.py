"""A Transformer's input: the token embedding (Vaswani et al. 3.4), and five ways to tell positions apart (SEEDS.md
section 7).

:class:`TokenEmbedding` turns token ids into vectors, ``Embedding(y) * sqrt(d_model)`` (or unscaled, as GPT-2 and BERT).

Attention is order-blind (permuting the keys permutes nothing in the output), so position enters
either in the *input* (added to the embeddings) or in the *scores* (inside every attention layer):

==============  ===============================================================  ===========================
``positions:``  what it does                                                     paper
==============  ===============================================================  ===========================
``sinusoidal``  ``x_t = Embed(y_t) + PE[t]``, ``PE[t, 2i] = sin(t / 10000^(2i/d))``, Vaswani et al. 2017, 3.5
                ``PE[t, 2i+1] = cos(t / 10000^(2i/d))``
``learned``     ``x_t = Embed(y_t) + P[t]`` with a trained table ``P``            Gehring et al. 2017; GPT-2
``rope``        ``q_t, k_t`` rotated by ``t * theta^(-2i/d_k)`` in each pair of   Su et al. 2021 (RoFormer)
                dimensions, so ``q_t . k_s`` depends on ``t - s`` only
``alibi``       ``e_ts = q_t . k_s / sqrt(d_k) - m_h |t - s|``, a fixed slope    Press et al. 2021
                ``m_h`` per head
``none``        nothing: a causal decoder can still infer position from how     Haviv et al. 2022
                many tokens it sees
==============  ===============================================================  ===========================

The first two are modules that return a table to add to the input (:func:`make_positions`); the
next two live in the attention layer (:class:`RotaryPositions` rotates the projected queries and
keys, :class:`ALiBi` gives a bias added to the scores), and both work at any length.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn


class TokenEmbedding(nn.Module):
    """Token ids ``(B, T)`` -> vectors ``(B, T, d_model)`` scaled by ``sqrt(d_model)`` (or by 1: ``scale=False``).

    Initialised ``N(0, d_model^-1/2)`` so the scaled embedding has unit variance, like the
    positional encoding it is added to; ``weight`` can be tied to the output projection.
    """

    def __init__(self, vocab_size: int, d_model: int, pad_id: int = 0, scale: bool = True) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        nn.init.normal_(self.embedding.weight, 0.0, d_model ** -0.5)
        with torch.no_grad():
            self.embedding.weight[pad_id].zero_()
        self.scale = math.sqrt(d_model) if scale else 1.0

    @property
    def weight(self) -> Tensor:
        return self.embedding.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.embedding(tokens) * self.scale  # (B, T, d_model)

#: How a model tells positions apart (see the module docstring).
PositionKind = Literal["sinusoidal", "learned", "rope", "alibi", "none"]
#: The kinds that add a table to the input embeddings.
ADDITIVE_POSITIONS = ("sinusoidal", "learned")


#: Where the sines and cosines go: alternate dimensions (the paper), or all sines then all cosines.
PositionLayout = Literal["interleaved", "halves"]


def sinusoidal_table(max_len: int, d_model: int, layout: PositionLayout = "interleaved") -> Tensor:
    """The paper's table ``(max_len, d_model)``: even dims ``sin(pos / 10000^(2i/d))``, odd dims ``cos(...)``.

    ``layout="halves"``: ``[sin(pos / 10000^(2i/d)) for i < d/2] ++ [cos(...) for i < d/2]``, the same
    frequencies laid out as tensor2tensor and Marian (OPUS-MT) do.
    """
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]  # (L, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d/2,)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (L, d/2)
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    if layout == "halves":
        half = angle.size(1)  # ceil(d/2) sines, the rest cosines
        table[:, :half] = torch.sin(angle)
        table[:, half:] = torch.cos(angle[:, : d_model - half])
    elif layout == "interleaved":
        table[:, 0::2] = torch.sin(angle)
        table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    else:
        raise ValueError(f"unknown position layout {layout!r}; choose interleaved or halves")
    return table.float()


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal positional encoding; ``forward(T, offset)`` returns rows ``offset..offset+T-1``."""

    def __init__(self, d_model: int, max_len: int = 1024, layout: PositionLayout = "interleaved") -> None:
        super().__init__()
        self.register_buffer("table", sinusoidal_table(max_len, d_model, layout), persistent=False)

    def forward(self, T: int, offset: int = 0) -> Tensor:
        if offset + T > self.table.size(0):
            raise ValueError(f"position {offset + T} exceeds max_len={self.table.size(0)}")
        return self.table[offset: offset + T]  # (T, d_model)


class LearnedPositions(nn.Module):
    """A learned position table (an alternative the paper reports as nearly identical)."""

    def __init__(self, d_model: int, max_len: int = 1024) -> None:
        super().__init__()
        self.table = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.table.weight, 0.0, d_model ** -0.5)

    def forward(self, T: int, offset: int = 0) -> Tensor:
        if offset + T > self.table.num_embeddings:
            raise ValueError(f"position {offset + T} exceeds max_len={self.table.num_embeddings}")
        return self.table.weight[offset: offset + T]  # (T, d_model)


def make_positions(kind: str, d_model: int, max_len: int, layout: PositionLayout = "interleaved") -> nn.Module:
    """``"sinusoidal"`` (laid out as ``layout`` says) or ``"learned"`` positional encoding: the tables added
    to the input. (``rope`` and ``alibi`` act inside attention: :class:`RotaryPositions`, :class:`ALiBi`.)"""
    if kind == "sinusoidal":
        return SinusoidalPositions(d_model, max_len, layout)
    if kind == "learned":
        return LearnedPositions(d_model, max_len)
    raise ValueError(f"unknown positional encoding {kind!r}; choose sinusoidal or learned")


class RotaryPositions(nn.Module):
    """Rotary position embedding, RoPE (Su et al. 2021, "RoFormer", eq. 34).

    Each query and key vector is split into ``d/2`` pairs of dimensions; pair ``i`` of the vector at
    position ``t`` is rotated by the angle ``t * theta_i`` with ``theta_i = theta^(-2i/d)``::

        [x_i, x_{i+d/2}] -> [x_i cos(t theta_i) - x_{i+d/2} sin(t theta_i),
                             x_i sin(t theta_i) + x_{i+d/2} cos(t theta_i)]

    A rotation by ``t`` then one by ``-s`` is one by ``t - s``, so ``q_t . k_s`` depends on the positions
    only through their offset ``t - s``. The pairs are ``(i, i + d/2)`` (GPT-NeoX, Llama and Hugging Face lay
    them out so) rather than the paper's ``(2i, 2i+1)``: the same function up to one fixed permutation of
    the dimensions of both ``q`` and ``k``, which no dot product sees. The cos/sin tables are computed once
    and grown when a longer sequence comes (not parameters: nothing is saved); rows at positions of their own (a
    tensor ``offset``) compute their angles directly instead.

    :param d_head: the per-head size ``d_k`` (even).
    :param theta: the base (10,000 in the paper and Llama 2; Llama 3 uses 500,000).
    """

    def __init__(self, d_head: int, theta: float = 10000.0) -> None:
        super().__init__()
        if d_head % 2:
            raise ValueError(f"rotary positions need an even head size, got d_k={d_head}")
        self.d_head, self.theta = d_head, theta
        inv_freq = 1.0 / theta ** (torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)  # (d/2,) theta_i
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos", torch.empty(0, d_head), persistent=False)  # (L, d) cached tables
        self.register_buffer("sin", torch.empty(0, d_head), persistent=False)

    def extra_repr(self) -> str:
        return f"d_head={self.d_head}, theta={self.theta:g}"

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``cos``, ``sin`` ``(..., d_head)`` of the angles ``t theta_i`` at ``positions`` ``(...)``, computed in
        float64 and returned in float32."""
        angle = positions[..., None].double() * self.inv_freq  # (..., d/2)
        angle = torch.cat([angle, angle], dim=-1)  # (..., d): pair i uses angle i in both halves
        return angle.cos().float(), angle.sin().float()

    def tables(self, end: int) -> tuple[Tensor, Tensor]:
        """``cos``, ``sin`` ``(end, d_head)`` for positions ``0..end-1`` (cached; regrown in powers of two)."""
        if self.cos.size(0) < end:
            size = 1 << max(end - 1, 1).bit_length()
            with torch.inference_mode(False):  # a cache made while sampling must still serve training's backward
                self.cos, self.sin = self.cos_sin(torch.arange(size, device=self.inv_freq.device))  # (L, d)
        return self.cos[:end], self.sin[:end]

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """``x`` ``(B, H, T, d_head)`` at positions ``offset..offset+T-1`` -> the rotated ``x``, same shape.

        ``offset`` may be a ``(B,)`` tensor: each row at its own positions (rows of a continuous batch)."""
        T = x.size(-2)
        if isinstance(offset, Tensor):  # the angles themselves: no table, no Python number (a compiled step)
            at = offset[:, None] + torch.arange(T, device=offset.device)  # (B, T) each row's positions
            cos, sin = self.cos_sin(at)  # (B, T, d)
            cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # (B, 1, T, d)
        else:
            cos, sin = self.tables(offset + T)
            cos, sin = cos[offset:].to(x.dtype), sin[offset:].to(x.dtype)  # (T, d)
        half = self.d_head // 2
        rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [-x_{i+d/2}, x_i]
        return x * cos + rotated_half * sin


def alibi_slopes(n_heads: int) -> list[float]:
    """ALiBi's head-specific slopes ``m_h`` (Press et al. 2021, section 3).

    For ``n`` a power of two, the geometric sequence starting at ``2^(-8/n)`` with that ratio
    (8 heads: ``1/2, 1/4, ..., 1/256``). Otherwise the slopes of the largest power of two
    ``p < n``, then every other slope of ``2p`` heads, as the paper's code does.
    """
    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if n_heads < 1:
        raise ValueError(f"ALiBi needs at least one head, got {n_heads}")
    p = 1 << (n_heads.bit_length() - 1)  # largest power of two <= n
    if p == n_heads:
        return power_of_two(n_heads)
    return power_of_two(p) + alibi_slopes(2 * p)[0::2][: n_heads - p]


class ALiBi(nn.Module):
    """Attention with Linear Biases (Press et al. 2021): ``e_ts = q_t . k_s / sqrt(d_k) - m_h |t - s|``.

    No position is added to the input; every head penalises distant keys linearly with its own slope
    ``m_h`` (:func:`alibi_slopes`). Under the look-ahead mask only ``s <= t`` matters, where the bias is
    the paper's ``-m_h (t - s)``.
    """

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.register_buffer("slopes", torch.tensor(alibi_slopes(n_heads)), persistent=False)  # (H,)

    def forward(self, T_q: int, T_k: int) -> Tensor:
        """The bias ``(H, T_q, T_k)`` for queries at the last ``T_q`` of ``T_k`` positions (a cache's new steps)."""
        device = self.slopes.device
        t = torch.arange(T_k - T_q, T_k, device=device)[:, None]  # (T_q, 1) query positions
        s = torch.arange(T_k, device=device)[None, :]  # (1, T_k) key positions
        return -self.slopes[:, None, None] * (t - s).abs()  # (H, T_q, T_k)
