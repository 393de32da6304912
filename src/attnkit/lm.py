"""A decoder-only Transformer language model: GPT (Radford et al. 2018, 2019) and the Llama family's variants.

    x_0      = Embed(y_1 .. y_T) [+ PE]             # (B, T, d_model); no PE for rope, alibi or none
    x_l      = DecoderLayer_l(x_{l-1})              # masked self-attention + FFN, no cross-attention
    logits   = Norm(x_N) E^T                        # (B, T, V), the output layer tied to the embedding E
    p(y_{t+1} | y_1..y_t) = softmax(beta * logits_t)   # sampling at temperature T = 1 / beta

It is the decoder of the seeds' Transformer with the encoder taken away: the same
:class:`~attnkit.layers.DecoderLayer` (with ``cross_attention=False``), the same
:class:`~attnkit.multihead.MultiHeadAttention` and kernel :func:`~attnkit.attention.attend`; the
look-ahead mask is what makes it a language model: position ``t`` predicts ``y_{t+1}`` from
``y_1..y_t`` only, so one forward pass over a block trains every position at once (teacher forcing).
Sampling with the softmax's inverse temperature ``beta`` is the seeds' soft attention over the vocabulary;
``beta -> infinity`` (temperature 0) is their hard attention, greedy decoding (:mod:`attnkit.sampling`).

The options of today's models are fields of :class:`~attnkit.transformer.TransformerConfig`:
``positions`` (sinusoidal, learned, rope, alibi, none; :mod:`attnkit.positions`), ``n_kv_heads``
(grouped-query attention), ``window`` (sliding-window attention), ``norm`` (layernorm, rmsnorm),
``activation`` (relu, gelu, gelu_tanh, swish, swiglu), ``bias`` and ``qkv_bias`` (Qwen2). A language model
is pre-norm unless ``norm_first: false`` (GPT-2 and every model since put the norm first, and a final norm
after the last layer).

Generation feeds one token at a time through :meth:`LanguageModel.step` with a key/value cache per
layer (:class:`~attnkit.multihead.KVCache`, ``H_kv`` heads under grouped-query attention).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch
from torch import Tensor, nn

from .attention import sliding_window_mask
from .layers import DecoderLayer, TokenEmbedding, make_norm
from .multihead import KVCache
from .positions import ADDITIVE_POSITIONS, ALiBi, RotaryPositions, make_positions
from .transformer import TransformerConfig
from .vocab import PAD_ID

#: GPT-2's initialisation: N(0, 0.02) for every matrix (Radford et al. 2019, section 2.3).
INIT_STD = 0.02
#: The fixed logit of an absent id (a special id an imported vocabulary has no piece for): its probability is 0
#: beside any real logit (exp underflows), yet finite, so that sums over the logits (a label-smoothing term) stay
#: finite, and representable in float16.
ABSENT_LOGIT = -1e4


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

    :param cfg: sizes and options; ``decoder_layers`` is the depth (``encoder_layers`` is not read).
    :param vocab_size: the tokenizer's vocabulary.
    :param absent_ids: ids the tokenizer has no piece for (:attr:`attnkit.data.tokenizer.Tokenizer.absent_ids`:
        an imported GPT-2 has no pad, unk or bos): their logit is always :data:`ABSENT_LOGIT`, a fixed output bias
        that is not trained and not saved.
    """

    pad_id = PAD_ID

    def __init__(self, cfg: TransformerConfig, vocab_size: int, pad_id: int = PAD_ID,
                 absent_ids: Sequence[int] = ()) -> None:
        super().__init__()
        cfg.validate()
        if cfg.token_types or cfg.embedding_norm:
            raise ValueError("a language model has no token types or embedding norm (token_types, embedding_norm: "
                             "BERT's); leave them at 0 and false")
        self.cfg = cfg
        d, H = cfg.d_model, cfg.n_heads
        self.embed = TokenEmbedding(vocab_size, d, pad_id, scale=cfg.scale_embeddings)
        # positions: a table added to the input, or a module every attention layer shares (or none at all)
        self.positions = (make_positions(cfg.positions, d, cfg.max_len, cfg.position_layout)
                          if cfg.positions in ADDITIVE_POSITIONS else None)
        rotary = RotaryPositions(d // H, cfg.rope_theta) if cfg.positions == "rope" else None
        alibi = ALiBi(H) if cfg.positions == "alibi" else None
        self.dropout = nn.Dropout(cfg.dropout)  # on the input embedding
        options = replace(cfg.layer_options(norm_first_default=True), rotary=rotary, alibi=alibi)
        self.layers = nn.ModuleList(DecoderLayer(d, H, cfg.d_ff, options, cross_attention=False)
                                    for _ in range(cfg.decoder_layers))
        self.final_norm = make_norm(cfg.norm, d, cfg.norm_eps) if options.norm_first else None
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

    def decode_layers(self, x: Tensor, mask: Tensor | None, caches: list[KVCache] | None, *,
                      offset: Tensor | None = None, need_weights: bool = False
                      ) -> tuple[Tensor, list[Tensor], list[KVCache]]:
        """The layer stack and the final norm on the embedded input ``x`` ``(B, T, d_model)``.

        :param mask: what each query may see besides the look-ahead mask (the window; a continuous batch's padding).
        :param caches: one per layer, or None (no cache kept).
        :param offset: ``(B,)`` each row's position of its first query (rows at different positions; RoPE).
        :returns: ``(hidden (B, T, d_model), per-layer self-attention when need_weights, new caches or [])``.
        """
        new_caches, all_weights = [], []
        for layer, cache in zip(self.layers, caches or [None] * len(self.layers), strict=True):
            x, weights, new_cache = layer(x, None, mask, None, cache=None if cache is None else (cache, None),
                                          need_weights=need_weights, offset=offset)
            if new_cache is not None:
                new_caches.append(new_cache[0])
            if weights is not None:
                all_weights.append(weights[0])
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, all_weights, new_caches

    def forward(self, tokens: Tensor) -> Tensor:
        """Teacher forcing: ``tokens`` ``(B, T)`` -> next-token logits ``(B, T, V)`` (row ``t`` predicts ``t + 1``)."""
        hidden, _, _ = self.features(tokens)
        return self.out_proj(hidden)

    def attention_weights(self, tokens: Tensor) -> list[Tensor]:
        """Per-layer causal self-attention ``(B, H, T, T)`` over ``tokens`` (for inspection)."""
        return self.features(tokens, need_weights=True)[1]

    # -- generation (attnkit.sampling) ----------------------------------------------------

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
    table; scaled by ``sqrt(d_model)`` (the paper) they keep :class:`~attnkit.layers.TokenEmbedding`'s
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
