"""Transformer building blocks (SEEDS.md section 7; Vaswani et al. sections 3.1-3.5).

- :class:`TokenEmbedding`: ``Embedding(x) * sqrt(d_model)`` (section 3.4).
- positions (section 3.5, and the ones today's models use) are in :mod:`attnkit.positions`.
- :class:`FeedForward`: ``FFN(x) = max(0, x W_1 + b_1) W_2 + b_2`` (section 3.3), or the gated SwiGLU.
- :func:`make_norm`: the "Norm" of Add & Norm, LayerNorm (Ba et al. 2016) or RMSNorm.
- :func:`input_embedding`: BERT's additions to ``Embed(x) + PE``: a token-type row, then a LayerNorm.

Options that other published models use, each off by default (``attnkit import`` sets them for
Hugging Face checkpoints): the FFN's activation (``gelu`` in BERT, ``swish`` in Marian / OPUS-MT),
no ``sqrt(d_model)`` scale (BERT), the sinusoids laid out in two halves (tensor2tensor, Marian),
a token-type embedding and an embedding LayerNorm (BERT), and the LayerNorm epsilon (BERT: 1e-12);
and for decoder-only models (GPT-2, Llama): RMSNorm, SwiGLU, no biases (or biases on the query, key and value
projections only: Qwen2), grouped-query attention and positions inside attention (RoPE, ALiBi;
:mod:`attnkit.positions`).
- :class:`EncoderLayer`: self-attention -> Add & Norm -> FFN -> Add & Norm.
- :class:`DecoderLayer`: masked self-attention -> Add & Norm -> cross-attention -> Add & Norm -> FFN -> Add & Norm;
  without cross-attention (``cross_attention=False``) it is the layer of a decoder-only language model.

Dropout (``nn.Dropout`` modules) sits where the paper puts it: on each sub-layer's output before
the residual add and on embeddings + positions (in the models). Dropout on attention weights
and on the FFN activation are extra options (tensor2tensor/fairseq), off by default.
Deviation flag: ``norm_first=True`` gives the pre-norm variant ``x + Sublayer(LayerNorm(x))``
(more stable for deep stacks); the paper's post-norm ``LayerNorm(x + Sublayer(x))`` is the default.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import ScoreName
from .multihead import KVCache, MultiHeadAttention
from .positions import ALiBi, RotaryPositions


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


#: The FFN's non-linearity: the paper's ``relu``, BERT's ``gelu`` (exact, erf), GPT-2's ``gelu_tanh`` (the tanh
#: approximation), Marian's ``swish`` (``x sigmoid(x)``), or Llama's gated ``swiglu``.
Activation = Literal["relu", "gelu", "gelu_tanh", "swish", "swiglu"]
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu, "gelu": F.gelu, "gelu_tanh": partial(F.gelu, approximate="tanh"), "swish": F.silu,
    "swiglu": F.silu}
#: The "Norm" of Add & Norm.
NormKind = Literal["layernorm", "rmsnorm"]


def make_norm(kind: NormKind, d_model: int, eps: float = 1e-5) -> nn.Module:
    """``layernorm``: ``(x - mean(x)) / sqrt(var(x) + eps) * g + b`` (Ba et al. 2016), or
    ``rmsnorm``: ``x / sqrt(mean(x^2) + eps) * g``, no centring and no bias (Zhang & Sennrich 2019; Llama)."""
    if kind == "layernorm":
        return nn.LayerNorm(d_model, eps=eps)
    if kind == "rmsnorm":
        return nn.RMSNorm(d_model, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; choose layernorm or rmsnorm")


class FeedForward(nn.Module):
    """Position-wise ``max(0, x W_1 + b_1) W_2 + b_2`` — a 1x1 convolution, as seed 001 puts it.

    ``activation`` replaces ``max(0, .)``: ``gelu(z) = z Phi(z)``, ``swish(z) = z sigmoid(z)``.
    ``swiglu`` is gated (Shazeer 2020, "GLU Variants Improve Transformer"; Llama):
    ``FFN(x) = (swish(x W_1) * x W_3) W_2`` with a third matrix ``W_3`` (the "up" projection; ``W_1`` is the gate).
    """

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float = 0.0,
                 activation: Activation = "relu", bias: bool = True) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
        self.w1 = nn.Linear(d_model, d_ff, bias=bias)
        self.w2 = nn.Linear(d_ff, d_model, bias=bias)
        self.w3 = nn.Linear(d_model, d_ff, bias=bias) if activation == "swiglu" else None
        self.activation = ACTIVATIONS[activation]
        self.activation_dropout = nn.Dropout(activation_dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.activation(self.w1(x))  # (B, T, d_ff)
        if self.w3 is not None:
            h = h * self.w3(x)  # SwiGLU's gate
        return self.w2(self.activation_dropout(h))  # (B, T, d_model)


@dataclass(frozen=True)
class LayerOptions:
    """How a layer is built beyond its sizes; the defaults are the paper's layer (:data:`PAPER_LAYER`)."""

    dropout: float = 0.1  # on each sub-layer's output (the paper's P_drop)
    attention_dropout: float = 0.0  # on the attention weights (not in the paper)
    activation_dropout: float = 0.0  # after the FFN's non-linearity (not in the paper)
    norm_first: bool = False  # pre-norm x + Sublayer(Norm(x)) instead of the paper's post-norm
    eps: float = 1e-5  # the norms' epsilon
    score: ScoreName = "scaled_dot"
    activation: Activation = "relu"
    norm: NormKind = "layernorm"
    bias: bool = True  # biases in the attention projections and the FFN (Llama has none)
    qkv_bias: bool = False  # biases on the query, key and value projections even without ``bias`` (Qwen2)
    n_kv_heads: int | None = None  # grouped-query attention: key/value heads (None: n_heads)
    rotary: RotaryPositions | None = field(default=None, compare=False)  # RoPE, shared by every layer
    alibi: ALiBi | None = field(default=None, compare=False)  # ALiBi, shared by every layer


PAPER_LAYER = LayerOptions()


class _ResidualBlock(nn.Module):
    """Residual wiring shared by encoder and decoder layers ("Add & Norm").

    Post-norm (paper): ``x = Norm(x + Dropout(Sublayer(x)))``.
    Pre-norm:          ``x = x + Dropout(Sublayer(Norm(x)))``.
    ``sublayer_input`` gives what the sub-layer reads (normalised first in pre-norm);
    ``add_residual`` adds its output back (and normalises the sum in post-norm).
    """

    norm_first: bool
    dropout: nn.Dropout

    def sublayer_input(self, x: Tensor, norm: nn.Module) -> Tensor:
        return norm(x) if self.norm_first else x

    def add_residual(self, x: Tensor, y: Tensor, norm: nn.Module) -> Tensor:
        x = x + self.dropout(y)  # (B, T, d_model)
        return x if self.norm_first else norm(x)

    def attention(self, d_model: int, n_heads: int, o: LayerOptions, causal: bool = False) -> MultiHeadAttention:
        """A multi-head attention sub-layer built with ``o``."""
        return MultiHeadAttention(d_model, n_heads, dropout=o.attention_dropout, score=o.score, bias=o.bias,
                                  qkv_bias=o.qkv_bias, n_kv_heads=o.n_kv_heads, rotary=o.rotary, alibi=o.alibi,
                                  causal=causal)

    def build(self, d_model: int, n_heads: int, d_ff: int, o: LayerOptions, *, causal: bool = False,
              cross_attention: bool = False) -> None:
        """What every layer has: self-attention (then cross-attention, if asked for), the FFN, the residual
        dropout and (``norm1``) the first norm. Built in this order, the paper's layers draw their initial
        weights as they always have."""
        self.self_attn = self.attention(d_model, n_heads, o, causal)
        if cross_attention:
            self.cross_attn = self.attention(d_model, n_heads, o)
        self.ff = FeedForward(d_model, d_ff, o.activation_dropout, o.activation, bias=o.bias)
        self.norm1 = make_norm(o.norm, d_model, o.eps)
        self.dropout = nn.Dropout(o.dropout)  # on each sub-layer's output
        self.norm_first = o.norm_first


class EncoderLayer(_ResidualBlock):
    """``x = Norm(x + Dropout(SelfAttn(x)));  x = Norm(x + Dropout(FFN(x)))`` (post-norm; see module doc)."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, options: LayerOptions = PAPER_LAYER) -> None:
        super().__init__()
        self.build(d_model, n_heads, d_ff, options)
        self.norm2 = make_norm(options.norm, d_model, options.eps)

    def forward(self, x: Tensor, mask: Tensor | None = None, need_weights: bool = False
                ) -> tuple[Tensor, Tensor | None]:
        """``x`` ``(B, T, d_model)``, ``mask`` ``(B, 1, 1, T)`` key padding -> ``(x, weights (B, H, T, T) | None)``."""
        y, weights, _ = self.self_attn(self.sublayer_input(x, self.norm1), None, mask, need_weights=need_weights)
        x = self.add_residual(x, y, self.norm1)
        x = self.add_residual(x, self.ff(self.sublayer_input(x, self.norm2)), self.norm2)
        return x, weights


class DecoderLayer(_ResidualBlock):
    """Masked self-attention, cross-attention to the encoder memory, FFN; each with Add & Norm.

    With ``cross_attention=False`` there is no encoder: masked self-attention and the FFN, the layer of a
    decoder-only language model (GPT; :mod:`attnkit.lm`). Its self-attention then applies the look-ahead
    mask itself (``causal``). The norms are numbered in the order their sub-layers run.
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, options: LayerOptions = PAPER_LAYER, *,
                 cross_attention: bool = True) -> None:
        super().__init__()
        self.cross_attn: MultiHeadAttention | None = None
        self.build(d_model, n_heads, d_ff, options, causal=not cross_attention, cross_attention=cross_attention)
        self.norm2 = make_norm(options.norm, d_model, options.eps)
        self.norm3 = make_norm(options.norm, d_model, options.eps) if cross_attention else None

    @property
    def ff_norm(self) -> nn.Module:
        """The norm of the FFN sub-layer: the third (after cross-attention's), or the second without it."""
        return self.norm3 if self.norm3 is not None else self.norm2

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None,
        self_mask: Tensor | None,
        memory_mask: Tensor | None,
        *,
        cache: tuple[KVCache, KVCache | None] | None = None,
        need_weights: bool = False,
        offset: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor | None] | None, tuple[KVCache, KVCache | None] | None]:
        """One decoder layer.

        :param x: ``(B, T, d_model)`` target positions (``T = 1`` when decoding step by step).
        :param memory: ``(B, S, d_model)`` encoder output; None without cross-attention.
        :param self_mask: look-ahead mask ``(T, T_past + T)``, possibly combined with target padding (a
            decoder-only layer applies the look-ahead mask itself; this may add a sliding window).
        :param memory_mask: ``(B, 1, 1, S)`` source padding mask.
        :param cache: ``(self-attention cache, cross-attention cache or None)`` for incremental decoding.
        :param need_weights: also return both attentions' per-head weights.
        :param offset: ``(B,)`` each row's position of its first query when rows are at different positions
            (RoPE; :meth:`~attnkit.multihead.MultiHeadAttention.forward`).
        :returns: ``(x, (self-attention (B, H, T, T_past + T), cross-attention (B, H, T, S) or None) | None,
            new cache | None)``.
        """
        self_cache, cross_cache = cache if cache is not None else (None, None)
        y, self_weights, self_cache = self.self_attn(self.sublayer_input(x, self.norm1), None, self_mask,
                                                     cache=self_cache, need_weights=need_weights, offset=offset)
        x = self.add_residual(x, y, self.norm1)
        cross_weights = None
        if self.cross_attn is not None:
            y, cross_weights, cross_cache = self.cross_attn(self.sublayer_input(x, self.norm2), memory, memory_mask,
                                                            cache=cross_cache, need_weights=need_weights)
            x = self.add_residual(x, y, self.norm2)
        x = self.add_residual(x, self.ff(self.sublayer_input(x, self.ff_norm)), self.ff_norm)
        new_cache = (self_cache, cross_cache) if cache is not None else None
        weights = (self_weights, cross_weights) if need_weights else None
        return x, weights, new_cache
