"""A bag-of-n-grams expert beside a Transformer classifier: NB-weighted logistic regression over the
text's unigrams and bigrams (Wang & Manning 2012, "Baselines and Bigrams"; the NB features with a
logistic loss, as Mesnil et al. 2014 ensemble it with neural models on IMDB).

    x_f = 1{n-gram f occurs in the text}                       # binary, f over uni- and bigrams of subwords
    r_{c,f} = log( (p_{c,f} / |p_c|_1) / (q_{c,f} / |q_c|_1) )  # naive-Bayes log-count ratio, one class against
    p_{c,f} = alpha + #texts of class c with f                  # the rest, fixed before training (fit_ratios)
    q_{c,f} = alpha + #texts of the other classes with f
    s_c = sum_f x_f r_{c,f} w_{c,f} + b_c                       # (B, C) the expert's logits; w, b trained

With ``model.ngram_buckets`` set, a classifier's prediction is the **product of two experts**, its own head
and this one, each trained on its own cross-entropy (their parameters are disjoint):

    log p(c | x) = log_softmax(head(x))_c + log_softmax(s)_c  (renormalised by the softmax over c)

A linear model of which words and word pairs occur is strong on long reviews, and it errs on other reviews
than a Transformer does: on IMDB the two together beat either (docs/sentiment.md). Bigrams are hashed into
``buckets - V`` slots after the ``V`` unigram ids (the hashing trick, Weinberger et al. 2009).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: An odd multiplier for the bigram hash ``(a * P + b) mod (buckets - V)``.
BIGRAM_PRIME = 1_000_003


class NGramExpert(nn.Module):
    """NB-weighted logistic regression over hashed uni+bigrams of token ids; logits ``(B, n_classes)``."""

    def __init__(self, vocab_size: int, n_classes: int, buckets: int, pad_id: int, alpha: float = 1.0) -> None:
        super().__init__()
        if buckets <= vocab_size:
            raise ValueError(f"ngram buckets ({buckets}) must exceed the vocabulary ({vocab_size}): unigrams take "
                             "the first vocab_size slots, bigrams the rest")
        self.vocab_size, self.buckets, self.pad_id, self.alpha = vocab_size, buckets, pad_id, alpha
        self.weight = nn.Parameter(torch.zeros(buckets, n_classes))  # w, zero: the expert starts uniform
        self.bias = nn.Parameter(torch.zeros(n_classes))  # b
        self.register_buffer("ratio", torch.zeros(buckets, n_classes))  # r, set by fit_ratios

    def features(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """The n-grams present in each row of ``tokens`` ``(B, T)`` (padding ``pad_id``), each once:
        ``rows`` ``(N,)`` and n-gram ``ids`` ``(N,)``, ``0 <= id < buckets``."""
        real = tokens != self.pad_id  # (B, T)
        unigrams = tokens  # (B, T): ids < V
        bigrams = self.vocab_size + (tokens[:, :-1] * BIGRAM_PRIME + tokens[:, 1:]) % (self.buckets - self.vocab_size)
        ids = torch.cat([unigrams, bigrams], dim=1)  # (B, 2T - 1)
        present = torch.cat([real, real[:, :-1] & real[:, 1:]], dim=1)  # (B, 2T - 1)
        rows = torch.arange(tokens.size(0), device=tokens.device)[:, None].expand_as(ids)
        keys = torch.unique(rows[present] * self.buckets + ids[present])  # (N,) binary: each n-gram once per row
        return keys // self.buckets, keys % self.buckets

    def forward(self, tokens: Tensor) -> Tensor:
        """``tokens`` ``(B, T)`` -> the expert's logits ``s`` ``(B, n_classes)``, in float32."""
        rows, ids = self.features(tokens)  # (N,), (N,)
        terms = self.ratio[ids] * self.weight[ids]  # (N, C): x_f r_{c,f} w_{c,f}
        logits = torch.zeros(tokens.size(0), self.bias.numel(), device=tokens.device, dtype=terms.dtype)
        return logits.index_add(0, rows, terms) + self.bias  # (B, C)

    @torch.no_grad()
    def fit_ratios(self, batches: Iterable[tuple[Tensor, Tensor]]) -> None:
        """Set ``r`` from the training texts: ``batches`` of ``(tokens (B, T), labels (B,))``."""
        counts = torch.zeros_like(self.ratio, dtype=torch.float64)  # (F, C): texts of class c with n-gram f
        for tokens, labels in batches:
            rows, ids = self.features(tokens.to(self.ratio.device))
            counts.index_put_((ids, labels.to(counts.device)[rows]), torch.ones_like(ids, dtype=counts.dtype),
                              accumulate=True)
        p = self.alpha + counts  # (F, C)
        q = self.alpha + counts.sum(dim=1, keepdim=True) - counts  # (F, C): the other classes' texts
        self.ratio.copy_(torch.log((p / p.sum(dim=0)) / (q / q.sum(dim=0))))


def product_of_experts(experts: list[Tensor]) -> Tensor:
    """A classifier's output from its experts' logits, each ``(B, C)``: one expert's logits unchanged, or the sum
    of the experts' log-probabilities (log p up to a constant, renormalised by any softmax after it)."""
    if len(experts) == 1:
        return experts[0]
    return sum(F.log_softmax(e.float(), dim=-1) for e in experts)  # type: ignore[return-value]  # (B, C)
