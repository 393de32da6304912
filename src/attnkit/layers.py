"""The encoder-decoder's layers (SEEDS.md section 7; Vaswani et al. sections 3.1-3.5).

- the token embedding ``Embedding(x) * sqrt(d_model)`` (section 3.4) and the positions (section 3.5, and the ones
  today's models use) are in :mod:`attnkit.positions`.
- the feed-forward network ``FFN(x) = max(0, x W_1 + b_1) W_2 + b_2`` (section 3.3, or the gated SwiGLU) and the
  "Norm" of Add & Norm (LayerNorm, or RMSNorm) are the GPT's, in :mod:`attnkit.lm` (:class:`~attnkit.lm.FeedForward`,
  :func:`~attnkit.lm.make_norm`), shared with these layers.
- :func:`input_embedding`: BERT's additions to ``Embed(x) + PE``: a token-type row, then a LayerNorm.

Options that other published models use, each off by default (``attnkit import`` sets them for
Hugging Face checkpoints): the FFN's activation (``gelu`` in BERT, ``swish`` in Marian / OPUS-MT),
no ``sqrt(d_model)`` scale (BERT), the sinusoids laid out in two halves (tensor2tensor, Marian),
a token-type embedding and an embedding LayerNorm (BERT), and the LayerNorm epsilon (BERT: 1e-12);
and those of today's models (RMSNorm, SwiGLU, no biases, grouped-query attention).
- :class:`EncoderLayer`: self-attention -> Add & Norm -> FFN -> Add & Norm.
- :class:`DecoderLayer`: masked self-attention -> Add & Norm -> cross-attention -> Add & Norm -> FFN -> Add & Norm.
  (A decoder-only language model's layer, without cross-attention, is :class:`attnkit.lm.Block`.)

Dropout (``nn.Dropout`` modules) sits where the paper puts it: on each sub-layer's output before
the residual add and on embeddings + positions (in the models). Dropout on attention weights
and on the FFN activation are extra options (tensor2tensor/fairseq), off by default.
Deviation flag: ``norm_first=True`` gives the pre-norm variant ``x + Sublayer(LayerNorm(x))``
(more stable for deep stacks); the paper's post-norm ``LayerNorm(x + Sublayer(x))`` is the default.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from .attention import ScoreName
from .lm import Activation, FeedForward, NormKind, make_norm
from .multihead import KVCache, MultiHeadAttention


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

    def attention(self, d_model: int, n_heads: int, o: LayerOptions) -> MultiHeadAttention:
        """A multi-head attention sub-layer built with ``o``."""
        return MultiHeadAttention(d_model, n_heads, dropout=o.attention_dropout, score=o.score, bias=o.bias,
                                  qkv_bias=o.qkv_bias, n_kv_heads=o.n_kv_heads)

    def build(self, d_model: int, n_heads: int, d_ff: int, o: LayerOptions, *, cross_attention: bool = False) -> None:
        """What every layer has: self-attention (then cross-attention, if asked for), the FFN, the residual
        dropout and (``norm1``) the first norm. Built in this order, the paper's layers draw their initial
        weights as they always have."""
        self.self_attn = self.attention(d_model, n_heads, o)
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
    """Masked self-attention, cross-attention to the encoder memory, FFN; each with Add & Norm. The norms are
    numbered in the order their sub-layers run."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, options: LayerOptions = PAPER_LAYER) -> None:
        super().__init__()
        self.build(d_model, n_heads, d_ff, options, cross_attention=True)
        self.norm2 = make_norm(options.norm, d_model, options.eps)
        self.norm3 = make_norm(options.norm, d_model, options.eps)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        self_mask: Tensor | None,
        memory_mask: Tensor | None,
        *,
        cache: tuple[KVCache, KVCache] | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, tuple[Tensor, Tensor] | None, tuple[KVCache, KVCache] | None]:
        """One decoder layer.

        :param x: ``(B, T, d_model)`` target positions (``T = 1`` when decoding step by step).
        :param memory: ``(B, S, d_model)`` encoder output.
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
