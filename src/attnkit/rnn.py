"""RNN encoder-decoder (seq2seq), with and without attention (SEEDS.md sections 1-2).

Encoder: a GRU/LSTM (optionally bidirectional) over the source gives h_1..h_N.

Decoder step t, following the seeds (Luong et al. 2015), with ``s_t`` the decoder state::

    e^t     = [score(s_t, h_1), ..., score(s_t, h_N)]      # dot / general / concat
    alpha^t = softmax(e^t)
    a_t     = sum_i alpha_i^t h_i                          # attention value (context)
    v_t     = [a_t ; s_t]
    s~_t    = tanh(W_c v_t + b_c)
    y^_t    = softmax(W_y s~_t + b_y)                      # the model returns the logits

``attention="none"``: ``a_t`` is the encoder's final state at every step — the fixed-size
bottleneck of SEEDS.md section 1. Luong models feed ``s~_{t-1}`` back into the next input
("input feeding"). ``attention="additive"`` is Bahdanau et al. 2015: the score uses the
*previous* state, ``e_i = v^T tanh(W s_{t-1} + U h_i)``, and ``a_t`` enters the RNN input
(``s_t = RNN([y_{t-1}; a_t], s_{t-1})``); the output layer is the same as above.

Training (teacher forcing) runs the very same :meth:`RNNSeq2Seq.decode_step` over the
shifted target, so cached and full decoding are identical by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from .attention import AdditiveScore, GeneralScore, Normalizer, attend, make_scorer
from .vocab import BOS_ID, EOS_ID, PAD_ID

RNNState = Tensor | tuple[Tensor, Tensor]  # GRU hidden (L, B, H) or LSTM (h, c)


@dataclass
class RNNConfig:
    """Dimensions and attention type of :class:`RNNSeq2Seq`."""

    cell: Literal["gru", "lstm"] = "gru"
    embed_dim: int = 256
    hidden_size: int = 512
    layers: int = 1
    bidirectional: bool = True
    attention: Literal["none", "dot", "general", "concat", "additive"] = "additive"
    dropout: float = 0.3


@dataclass
class RNNDecoderState:
    """Everything one decoder step needs; batch is dim 0 except in ``hidden`` (dim 1)."""

    hidden: RNNState  # (L, B, H)
    feed: Tensor  # (B, H) s~_{t-1}, zeros at the start (Luong input feeding)
    values: Tensor  # (B, S, H) encoder states h_i
    keys: Tensor  # (B, S, H or d_attn) encoder states as the scorer wants them (projected once)
    mask: Tensor  # (B, 1, S) True at real source tokens
    final: Tensor  # (B, H) encoder summary, the context when attention="none"

    def select(self, index: Tensor) -> RNNDecoderState:
        """Keep / reorder / repeat batch rows; ``index`` ``(B',)``."""
        if isinstance(self.hidden, tuple):
            hidden: RNNState = (self.hidden[0].index_select(1, index), self.hidden[1].index_select(1, index))
        else:
            hidden = self.hidden.index_select(1, index)
        return RNNDecoderState(hidden, self.feed.index_select(0, index), self.values.index_select(0, index),
                               self.keys.index_select(0, index), self.mask.index_select(0, index),
                               self.final.index_select(0, index))


class RNNSeq2Seq(nn.Module):
    """GRU/LSTM encoder-decoder; returns logits and implements the single-step decoder interface."""

    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID

    def __init__(self, cfg: RNNConfig, src_vocab_size: int, tgt_vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        H, E, L = cfg.hidden_size, cfg.embed_dim, cfg.layers
        rnn = {"gru": nn.GRU, "lstm": nn.LSTM}[cfg.cell]
        drop_between = cfg.dropout if L > 1 else 0.0
        self.src_embed = nn.Embedding(src_vocab_size, E, padding_idx=PAD_ID)
        self.tgt_embed = nn.Embedding(tgt_vocab_size, E, padding_idx=PAD_ID)
        self.encoder = rnn(E, H, L, batch_first=True, bidirectional=cfg.bidirectional, dropout=drop_between)
        enc_out = H * (2 if cfg.bidirectional else 1)
        self.enc_to_values = nn.Linear(enc_out, H) if cfg.bidirectional else nn.Identity()
        self.bridge = nn.Linear(enc_out, H)  # final encoder state -> initial decoder state
        self.decoder = rnn(E + H, H, L, batch_first=True, dropout=drop_between)  # input: [y_{t-1}; s~_{t-1} or a_t]
        self.scorer = None if cfg.attention == "none" else make_scorer(cfg.attention, H)
        # Bahdanau (additive): attend with s_{t-1}, then step the RNN on [y; a_t]. Luong: step first, attend with s_t.
        self.attend_before_step = cfg.attention == "additive"
        self.W_c = nn.Linear(2 * H, H)  # s~_t = tanh(W_c [a_t; s_t] + b_c)
        self.W_y = nn.Linear(H, tgt_vocab_size)  # y^_t = softmax(W_y s~_t + b_y)
        self.dropout = nn.Dropout(cfg.dropout)  # on embeddings and on s~_t
        self.normalizer: Normalizer = "softmax"  # attention_override may change these two
        self.beta: float | None = None

    # -- encoder -------------------------------------------------------------------------

    def init_decoder(self, src: Tensor) -> RNNDecoderState:
        """Encode ``src`` ``(B, S)`` and build the decoder's starting state."""
        mask = src.ne(PAD_ID)  # (B, S)
        lengths = mask.sum(dim=1).clamp(min=1).cpu()
        x = self.dropout(self.src_embed(src))  # (B, S, E)
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, last = self.encoder(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=src.size(1))  # (B, S, dirs*H)
        h_n = last[0] if isinstance(last, tuple) else last  # (L*dirs, B, H)
        dirs = 2 if self.cfg.bidirectional else 1
        top = h_n.view(self.cfg.layers, dirs, src.size(0), -1)[-1]  # (dirs, B, H) top layer
        summary = torch.cat(list(top), dim=-1)  # (B, dirs*H): [forward last; backward first]
        s0 = torch.tanh(self.bridge(summary))  # (B, H)
        hidden0 = s0.unsqueeze(0).repeat(self.cfg.layers, 1, 1).contiguous()  # (L, B, H)
        hidden: RNNState = (hidden0, torch.zeros_like(hidden0)) if self.cfg.cell == "lstm" else hidden0
        values = self.enc_to_values(out)  # (B, S, H)
        keys = self.scorer.project_keys(values) if isinstance(self.scorer, GeneralScore | AdditiveScore) else values
        return RNNDecoderState(hidden, torch.zeros_like(s0), values, keys, mask.unsqueeze(1), s0)

    # -- decoder -------------------------------------------------------------------------

    def _attend(self, query: Tensor, state: RNNDecoderState) -> tuple[Tensor, Tensor | None]:
        """Context ``a_t`` ``(B, H)`` and weights ``alpha^t`` ``(B, S)`` for a query ``(B, H)``."""
        if self.scorer is None:
            return state.final, None
        score = self.scorer.score_projected if isinstance(self.scorer, GeneralScore | AdditiveScore) else self.scorer
        context, weights = attend(query.unsqueeze(1), state.keys, state.values, state.mask, score=score,
                                  normalizer=self.normalizer, beta=self.beta)
        return context.squeeze(1), weights.squeeze(1)  # (B, 1, H) -> (B, H); (B, 1, S) -> (B, S)

    def decode_step(self, prev: Tensor, state: RNNDecoderState, need_weights: bool = False
                    ) -> tuple[Tensor, RNNDecoderState, Tensor | None]:
        """Feed ``prev`` ``(B,)`` -> ``(logits (B, V), new state, attention weights (B, S) | None)``."""
        features, state, weights = self._step(prev, state)
        return self.W_y(features), state, (weights if need_weights else None)

    def _step(self, prev: Tensor, state: RNNDecoderState) -> tuple[Tensor, RNNDecoderState, Tensor | None]:
        """One decoder step up to the output layer: ``(dropout(s~_t) (B, H), new state, alpha^t (B, S) | None)``."""
        y = self.dropout(self.tgt_embed(prev))  # (B, E)
        if self.attend_before_step:
            s_prev = (state.hidden[0] if isinstance(state.hidden, tuple) else state.hidden)[-1]  # (B, H)
            context, weights = self._attend(s_prev, state)
            out, hidden = self.decoder(torch.cat([y, context], dim=-1).unsqueeze(1), state.hidden)
            s_t = out.squeeze(1)  # (B, H)
        else:
            out, hidden = self.decoder(torch.cat([y, state.feed], dim=-1).unsqueeze(1), state.hidden)
            s_t = out.squeeze(1)  # (B, H)
            context, weights = self._attend(s_t, state)
        s_tilde = torch.tanh(self.W_c(torch.cat([context, s_t], dim=-1)))  # (B, H)
        new_state = RNNDecoderState(hidden, s_tilde, state.values, state.keys, state.mask, state.final)
        return self.dropout(s_tilde), new_state, weights

    def _teacher_force(self, src: Tensor, tgt_in: Tensor, need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """Run :meth:`_step` over ``tgt_in`` ``(B, T)`` -> ``(features (B, T, H), alpha (B, T, S) | None)``."""
        state = self.init_decoder(src)
        features, weights = [], []
        for t in range(tgt_in.size(1)):
            step_features, state, step_weights = self._step(tgt_in[:, t], state)
            features.append(step_features)
            weights.append(step_weights)
        return torch.stack(features, dim=1), (torch.stack(weights, dim=1) if need_weights else None)

    @property
    def output_layer(self) -> nn.Linear:
        """``W_y``, the projection of ``s~_t`` to the vocabulary."""
        return self.W_y

    def features(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher forcing up to the output layer: ``(B, T, H)`` (``dropout(s~_t)`` at every step)."""
        out, _ = self._teacher_force(src, tgt_in, need_weights=False)
        return out

    def forward(self, src: Tensor, tgt_in: Tensor, positions: Tensor | None = None) -> Tensor:
        """Teacher forcing: ``src`` (B, S), ``tgt_in`` (B, T) -> logits (B, T, V), or (N, V) at ``positions``."""
        hidden = self.features(src, tgt_in)  # (B, T, H)
        if positions is not None:
            hidden = hidden[positions]  # (N, H)
        return self.W_y(hidden)

    def alignment(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """The alignment ``alpha^t`` of every step under teacher forcing: ``(B, T, S)`` (for inspection).

        :raises ValueError: for ``attention="none"``, which has no alignment.
        """
        if self.scorer is None:
            raise ValueError("this RNNSeq2Seq has attention='none': there is no alignment to return")
        return self._teacher_force(src, tgt_in, need_weights=True)[1]

    def attention_weights(self, src: Tensor, tgt_in: Tensor) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """:meth:`attnkit.transformer.Transformer.attention_weights`' answer for this model: no self-attention, and
        the alignment as the one cross-attention map, one layer of one head ``(B, 1, T, S)``."""
        return [], [], [self.alignment(src, tgt_in)[:, None]]
