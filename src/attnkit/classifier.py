"""Encoder-only Transformer classifier: the seeds' sentiment model (SEEDS.md section 8).

    H = Encoder(Embed(x) + PE)               # (B, T, d_model)
    z = Pool(H)                              # max over positions (the seed), mean, or the first token
    z = tanh(W_p z + b_p)                    # only with pooler=True (BERT's pooler)
    logits = W z + b                         # (B, n_classes)

The seed's IMDB model is ``TransformerConfig(d_model=32, n_heads=2, d_ff=128, encoder_layers=1)``
with max pooling and a 50,002-token vocabulary.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layers import xavier_init_
from .transformer import TransformerConfig, TransformerEncoder
from .vocab import PAD_ID

Pooling = Literal["max", "mean", "first"]


def pool(hidden: Tensor, mask: Tensor, how: Pooling) -> Tensor:
    """Pool ``hidden`` ``(B, T, D)`` over real positions (``mask`` ``(B, T)``, True = real) -> ``(B, D)``."""
    if how == "max":
        pooled = hidden.masked_fill(~mask[..., None], torch.finfo(hidden.dtype).min).amax(dim=1)
        return pooled.masked_fill(~mask.any(dim=1, keepdim=True), 0.0)  # no real token: zeros, not -inf
    if how == "mean":
        m = mask[..., None].to(hidden.dtype)
        return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    if how == "first":
        return hidden[:, 0]
    raise ValueError(f"unknown pooling {how!r}; choose max, mean or first")


class TransformerClassifier(nn.Module):
    """Encoder + pooling + linear head; returns class logits ``(B, n_classes)``."""

    def __init__(self, cfg: TransformerConfig, vocab_size: int, n_classes: int, pooling: Pooling = "max",
                 pad_id: int = PAD_ID, pooler: bool = False) -> None:
        """:param pooler: a dense layer with tanh on the pooled vector, ``z = tanh(W_p z + b_p)`` (BERT's)."""
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.pooling = pooling
        self.encoder = TransformerEncoder(cfg, vocab_size, pad_id=pad_id)
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model) if pooler else None
        self.head = nn.Linear(cfg.d_model, n_classes)
        self.dropout = nn.Dropout(cfg.dropout)  # on the pooled vector
        xavier_init_(self)

    def forward(self, tokens: Tensor) -> Tensor:
        """``tokens`` ``(B, T)`` padded with ``pad_id`` -> logits ``(B, n_classes)``."""
        hidden, mask, _ = self.encoder(tokens)  # (B, T, D), (B, 1, 1, T)
        z = pool(hidden, mask[:, 0, 0], self.pooling)  # (B, D)
        if self.pooler is not None:
            z = torch.tanh(self.pooler(z))  # (B, D)
        return self.head(self.dropout(z))  # (B, n_classes)

    @torch.no_grad()
    def token_importance(self, tokens: Tensor) -> Tensor:
        """How much the pooled vector draws on each token, ``(B, T)``, rows sum to 1 over real tokens.

        max pooling: the share of feature dimensions whose maximum came from that token;
        mean / first pooling: the last layer's self-attention the pooled position(s) paid
        to each token, averaged over heads.
        """
        hidden, mask, weights = self.encoder(tokens, need_weights=True)
        real = mask[:, 0, 0]  # (B, T)
        if self.pooling == "max":
            winners = hidden.masked_fill(~real[..., None], torch.finfo(hidden.dtype).min).argmax(dim=1)  # (B, D)
            share = F.one_hot(winners, tokens.size(1)).float().mean(dim=1)  # (B, T)
        else:
            attn = weights[-1].mean(dim=1)  # (B, H, T, T) -> (B, T, T)
            if self.pooling == "first":
                share = attn[:, 0]
            else:
                share = (attn * real[..., None]).sum(dim=1) / real.sum(dim=1, keepdim=True).clamp(min=1)
        return share * real
