"""Transformer classifiers: the seeds' encoder-only sentiment model (SEEDS.md section 8), and the
language-model route, a decoder-only classifier over a causal language model.

    H = Encoder(Embed(x) + PE)               # (B, T, d_model)
    z = Pool(H)                              # max over positions (the seed), mean, the first or the last token
    z = tanh(W_p z + b_p)                    # only with pooler=True (BERT's pooler)
    logits = W z + b                         # (B, n_classes)
    # model.ngram_buckets: log_softmax(logits) + log_softmax(s), s an n-gram expert's logits (attnkit/ngrams.py)

The seed's IMDB model is ``TransformerConfig(d_model=32, n_heads=2, d_ff=128, encoder_layers=1)``
with max pooling and a 50,002-token vocabulary. :class:`DecoderClassifier` reads the text with a
:class:`~attnkit.lm.LanguageModel`'s layers instead (``model.classifier: decoder``): each state has read
the text up to its own token only, so the last one is the one that has read it all.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layers import xavier_init_
from .lm import LanguageModel
from .ngrams import NGramExpert, product_of_experts
from .transformer import TransformerConfig, TransformerEncoder
from .vocab import PAD_ID

Pooling = Literal["max", "mean", "first", "last"]


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
    if how == "last":  # the last real token of each row (rows are padded on the right)
        last = (mask.sum(dim=1) - 1).clamp(min=0)  # (B,)
        return hidden[torch.arange(hidden.size(0), device=hidden.device), last]
    raise ValueError(f"unknown pooling {how!r}; choose max, mean, first or last")


def pooled_importance(hidden: Tensor, real: Tensor, attention: Tensor, how: Pooling) -> Tensor:
    """How much the pooled vector draws on each token, ``(B, T)``, rows summing to 1 over real tokens.

    max pooling: the share of feature dimensions whose maximum came from each token; first / last / mean:
    the last layer's attention ``attention`` ``(B, H, T, T)`` that the pooled position(s) paid to each token,
    averaged over heads. ``hidden`` ``(B, T, D)``, ``real`` ``(B, T)`` True at real tokens.
    """
    if how == "max":
        winners = hidden.masked_fill(~real[..., None], torch.finfo(hidden.dtype).min).argmax(dim=1)  # (B, D)
        share = F.one_hot(winners, hidden.size(1)).float().mean(dim=1)  # (B, T)
    else:
        attn = attention.mean(dim=1)  # (B, H, T, T) -> (B, T, T)
        if how == "first":
            share = attn[:, 0]
        elif how == "last":
            last = (real.sum(dim=1) - 1).clamp(min=0)  # (B,)
            share = attn[torch.arange(attn.size(0), device=attn.device), last]  # (B, T)
        else:
            share = (attn * real[..., None]).sum(dim=1) / real.sum(dim=1, keepdim=True).clamp(min=1)
    return share * real


class TransformerClassifier(nn.Module):
    """Encoder + pooling + linear head; returns class logits ``(B, n_classes)``."""

    #: What :meth:`self_attention` shows (the ``attention`` command's title for it).
    attention_title = "encoder self-attention"

    def __init__(self, cfg: TransformerConfig, vocab_size: int, n_classes: int, pooling: Pooling = "max",
                 pad_id: int = PAD_ID, pooler: bool = False, ngram_buckets: int = 0) -> None:
        """:param pooler: a dense layer with tanh on the pooled vector, ``z = tanh(W_p z + b_p)`` (BERT's).
        :param ngram_buckets: with more than 0, an :class:`~attnkit.ngrams.NGramExpert` of that many slots beside
            the head (``model.ngram_buckets``); the prediction is the product of the two experts."""
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.pooling = pooling
        self.encoder = TransformerEncoder(cfg, vocab_size, pad_id=pad_id)
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model) if pooler else None
        self.head = nn.Linear(cfg.d_model, n_classes)
        self.dropout = nn.Dropout(cfg.dropout)  # on the pooled vector
        xavier_init_(self)
        self.ngrams = NGramExpert(vocab_size, n_classes, ngram_buckets, pad_id) if ngram_buckets else None

    def experts(self, tokens: Tensor) -> list[Tensor]:
        """The head's logits ``(B, n_classes)``, then the n-gram expert's (when there is one); each is trained on
        its own cross-entropy (:class:`~attnkit.tasks.objectives.ClassificationLoss`)."""
        hidden, mask, _ = self.encoder(tokens)  # (B, T, D), (B, 1, 1, T)
        z = pool(hidden, mask[:, 0, 0], self.pooling)  # (B, D)
        if self.pooler is not None:
            z = torch.tanh(self.pooler(z))  # (B, D)
        logits = self.head(self.dropout(z))  # (B, n_classes)
        return [logits] if self.ngrams is None else [logits, self.ngrams(tokens)]

    def forward(self, tokens: Tensor) -> Tensor:
        """``tokens`` ``(B, T)`` padded with ``pad_id`` -> logits ``(B, n_classes)`` (with an n-gram expert: the
        experts' summed log-probabilities)."""
        return product_of_experts(self.experts(tokens))

    @torch.no_grad()
    def token_importance(self, tokens: Tensor) -> Tensor:
        """How much the pooled vector draws on each token, ``(B, T)``, rows sum to 1 over real tokens.

        max pooling: the share of feature dimensions whose maximum came from that token;
        mean / first pooling: the last layer's self-attention the pooled position(s) paid
        to each token, averaged over heads.
        """
        hidden, mask, weights = self.encoder(tokens, need_weights=True)
        return pooled_importance(hidden, mask[:, 0, 0], weights[-1], self.pooling)

    @torch.no_grad()
    def self_attention(self, tokens: Tensor) -> list[Tensor]:
        """The encoder's self-attention weights of ``tokens`` ``(B, T)``: one ``(B, H, T, T)`` per layer."""
        return self.encoder(tokens, need_weights=True)[2]


class DecoderClassifier(nn.Module):
    """The language-model route: a causal language model's states, pooled, then a linear head.

        H = LM_layers(Embed(y_1..y_T))            # (B, T, d_model); h_t has read y_1..y_t (look-ahead mask)
        z = h_T (pooling: last) | mean_t h_t | max_t h_t
        logits = W Dropout(z) + b                 # (B, n_classes)

    GPT's fine-tuning (Radford et al. 2018, section 3.2) feeds the last token's state to a linear layer;
    ULMFiT (Howard and Ruder 2018) pools the states of an LSTM language model of the same texts. Starting
    from a ``task: lm`` run (``model.init_from``) is what makes it worth it: the language model has learned
    the text without labels. Rows are padded on the right, so no real token ever attends to padding.
    """

    #: What :meth:`self_attention` shows (the ``attention`` command's title for it).
    attention_title = "causal self-attention"

    def __init__(self, cfg: TransformerConfig, vocab_size: int, n_classes: int, pooling: Pooling = "last",
                 pad_id: int = PAD_ID, ngram_buckets: int = 0) -> None:
        """:param ngram_buckets: an n-gram expert beside the head, as :class:`TransformerClassifier`'s."""
        super().__init__()
        if pooling == "first":
            raise ValueError("a decoder-only classifier's first state has read one token; pool last, mean or max")
        self.pooling = pooling
        self.pad_id = pad_id
        self.lm = LanguageModel(cfg, vocab_size, pad_id)
        self.lm.out_proj = None  # type: ignore[assignment]  # states are classified, not next tokens: no output layer
        self.head = nn.Linear(cfg.d_model, n_classes)
        self.dropout = nn.Dropout(cfg.dropout)  # on the pooled vector
        xavier_init_(self.head)
        self.ngrams = NGramExpert(vocab_size, n_classes, ngram_buckets, pad_id) if ngram_buckets else None

    def experts(self, tokens: Tensor) -> list[Tensor]:
        """The head's logits ``(B, n_classes)``, then the n-gram expert's (when there is one)."""
        hidden, _, _ = self.lm.features(tokens)  # (B, T, D)
        z = pool(hidden, tokens != self.pad_id, self.pooling)  # (B, D)
        logits = self.head(self.dropout(z))  # (B, n_classes)
        return [logits] if self.ngrams is None else [logits, self.ngrams(tokens)]

    def forward(self, tokens: Tensor) -> Tensor:
        """``tokens`` ``(B, T)`` padded on the right with ``pad_id`` -> logits ``(B, n_classes)`` (with an n-gram
        expert: the experts' summed log-probabilities)."""
        return product_of_experts(self.experts(tokens))

    @torch.no_grad()
    def token_importance(self, tokens: Tensor) -> Tensor:
        """As :meth:`TransformerClassifier.token_importance`: ``(B, T)``, rows summing to 1 over real tokens."""
        hidden, weights, _ = self.lm.features(tokens, need_weights=True)
        return pooled_importance(hidden, tokens != self.pad_id, weights[-1], self.pooling)

    @torch.no_grad()
    def self_attention(self, tokens: Tensor) -> list[Tensor]:
        """The language model's causal self-attention weights of ``tokens`` ``(B, T)``: ``(B, H, T, T)`` per layer."""
        return self.lm.features(tokens, need_weights=True)[1]
