"""The Transformer encoder-decoder (SEEDS.md section 7; Vaswani et al. 2017, figure 1).

    memory = Encoder(Embed(src) + PE)                                   # N encoder layers
    logits = Decoder(Embed(<s> y_1 .. y_{t-1}) + PE, memory) W_out       # N decoder layers, look-ahead mask

Training uses teacher forcing (the whole shifted target at once, :meth:`Transformer.forward`).
Generation starts from ``<s>`` and feeds back each output until ``</s>`` through the
single-step interface :meth:`Transformer.init_decoder` / :meth:`Transformer.decode_step`,
shared with the RNN models so one search implementation serves both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn

from .attention import causal_mask, padding_mask
from .layers import DecoderLayer, EncoderLayer, LayerOptions, input_embedding, xavier_init_
from .lm import Activation, NormKind, check_sizes, make_norm
from .multihead import KVCache
from .positions import ADDITIVE_POSITIONS, PositionKind, PositionLayout, TokenEmbedding, make_positions
from .vocab import BOS_ID, EOS_ID, PAD_ID


@dataclass
class TransformerConfig:
    """Model dimensions. Presets: :data:`PRESETS` (``base`` and ``big`` are the paper's)."""

    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 1024
    encoder_layers: int = 3
    decoder_layers: int = 3
    dropout: float = 0.1  # residual and embedding dropout (the paper's P_drop)
    attention_dropout: float = 0.0  # on attention weights (not in the paper)
    activation_dropout: float = 0.0  # after the FFN ReLU (not in the paper)
    norm_first: bool | None = None  # pre-norm instead of the paper's post-norm (None: post-norm, but pre-norm
    #                                 for a decoder-only language model, as GPT-2 and every model since)
    positions: PositionKind = "sinusoidal"  # rope, alibi and none: language models only (attnkit.positions)
    attention_score: Literal["scaled_dot", "dot"] = "scaled_dot"  # dot: no 1/sqrt(d_k) (seed 003 experiment)
    max_len: int = 1024
    share_embeddings: bool = True  # one embedding for source and target (needs a joint vocabulary)
    tie_output: bool = True  # output projection = target embedding matrix
    # -- options of other published models, off by default (`attnkit import` sets them; see attnkit.layers) --
    activation: Activation = "relu"  # the FFN's non-linearity: relu (the paper), gelu (BERT), swish (Marian)
    scale_embeddings: bool = True  # token embeddings x sqrt(d_model) (section 3.4); BERT does not scale
    position_layout: PositionLayout = "interleaved"  # sinusoids in alternate dims, or sines then cosines (Marian)
    token_types: int = 0  # > 0: a token-type (segment) table of this many rows; every position adds row 0 (BERT)
    embedding_norm: bool = False  # a LayerNorm over embeddings + positions (BERT)
    norm_eps: float = 1e-5  # every LayerNorm's epsilon (BERT: 1e-12)
    output_bias: bool = False  # a bias on the output projection (Marian's final_logits_bias)
    # -- what decoder-only language models use (task: lm; attnkit.lm), each off by default --
    rope_theta: float = 10000.0  # positions: rope, the base of its angles
    n_kv_heads: int = 0  # grouped-query attention: key/value heads (0: n_heads, multi-head; 1: multi-query)
    window: int = 0  # sliding-window attention: each position sees this many (0: all earlier positions)
    norm: NormKind = "layernorm"  # or rmsnorm (Llama)
    bias: bool = True  # biases in the attention and FFN projections (Llama: none)
    qkv_bias: bool = False  # biases on the query, key and value projections even when bias: false (Qwen2)

    def validate(self) -> None:
        """:raises ValueError: for dimensions no model can have (the config loader reports it with the key)."""
        if self.token_types < 0:
            raise ValueError(f"token_types ({self.token_types}) must be >= 0")
        check_sizes(self)

    def language_model_options(self) -> list[str]:
        """The options set here that only a decoder-only language model has (none for an encoder-decoder)."""
        defaults = TransformerConfig()
        found = [f"positions: {self.positions}"] if self.positions not in ADDITIVE_POSITIONS else []
        keys = ("n_kv_heads", "window", "norm", "bias", "qkv_bias")
        found += [f"{key}: {getattr(self, key)}" for key in keys if getattr(self, key) != getattr(defaults, key)]
        return found + ([f"activation: {self.activation}"] if self.activation in ("swiglu", "gelu_tanh") else [])

    def layer_options(self, norm_first_default: bool = False) -> LayerOptions:
        """How each layer is built (positions inside attention are added by the model that owns them);
        ``norm_first_default`` is the model's convention where ``norm_first`` is None."""
        norm_first = norm_first_default if self.norm_first is None else self.norm_first
        return LayerOptions(dropout=self.dropout, attention_dropout=self.attention_dropout,
                            activation_dropout=self.activation_dropout, norm_first=norm_first,
                            eps=self.norm_eps, score=self.attention_score, activation=self.activation,
                            norm=self.norm, bias=self.bias, qkv_bias=self.qkv_bias,
                            n_kv_heads=self.n_kv_heads or None)


PRESETS: dict[str, TransformerConfig] = {
    "tiny": TransformerConfig(d_model=64, n_heads=4, d_ff=256, encoder_layers=2, decoder_layers=2),
    "small": TransformerConfig(d_model=256, n_heads=4, d_ff=1024, encoder_layers=3, decoder_layers=3),
    "base": TransformerConfig(d_model=512, n_heads=8, d_ff=2048, encoder_layers=6, decoder_layers=6, dropout=0.1),
    "big": TransformerConfig(d_model=1024, n_heads=16, d_ff=4096, encoder_layers=6, decoder_layers=6, dropout=0.3),
}


def preset(name: str, **changes: object) -> TransformerConfig:
    """A copy of preset ``name`` with ``changes`` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **changes)


def require_paper_layers(cfg: TransformerConfig, model: str) -> None:
    """Refuse the language-model-only options for an encoder or encoder-decoder (its exports know none of them)."""
    found = cfg.language_model_options()
    if found:
        raise ValueError(f"{model} does not take {', '.join(found)}: these are options of a decoder-only "
                         f"language model (task: lm)")


def layer_stack(layer: type[EncoderLayer] | type[DecoderLayer], cfg: TransformerConfig, n: int) -> nn.ModuleList:
    """``n`` identical :class:`EncoderLayer` s or :class:`DecoderLayer` s, sized and regularised by ``cfg``."""
    return nn.ModuleList(layer(cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.layer_options()) for _ in range(n))


class InputEmbedding(nn.Module):
    """What a stack reads: ``Dropout(Embed(x) + PE)``, with BERT's token type and LayerNorm where configured.

    Holds no weights of its own (the stack owns them, under the names its checkpoints have always had);
    :meth:`embed_input` is the one place a stack's input is put together.
    """

    embed: TokenEmbedding
    positions: nn.Module | None  # None when positions act inside attention (rope, alibi) or there are none
    token_type: nn.Embedding | None
    embed_norm: nn.LayerNorm | None
    dropout: nn.Dropout

    def add_embedding_options(self, cfg: TransformerConfig) -> None:
        """The optional token-type table and embedding LayerNorm of ``cfg`` (none by default)."""
        self.token_type = nn.Embedding(cfg.token_types, cfg.d_model) if cfg.token_types else None
        if self.token_type is not None:
            nn.init.normal_(self.token_type.weight, 0.0, cfg.d_model ** -0.5)
        self.embed_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.embedding_norm else None

    def embed_input(self, tokens: Tensor, offset: int = 0) -> Tensor:
        """``tokens`` ``(B, T)`` at positions ``offset..offset+T-1`` -> ``(B, T, d_model)``."""
        x = self.embed(tokens)  # (B, T, d_model)
        if self.positions is not None:
            x = x + self.positions(tokens.size(1), offset=offset)  # + PE (T, d_model)
        return self.dropout(input_embedding(x, self.token_type, self.embed_norm))


class TransformerEncoder(InputEmbedding):
    """Embedding + positions + N encoder layers (+ a final LayerNorm for pre-norm stacks)."""

    def __init__(self, cfg: TransformerConfig, vocab_size: int, pad_id: int = PAD_ID) -> None:
        super().__init__()
        require_paper_layers(cfg, "an encoder")
        self.pad_id = pad_id
        self.embed = TokenEmbedding(vocab_size, cfg.d_model, pad_id, scale=cfg.scale_embeddings)
        self.positions = make_positions(cfg.positions, cfg.d_model, cfg.max_len, cfg.position_layout)
        self.dropout = nn.Dropout(cfg.dropout)  # on embeddings + positions
        self.layers = layer_stack(EncoderLayer, cfg, cfg.encoder_layers)
        self.final_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.norm_first else None
        self.add_embedding_options(cfg)

    def forward(self, src: Tensor, need_weights: bool = False) -> tuple[Tensor, Tensor, list[Tensor]]:
        """``src`` ``(B, S)`` -> ``(memory (B, S, d_model), mask (B, 1, 1, S), per-layer self-attention weights)``."""
        mask = padding_mask(src, self.pad_id).unsqueeze(1)  # (B, 1, 1, S): True at real tokens
        x = self.embed_input(src)  # (B, S, d_model)
        all_weights = []
        for layer in self.layers:
            x, weights = layer(x, mask, need_weights=need_weights)
            if weights is not None:
                all_weights.append(weights)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, mask, all_weights


@dataclass
class TransformerState:
    """Decoder state for step-by-step generation (see :meth:`Transformer.decode_step`).

    Every tensor has one row per hypothesis (beam search copies a sentence's encoder side for each
    of its beams). :meth:`Transformer.decode_step` returns a state of the class it was given.
    ``caches`` holds one ``(self-attention, cross-attention)`` :class:`KVCache` pair per layer.
    With ``caches=None`` the decoder recomputes the whole prefix in ``tokens`` every step
    (the uncached baseline the benchmark compares against).
    """

    memory: Tensor  # (B, S, d_model)
    memory_mask: Tensor  # (B, 1, 1, S)
    tokens: Tensor  # (B, t) tokens fed so far (incl. <s>)
    caches: list[tuple[KVCache, KVCache]] | None  # self (B, H, t, d_k), cross (B, H, S, d_k)

    def select(self, index: Tensor) -> TransformerState:
        """Keep / reorder / repeat hypothesis rows, the encoder side with them; ``index`` ``(B',)``."""
        caches = None
        if self.caches is not None:
            caches = [(s.select(index), c.select(index)) for s, c in self.caches]
        return TransformerState(self.memory.index_select(0, index), self.memory_mask.index_select(0, index),
                                self.tokens.index_select(0, index), caches)


class Transformer(InputEmbedding):
    """Encoder-decoder Transformer returning logits; loss, search and precision live elsewhere."""

    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID

    def __init__(self, cfg: TransformerConfig, src_vocab_size: int, tgt_vocab_size: int) -> None:
        super().__init__()
        cfg.validate()
        require_paper_layers(cfg, "an encoder-decoder Transformer")
        self.cfg = cfg
        if cfg.share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError(f"share_embeddings needs one vocabulary, got {src_vocab_size} and {tgt_vocab_size}")
        self.encoder = TransformerEncoder(cfg, src_vocab_size)
        self.tgt_embed = self.encoder.embed if cfg.share_embeddings else TokenEmbedding(
            tgt_vocab_size, cfg.d_model, scale=cfg.scale_embeddings)
        self.positions = make_positions(cfg.positions, cfg.d_model, cfg.max_len, cfg.position_layout)
        self.dropout = nn.Dropout(cfg.dropout)  # on embeddings + positions
        self.layers = layer_stack(DecoderLayer, cfg, cfg.decoder_layers)
        self.final_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.norm_first else None
        self.out_proj = nn.Linear(cfg.d_model, tgt_vocab_size, bias=cfg.output_bias)
        if cfg.tie_output:
            self.out_proj.weight = self.tgt_embed.weight
        self.add_embedding_options(cfg)
        xavier_init_(self)
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)

    @property
    def embed(self) -> TokenEmbedding:
        """The target embedding (what :meth:`embed_input` reads on the decoder side)."""
        return self.tgt_embed

    @property
    def output_layer(self) -> nn.Linear:
        """The projection to the vocabulary (tied to the target embedding by default)."""
        return self.out_proj

    # -- teacher forcing ---------------------------------------------------------------

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """``src`` ``(B, S)`` -> ``(memory (B, S, d_model), memory_mask (B, 1, 1, S))``."""
        memory, mask, _ = self.encoder(src)
        return memory, mask

    def decode(self, tgt_in: Tensor, memory: Tensor, memory_mask: Tensor, *, need_weights: bool = False
               ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Decoder hidden states for the whole shifted target ``tgt_in`` ``(B, T)`` -> ``(B, T, d_model)``.

        Padding in the target needs no mask: a real position never looks right of itself, and
        outputs at padded positions are ignored by the loss. Returns ``(hidden, self-attention,
        cross-attention)``: with ``need_weights`` the per-layer weights ``(B, H, T, T)`` and
        ``(B, H, T, S)``, else two empty lists.
        """
        T = tgt_in.size(1)
        self_mask = causal_mask(T, device=tgt_in.device)  # (T, T)
        x = self.embed_input(tgt_in)  # (B, T, d_model)
        self_weights, cross = [], []
        for layer in self.layers:
            x, weights, _ = layer(x, memory, self_mask, memory_mask, need_weights=need_weights)
            if weights is not None:
                self_weights.append(weights[0])
                cross.append(weights[1])
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, self_weights, cross

    def features(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher forcing up to the output layer: ``(B, T, d_model)``."""
        memory, memory_mask = self.encode(src)
        hidden, _, _ = self.decode(tgt_in, memory, memory_mask)
        return hidden

    def forward(self, src: Tensor, tgt_in: Tensor, positions: Tensor | None = None) -> Tensor:
        """Teacher forcing: ``src`` (B, S), ``tgt_in`` = ``<s> y_1 .. y_{T-1}`` (B, T) -> logits (B, T, V).

        With a boolean ``positions`` (B, T), only those positions are projected to the
        vocabulary: logits (N, V), N = positions.sum() (training skips padding this way).
        """
        hidden = self.features(src, tgt_in)  # (B, T, d_model)
        if positions is not None:
            hidden = hidden[positions]  # (N, d_model)
        return self.out_proj(hidden)

    def cross_attention(self, src: Tensor, tgt_in: Tensor) -> list[Tensor]:
        """Per-layer cross-attention weights ``(B, H, T, S)`` under teacher forcing (for inspection)."""
        return self.attention_weights(src, tgt_in)[2]

    def attention_weights(self, src: Tensor, tgt_in: Tensor) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """Every attention map under teacher forcing, one ``(B, H, T_q, T_k)`` tensor per layer:
        ``(encoder self-attention (B, H, S, S), decoder self-attention (B, H, T, T),
        cross-attention (B, H, T, S))``. Asking for weights leaves the outputs unchanged."""
        memory, memory_mask, encoder_self = self.encoder(src, need_weights=True)
        _, decoder_self, cross = self.decode(tgt_in, memory, memory_mask, need_weights=True)
        return encoder_self, decoder_self, cross

    # -- single-step interface (attnkit.search) ------------------------------------------

    def init_decoder(self, src: Tensor, use_cache: bool = True) -> TransformerState:
        """Run the encoder once; the returned state starts before ``<s>``."""
        memory, memory_mask = self.encode(src)
        caches = [(KVCache(), KVCache()) for _ in self.layers] if use_cache else None
        tokens = src.new_zeros(src.size(0), 0)
        return TransformerState(memory, memory_mask, tokens, caches)

    def decode_step(self, prev: Tensor, state: TransformerState, need_weights: bool = False
                    ) -> tuple[Tensor, TransformerState, Tensor | None]:
        """Feed ``prev`` ``(B,)`` -> ``(logits (B, V), new state, cross-attention (B, S) | None)``.

        The returned weights are the last layer's cross-attention averaged over heads.
        """
        tokens = torch.cat([state.tokens, prev[:, None]], dim=1)  # (B, t)
        t = tokens.size(1)
        if state.caches is None:  # recompute the whole prefix
            hidden, _, cross = self.decode(tokens, state.memory, state.memory_mask, need_weights=need_weights)
            hidden, caches = hidden[:, -1:], None
        else:
            x = self.embed_input(prev[:, None], offset=t - 1)  # (B, 1, d_model)
            caches, cross = [], []
            for layer, cache in zip(self.layers, state.caches, strict=True):
                # one query at the newest position sees every cached key: no look-ahead mask needed
                x, weights, cache = layer(x, state.memory, None, state.memory_mask, cache=cache,
                                          need_weights=need_weights)
                caches.append(cache)
                if weights is not None:
                    cross.append(weights[1])
            hidden = self.final_norm(x) if self.final_norm is not None else x
        logits = self.out_proj(hidden[:, 0])  # (B, V)
        attention = cross[-1][:, :, -1].mean(dim=1) if need_weights else None  # (B, H, T, S) -> (B, S)
        return logits, replace(state, tokens=tokens, caches=caches), attention  # the state's own class
