"""Transformer building blocks (SEEDS.md section 7; Vaswani et al. sections 3.1-3.5).

- :class:`TokenEmbedding`: ``Embedding(x) * sqrt(d_model)`` (section 3.4).
- :class:`SinusoidalPositions` / :class:`LearnedPositions`: ``PE(pos, 2i) = sin(pos / 10000^(2i/d_model))``,
  ``PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))`` (section 3.5), or a learned table.
- :class:`FeedForward`: ``FFN(x) = max(0, x W_1 + b_1) W_2 + b_2`` (section 3.3).
- :func:`input_embedding`: BERT's additions to ``Embed(x) + PE``: a token-type row, then a LayerNorm.

Options that other published models use, each off by default (``attnkit import`` sets them for
Hugging Face checkpoints): the FFN's activation (``gelu`` in BERT, ``swish`` in Marian / OPUS-MT),
no ``sqrt(d_model)`` scale (BERT), the sinusoids laid out in two halves (tensor2tensor, Marian),
a token-type embedding and an embedding LayerNorm (BERT), and the LayerNorm epsilon (BERT: 1e-12).
- :class:`EncoderLayer`: self-attention -> Add & Norm -> FFN -> Add & Norm.
- :class:`DecoderLayer`: masked self-attention -> Add & Norm -> cross-attention -> Add & Norm -> FFN -> Add & Norm.

Dropout (``nn.Dropout`` modules) sits where the paper puts it: on each sub-layer's output before
the residual add and on embeddings + positions (in the models). Dropout on attention weights
and on the FFN activation are extra options (tensor2tensor/fairseq), off by default.
Deviation flag: ``norm_first=True`` gives the pre-norm variant ``x + Sublayer(LayerNorm(x))``
(more stable for deep stacks); the paper's post-norm ``LayerNorm(x + Sublayer(x))`` is the default.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import ScoreName
from .multihead import KVCache, MultiHeadAttention


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
    """``"sinusoidal"`` (laid out as ``layout`` says) or ``"learned"`` positional encoding."""
    if kind == "sinusoidal":
        return SinusoidalPositions(d_model, max_len, layout)
    if kind == "learned":
        return LearnedPositions(d_model, max_len)
    raise ValueError(f"unknown positional encoding {kind!r}; choose sinusoidal or learned")


def xavier_init_(module: nn.Module) -> None:
    """Xavier-uniform for every linear layer's matrix (as fairseq / the Annotated Transformer).

    Embedding tables keep their ``N(0, d^-1/2)`` initialisation, also where an output
    projection is tied to one.
    """
    embedding_weights = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    for m in module.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in embedding_weights:
            nn.init.xavier_uniform_(m.weight)


def input_embedding(x: Tensor, token_types: nn.Embedding | None, norm: nn.LayerNorm | None) -> Tensor:
    """BERT's embedding layer on top of ``x = Embed(tokens) + PE`` ``(B, T, d_model)``:
    ``LayerNorm(x + T[0])``, each part only where the model has it.

    ``T`` is the token-type (segment) table; attnkit reads one segment per text, so every position
    adds row 0. Without either part this returns ``x`` (the paper's models).
    """
    if token_types is not None:
        x = x + token_types.weight[0]  # (B, T, d_model), segment 0 everywhere
    return norm(x) if norm is not None else x


#: The FFN's non-linearity: the paper's ``relu``, BERT's ``gelu`` (exact, erf), Marian's ``swish`` (``x sigmoid(x)``).
Activation = Literal["relu", "gelu", "swish"]
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu}


class FeedForward(nn.Module):
    """Position-wise ``max(0, x W_1 + b_1) W_2 + b_2`` — a 1x1 convolution, as seed 001 puts it.

    ``activation`` replaces ``max(0, .)``: ``gelu(z) = z Phi(z)``, ``swish(z) = z sigmoid(z)``.
    """

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float = 0.0,
                 activation: Activation = "relu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)
        self.activation = ACTIVATIONS[activation]
        self.activation_dropout = nn.Dropout(activation_dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.activation_dropout(self.activation(self.w1(x)))  # (B, T, d_ff)
        return self.w2(h)  # (B, T, d_model)


class _ResidualBlock(nn.Module):
    """Residual wiring shared by encoder and decoder layers ("Add & Norm").

    Post-norm (paper): ``x = Norm(x + Dropout(Sublayer(x)))``.
    Pre-norm:          ``x = x + Dropout(Sublayer(Norm(x)))``.
    ``sublayer_input`` gives what the sub-layer reads (normalised first in pre-norm);
    ``add_residual`` adds its output back (and normalises the sum in post-norm).
    """

    norm_first: bool
    dropout: nn.Dropout

    def sublayer_input(self, x: Tensor, norm: nn.LayerNorm) -> Tensor:
        return norm(x) if self.norm_first else x

    def add_residual(self, x: Tensor, y: Tensor, norm: nn.LayerNorm) -> Tensor:
        x = x + self.dropout(y)  # (B, T, d_model)
        return x if self.norm_first else norm(x)


class EncoderLayer(_ResidualBlock):
    """``x = Norm(x + Dropout(SelfAttn(x)));  x = Norm(x + Dropout(FFN(x)))`` (post-norm; see module doc)."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, *, dropout: float = 0.1,
                 attention_dropout: float = 0.0, activation_dropout: float = 0.0,
                 norm_first: bool = False, eps: float = 1e-5, score: ScoreName = "scaled_dot",
                 activation: Activation = "relu") -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout=attention_dropout, score=score)
        self.ff = FeedForward(d_model, d_ff, activation_dropout, activation)
        self.norm1 = nn.LayerNorm(d_model, eps=eps)
        self.norm2 = nn.LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(dropout)  # on each sub-layer's output
        self.norm_first = norm_first

    def forward(self, x: Tensor, mask: Tensor | None = None, need_weights: bool = False
                ) -> tuple[Tensor, Tensor | None]:
        """``x`` ``(B, T, d_model)``, ``mask`` ``(B, 1, 1, T)`` key padding -> ``(x, weights (B, H, T, T) | None)``."""
        y, weights, _ = self.self_attn(self.sublayer_input(x, self.norm1), None, mask, need_weights=need_weights)
        x = self.add_residual(x, y, self.norm1)
        x = self.add_residual(x, self.ff(self.sublayer_input(x, self.norm2)), self.norm2)
        return x, weights


class DecoderLayer(_ResidualBlock):
    """Masked self-attention, cross-attention to the encoder memory, FFN; each with Add & Norm."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, *, dropout: float = 0.1,
                 attention_dropout: float = 0.0, activation_dropout: float = 0.0,
                 norm_first: bool = False, eps: float = 1e-5, score: ScoreName = "scaled_dot",
                 activation: Activation = "relu") -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout=attention_dropout, score=score)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout=attention_dropout, score=score)
        self.ff = FeedForward(d_model, d_ff, activation_dropout, activation)
        self.norm1 = nn.LayerNorm(d_model, eps=eps)
        self.norm2 = nn.LayerNorm(d_model, eps=eps)
        self.norm3 = nn.LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(dropout)  # on each sub-layer's output
        self.norm_first = norm_first

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        self_mask: Tensor | None,
        memory_mask: Tensor | None,
        *,
        cache: tuple[KVCache, KVCache] | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None, tuple[KVCache, KVCache] | None]:
        """One decoder layer.

        :param x: ``(B, T, d_model)`` target positions (``T = 1`` when decoding step by step).
        :param memory: ``(B, S, d_model)`` encoder output (the engine's beam search passes one row per
            sentence, ``(A, S, d_model)``, shared by ``g = B / A`` consecutive rows of ``x``).
        :param self_mask: look-ahead mask ``(T, T_past + T)``, possibly combined with target padding.
        :param memory_mask: ``(B, 1, 1, S)`` source padding mask.
        :param cache: ``(self-attention cache, cross-attention cache)`` for incremental decoding.
        :param need_weights: also return both attentions' per-head weights.
        :returns: ``(x, (self-attention (B, H, T, T_past + T), cross-attention (B, H, T, S)) | None,
            new cache | None)``.
        """
        self_cache, cross_cache = cache if cache is not None else (None, None)
        y, self_weights, self_cache = self.self_attn(self.sublayer_input(x, self.norm1), None, self_mask,
                                                     cache=self_cache, need_weights=need_weights)
        x = self.add_residual(x, y, self.norm1)
        y, cross_weights, cross_cache = self.cross_attn(self.sublayer_input(x, self.norm2), memory, memory_mask,
                                                        cache=cross_cache, need_weights=need_weights)
        x = self.add_residual(x, y, self.norm2)
        x = self.add_residual(x, self.ff(self.sublayer_input(x, self.norm3)), self.norm3)
        new_cache = (self_cache, cross_cache) if cache is not None else None
        weights = (self_weights, cross_weights) if need_weights else None
        return x, weights, new_cache
