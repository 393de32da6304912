"""A decoder-only Transformer language model, whole: GPT (Radford et al. 2018, 2019) and the Llama family's variants.

    x_0    = Embed(y_1 .. y_T) [+ PE]                       # (B, T, d); no PE for rope, alibi or none
    x      = x + Drop(SelfAttn(Norm_1(x), causal))          # each of the N blocks, pre-norm (GPT-2, Llama)
    x      = x + Drop(FFN(Norm_2(x)))
    logits = Norm(x_N) E^T                                  # (B, T, V), the output layer tied to the embedding E
    p(y_{t+1} | y_1..y_t) = softmax(beta * logits_t)        # sampling at temperature 1 / beta (attnkit.sampling)

It is the seeds' Transformer decoder with the encoder taken away: masked self-attention and the feed-forward
network, no cross-attention. The look-ahead mask is what makes it a language model: position ``t`` predicts
``y_{t+1}`` from ``y_1..y_t`` only, so one forward pass over a block trains every position (teacher forcing).

One Llama block reads in four files: this one (:class:`LMConfig`, :class:`FeedForward` with SwiGLU,
:func:`make_norm` with RMSNorm, :class:`Block`, :class:`LanguageModel`), :mod:`attnkit.multihead` (projections and
grouped-query attention), :mod:`attnkit.attention` (the kernel) and :mod:`attnkit.positions` (the token embedding,
RoPE, ALiBi). The options of today's models are fields of :class:`LMConfig`:

=====================  =======================================================================  ======================
option                 what it does                                                             used by
=====================  =======================================================================  ======================
``positions``          ``learned`` or ``sinusoidal`` tables added to the input; ``rope`` and    GPT-2; Llama, Qwen2;
                       ``alibi`` inside attention; ``none``                                     BLOOM
``n_kv_heads``         grouped-query attention: fewer key/value heads, each shared by           Llama 2 70B, Mistral
                       ``n_heads / n_kv_heads`` query heads (1: multi-query)
``window``             sliding-window attention: each position sees the last ``window``         Mistral
``norm``, ``norm_eps``  LayerNorm, or RMSNorm ``x / sqrt(mean(x^2) + eps) * g``                   GPT-2; Llama
``activation``         the FFN's non-linearity: ``gelu``, ``gelu_tanh``, ``relu``, ``swish``,   GPT-2 (gelu_tanh);
                       or the gated ``swiglu``                                                  Llama
``bias``, ``qkv_bias``  biases in the projections, or on query, key and value only              GPT-2; Qwen2
``norm_first``         pre-norm (the default here) or the paper's post-norm                     GPT-1 (post)
=====================  =======================================================================  ======================

Generation feeds one token at a time through :meth:`LanguageModel.step` with a key/value cache per layer
(:class:`~attnkit.multihead.KVCache`, ``H_kv`` heads under grouped-query attention); :mod:`attnkit.sampling` chooses
the tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import ScoreName, sliding_window_mask
from .multihead import KVCache, MultiHeadAttention
from .positions import (
    ADDITIVE_POSITIONS,
    ALiBi,
    PositionKind,
    PositionLayout,
    RotaryPositions,
    TokenEmbedding,
    make_positions,
)
from .vocab import PAD_ID

#: GPT-2's initialisation: N(0, 0.02) for every matrix (Radford et al. 2019, section 2.3).
INIT_STD = 0.02
#: The fixed logit of an absent id (a special id an imported vocabulary has no piece for): its probability is 0
#: beside any real logit (exp underflows), yet finite, so that sums over the logits (a label-smoothing term) stay
#: finite, and representable in float16.
ABSENT_LOGIT = -1e4

#: The FFN's non-linearity: the paper's ``relu``, BERT's ``gelu`` (exact, erf), GPT-2's ``gelu_tanh`` (the tanh
#: approximation), Marian's ``swish`` (``x sigmoid(x)``), or Llama's gated ``swiglu``.
Activation = Literal["relu", "gelu", "gelu_tanh", "swish", "swiglu"]
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu, "gelu": F.gelu, "gelu_tanh": partial(F.gelu, approximate="tanh"), "swish": F.silu,
    "swiglu": F.silu}
#: The "Norm" of Add & Norm.
NormKind = Literal["layernorm", "rmsnorm"]


@dataclass
class LMConfig:
    """A language model's sizes and options (module docstring); a run's ``model.transformer`` section holds them."""

    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 1024
    decoder_layers: int = 3  # the depth N
    dropout: float = 0.1  # on the input embedding and each block's two outputs
    attention_dropout: float = 0.0  # on the attention weights
    activation_dropout: float = 0.0  # after the FFN's non-linearity
    norm_first: bool | None = None  # pre-norm (None or True), or post-norm: Norm(x + Drop(Sublayer(x)))
    positions: PositionKind = "sinusoidal"
    attention_score: ScoreName = "scaled_dot"  # dot: no 1/sqrt(d_k) (seed 003's experiment)
    max_len: int = 1024  # rows of a table of positions; a rope/alibi/none model's trained context when imported
    tie_output: bool = True  # the output layer is the embedding matrix E
    activation: Activation = "relu"
    scale_embeddings: bool = True  # Embed(y) * sqrt(d_model) (Vaswani et al. 3.4); GPT-2 does not scale
    position_layout: PositionLayout = "interleaved"  # a sinusoidal table's sines and cosines: alternate, or halves
    norm_eps: float = 1e-5
    output_bias: bool = False  # a bias on the output layer
    rope_theta: float = 10000.0  # RoPE's base
    n_kv_heads: int = 0  # grouped-query attention's key/value heads (0: n_heads)
    window: int = 0  # sliding-window attention (0: every earlier position)
    norm: NormKind = "layernorm"
    bias: bool = True  # biases in the attention and FFN projections (Llama: none)
    qkv_bias: bool = False  # biases on the query, key and value projections even when bias is false (Qwen2)

    @classmethod
    def of(cls, config: Any) -> LMConfig:
        """The fields of ``config`` (a run's ``model.transformer``) that a language model has; an encoder's options
        (BERT's token types and embedding norm) are refused, the encoder-decoder's (``encoder_layers``,
        ``share_embeddings``) not read."""
        if getattr(config, "token_types", 0) or getattr(config, "embedding_norm", False):
            raise ValueError("a language model has no token types or embedding norm (token_types, embedding_norm: "
                             "BERT's); leave them at 0 and false")
        return config if isinstance(config, cls) else cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    def validate(self) -> None:
        """:raises ValueError: for sizes no model can have (the config loader reports it with the key)."""
        check_sizes(self)


def check_sizes(cfg: Any) -> None:
    """:raises ValueError: ``cfg`` (an :class:`LMConfig`, or the encoder-decoder's config, which has these fields
    too) has sizes no model can have: heads that do not divide the width, key/value heads that do not divide the
    heads, a negative window, a RoPE head of odd size, biases asked for twice."""
    if cfg.n_heads < 1 or cfg.d_model < 1 or cfg.d_model % cfg.n_heads:
        raise ValueError(f"d_model ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads}), both positive")
    if cfg.n_kv_heads < 0 or (cfg.n_kv_heads and cfg.n_heads % cfg.n_kv_heads):
        raise ValueError(f"n_kv_heads ({cfg.n_kv_heads}) must divide n_heads ({cfg.n_heads}), or be 0")
    if cfg.window < 0 or not cfg.rope_theta > 0 or not cfg.norm_eps > 0:
        raise ValueError(f"window ({cfg.window}) must be >= 0, rope_theta ({cfg.rope_theta}) and norm_eps "
                         f"({cfg.norm_eps}) > 0")
    if cfg.qkv_bias and cfg.bias:
        raise ValueError("qkv_bias: true adds only the query, key and value biases, which bias: true already "
                         "has; set bias: false with it")
    if cfg.positions == "rope" and (cfg.d_model // cfg.n_heads) % 2:
        raise ValueError(f"rope rotates pairs of dimensions: the head size d_model / n_heads "
                         f"({cfg.d_model // cfg.n_heads}) must be even")


def make_norm(kind: NormKind, d_model: int, eps: float = 1e-5) -> nn.Module:
    """``layernorm``: ``(x - mean(x)) / sqrt(var(x) + eps) * g + b`` (Ba et al. 2016), or
    ``rmsnorm``: ``x / sqrt(mean(x^2) + eps) * g``, no centring and no bias (Zhang & Sennrich 2019; Llama)."""
    if kind == "layernorm":
        return nn.LayerNorm(d_model, eps=eps)
    if kind == "rmsnorm":
        return nn.RMSNorm(d_model, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; choose layernorm or rmsnorm")


class FeedForward(nn.Module):
    """Position-wise ``max(0, x W_1 + b_1) W_2 + b_2`` (Vaswani et al. 3.3) — a 1x1 convolution, as seed 001 puts it.

    ``activation`` replaces ``max(0, .)``: ``gelu(z) = z Phi(z)``, ``swish(z) = z sigmoid(z)``. ``swiglu`` is gated
    (Shazeer 2020, "GLU Variants Improve Transformer"; Llama): ``FFN(x) = (swish(x W_1) * x W_3) W_2`` with a third
    matrix ``W_3`` (the "up" projection; ``W_1`` is the gate). The encoder-decoder's layers use it too.
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


class Block(nn.Module):
    """One layer of the decoder-only model: masked self-attention, then the FFN, each a residual branch.

    Pre-norm (GPT-2, Llama)::

        x = x + Drop(SelfAttn(Norm_1(x)))       # causal: position t sees 1..t (within the window)
        x = x + Drop(FFN(Norm_2(x)))

    Post-norm (``norm_first: false``, the paper and GPT-1): ``x = Norm(x + Drop(Sublayer(x)))``.
    """

    def __init__(self, cfg: LMConfig, rotary: RotaryPositions | None = None, alibi: ALiBi | None = None) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, dropout=cfg.attention_dropout,
                                            score=cfg.attention_score, bias=cfg.bias, qkv_bias=cfg.qkv_bias,
                                            n_kv_heads=cfg.n_kv_heads or None, rotary=rotary, alibi=alibi,
                                            causal=True)
        self.ff = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout, cfg.activation, bias=cfg.bias)
        self.norm1 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)  # on each branch's output
        self.norm2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.norm_first = cfg.norm_first is not False

    def forward(self, x: Tensor, mask: Tensor | None = None, cache: KVCache | None = None, *,
                need_weights: bool = False, offset: Tensor | None = None
                ) -> tuple[Tensor, Tensor | None, KVCache | None]:
        """``x`` ``(B, T, d_model)`` -> ``(x, self-attention (B, H, T, t + T) | None, new cache | None)``.

        :param mask: what a query may see besides the look-ahead mask, ``(T, t + T)`` or ``(B, 1, T, t + T)`` (a
            window; a continuous batch's padding).
        :param cache: the keys and values of the ``t`` positions before (None: no cache kept).
        :param offset: ``(B,)`` each row's position of its first query, when rows are at different positions (RoPE).
        """
        h = self.norm1(x) if self.norm_first else x
        y, weights, cache = self.self_attn(h, None, mask, cache=cache, need_weights=need_weights, offset=offset)
        x = x + self.dropout(y)  # (B, T, d_model)
        x = x if self.norm_first else self.norm1(x)
        h = self.norm2(x) if self.norm_first else x
        x = x + self.dropout(self.ff(h))
        return (x if self.norm_first else self.norm2(x)), weights, cache


@dataclass
class LMState:
    """What generation carries from step to step: one self-attention cache per layer and the positions seen."""

    caches: list[KVCache]  # per layer: keys, values (B, H_kv, t, d_k)
    length: int  # t, positions already in the caches

    def select(self, index: Tensor) -> LMState:
        """Keep / reorder / repeat batch rows; ``index`` ``(B',)``."""
        return LMState([c.select(index) for c in self.caches], self.length)


class LanguageModel(nn.Module):
    """Decoder-only Transformer returning next-token logits; loss, sampling and precision live elsewhere.

    :param cfg: sizes and options (:class:`LMConfig`, or a run's ``model.transformer``: :meth:`LMConfig.of`).
    :param vocab_size: the tokenizer's vocabulary.
    :param absent_ids: ids the tokenizer has no piece for (an imported GPT-2 has no pad, unk or bos;
        :attr:`attnkit.data.tokenizer.Tokenizer.absent_ids`): their logit is always :data:`ABSENT_LOGIT`, a fixed
        output bias that is not trained and not saved.
    """

    pad_id = PAD_ID

    def __init__(self, cfg: Any, vocab_size: int, pad_id: int = PAD_ID, absent_ids: Sequence[int] = ()) -> None:
        super().__init__()
        cfg = LMConfig.of(cfg)
        cfg.validate()
        self.cfg = cfg
        d, H = cfg.d_model, cfg.n_heads
        self.embed = TokenEmbedding(vocab_size, d, pad_id, scale=cfg.scale_embeddings)
        # positions: a table added to the input, or a module every attention layer shares (or none at all)
        self.positions = (make_positions(cfg.positions, d, cfg.max_len, cfg.position_layout)
                          if cfg.positions in ADDITIVE_POSITIONS else None)
        rotary = RotaryPositions(d // H, cfg.rope_theta) if cfg.positions == "rope" else None
        alibi = ALiBi(H) if cfg.positions == "alibi" else None
        self.dropout = nn.Dropout(cfg.dropout)  # on the input embedding
        self.layers = nn.ModuleList(Block(cfg, rotary, alibi) for _ in range(cfg.decoder_layers))
        self.final_norm = make_norm(cfg.norm, d, cfg.norm_eps) if cfg.norm_first is not False else None
        self.out_proj = nn.Linear(d, vocab_size, bias=cfg.output_bias)
        if cfg.tie_output:
            self.out_proj.weight = self.embed.weight
        gpt2_init_(self, cfg.decoder_layers)
        if absent_ids:
            if cfg.output_bias:
                raise ValueError("a language model over a vocabulary with absent ids has a fixed output bias; "
                                 "model.transformer.output_bias must be false")
            fixed = torch.zeros(vocab_size)
            fixed[list(absent_ids)] = ABSENT_LOGIT
            del self.out_proj.bias  # the Linear's (None) bias parameter, replaced by a buffer: fixed, not saved
            self.out_proj.register_buffer("bias", fixed, persistent=False)

    @property
    def output_layer(self) -> nn.Linear:
        """The projection to the vocabulary (tied to the embedding by default)."""
        return self.out_proj

    @property
    def context(self) -> int | None:
        """The most positions the model can see: ``max_len`` for learned or sinusoidal tables, else None (any)."""
        return self.cfg.max_len if self.positions is not None else None

    def self_mask(self, T_q: int, T_k: int, device: torch.device) -> Tensor | None:
        """The mask each layer adds to its own look-ahead mask: the sliding window ``(T_q, T_k)``, if any."""
        return sliding_window_mask(T_q, T_k, self.cfg.window, device=device) if self.cfg.window else None

    def embed_input(self, tokens: Tensor, offset: int = 0) -> Tensor:
        """``Dropout(Embed(y) [+ PE])`` for ``tokens`` ``(B, T)`` at positions ``offset..offset+T-1``."""
        x = self.embed(tokens)  # (B, T, d_model)
        if self.positions is not None:
            x = x + self.positions(tokens.size(1), offset=offset)  # + PE (T, d_model)
        return self.dropout(x)

    def decode_layers(self, x: Tensor, mask: Tensor | None, caches: list[KVCache] | None, *,
                      offset: Tensor | None = None, need_weights: bool = False
                      ) -> tuple[Tensor, list[Tensor], list[KVCache]]:
        """The blocks and the final norm on the embedded input ``x`` ``(B, T, d_model)``.

        :param mask: what each query may see besides the look-ahead mask (the window; a continuous batch's padding).
        :param caches: one per layer, or None (no cache kept).
        :param offset: ``(B,)`` each row's position of its first query (rows at different positions; RoPE).
        :returns: ``(hidden (B, T, d_model), per-layer self-attention when need_weights, new caches or [])``.
        """
        new_caches, all_weights = [], []
        for layer, cache in zip(self.layers, caches or [None] * len(self.layers), strict=True):
            x, weights, cache = layer(x, mask, cache, need_weights=need_weights, offset=offset)
            if cache is not None:
                new_caches.append(cache)
            if weights is not None:
                all_weights.append(weights)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, all_weights, new_caches

    def features(self, tokens: Tensor, state: LMState | None = None, *, need_weights: bool = False
                 ) -> tuple[Tensor, list[Tensor], LMState | None]:
        """The final hidden states ``(B, T, d_model)`` of ``tokens`` ``(B, T)``, which follow ``state``'s positions.

        :returns: ``(hidden, per-layer self-attention (B, H, T, t + T) when need_weights, new state or None)``.
        """
        offset = state.length if state is not None else 0
        T = tokens.size(1)
        x = self.embed_input(tokens, offset)  # (B, T, d_model)
        mask = self.self_mask(T, offset + T, tokens.device)  # (T, t + T) or None
        x, all_weights, new_caches = self.decode_layers(x, mask, state.caches if state is not None else None,
                                                        need_weights=need_weights)
        return x, all_weights, (LMState(new_caches, offset + T) if state is not None else None)

    def forward(self, tokens: Tensor) -> Tensor:
        """Teacher forcing: ``tokens`` ``(B, T)`` -> next-token logits ``(B, T, V)`` (row ``t`` predicts ``t + 1``)."""
        hidden, _, _ = self.features(tokens)
        return self.out_proj(hidden)

    def attention_weights(self, tokens: Tensor) -> list[Tensor]:
        """Per-layer causal self-attention ``(B, H, T, T)`` over ``tokens`` (for inspection)."""
        return self.features(tokens, need_weights=True)[1]

    # -- the single-step interface of generation (attnkit.sampling) ------------------------------------------

    def init_state(self) -> LMState:
        """An empty cache: nothing seen yet."""
        return LMState([KVCache() for _ in self.layers], 0)

    def step(self, tokens: Tensor, state: LMState) -> tuple[Tensor, LMState]:
        """Feed ``tokens`` ``(B, T)`` (a prompt, then one token at a time) -> ``(logits of the last position (B, V),
        new state)``; the same logits as :meth:`forward` on the whole sequence."""
        hidden, _, new_state = self.features(tokens, state)
        return self.out_proj(hidden[:, -1]), cast(LMState, new_state)  # a state in, a state out


def gpt2_init_(model: nn.Module, n_layers: int) -> None:
    """GPT-2's initialisation: every linear map ``N(0, 0.02)``, biases 0, and the projections that end a residual
    branch (attention's ``W^O``, the FFN's ``W_2``) ``N(0, 0.02 / sqrt(2 N))`` for ``N`` layers, so the residual
    stream's variance does not grow with depth (Radford et al. 2019, section 2.3).

    The embeddings follow ``scale_embeddings``: unscaled (GPT-2) they are ``N(0, 0.02)`` like the learned position
    table; scaled by ``sqrt(d_model)`` (the paper) they keep :class:`~attnkit.positions.TokenEmbedding`'s
    ``N(0, d^-1/2)``, so that ``Embed(y)`` has unit variance, as the sinusoids it is added to do. (Unscaled
    ``N(0, 0.02)`` embeddings under unit sinusoids carry almost no token information, and such a model stays on
    the unigram plateau.)"""
    embed = getattr(model, "embed", None)
    keep = set()
    if isinstance(embed, TokenEmbedding) and embed.scale != 1.0:
        positions = getattr(model, "positions", None)
        keep = {id(embed.weight)} | ({id(p) for p in positions.parameters()} if positions is not None else set())
    for name, p in model.named_parameters():
        if id(p) in keep:
            continue
        if p.dim() < 2:
            if name.endswith("bias"):
                nn.init.zeros_(p)
            continue
        std = INIT_STD / math.sqrt(2 * n_layers) if name.endswith(("out_proj.weight", "ff.w2.weight")) and \
            name.startswith("layers.") else INIT_STD
        nn.init.normal_(p, 0.0, std)
    if isinstance(embed, TokenEmbedding) and embed.embedding.padding_idx is not None:
        with torch.no_grad():
            embed.weight[embed.embedding.padding_idx].zero_()
