"""Masked-language-model pretraining of the encoder (BERT, Devlin et al. 2019, section 3.1).

The encoder learns from text without labels by restoring subwords hidden from it::

    select 15% of the subwords (never <pad> or another special piece)
    of those: 80% -> <mask>, 10% -> a random subword, 10% left as they are
    H = Encoder(Embed(x~) + PE)                                  # (B, T, d_model), x~ the corrupted input
    logits_i = LayerNorm(GELU(H_i W_t + b_t)) E^T + b            # at each selected position i, (N, V)
    loss = sum_i -log softmax(logits_i)_{x_i}                    # the original subword

``E`` is the input embedding table (the prediction layer is tied to it, as in BERT); the
transform ``W_t`` is BERT's "MLM head". The encoder is :class:`~attnkit.transformer.TransformerEncoder`
under the same parameter names as in :class:`~attnkit.classifier.TransformerClassifier`
(``encoder.*``), so a classifier starts from it with ``model.init_from`` (:mod:`attnkit.tasks.pretraining`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layers import xavier_init_
from .transformer import TransformerConfig, TransformerEncoder
from .vocab import PAD_ID


def mask_tokens(tokens: Tensor, *, mask_id: int, special_ids: Sequence[int], vocab_size: int,
                select: float = 0.15, mask: float = 0.8, random: float = 0.1,
                generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """BERT's corruption of ``tokens`` ``(B, T)`` -> ``(inputs (B, T), selected (B, T) bool)``.

    Each position that is not ``<pad>`` or in ``special_ids`` is selected with probability
    ``select``; a selected position becomes ``mask_id`` with probability ``mask``, a random
    non-special subword with probability ``random``, and stays otherwise. When nothing was
    selected, the first candidate is (the loss is averaged over the selected positions).
    Random numbers come from ``generator`` (torch's default generator when None), on the CPU.
    """
    special, ordinary = _special_and_ordinary_ids(vocab_size, frozenset({PAD_ID, mask_id, *special_ids}), tokens.dtype)
    candidates = ~torch.isin(tokens, special)  # (B, T)
    selected = (torch.rand(tokens.shape, generator=generator) < select) & candidates
    if not selected.any() and candidates.any():
        selected.view(-1)[candidates.view(-1).nonzero()[0]] = True
    action = torch.rand(tokens.shape, generator=generator)  # (B, T): which corruption
    replacement = ordinary[torch.randint(len(ordinary), tokens.shape, generator=generator)]  # (B, T)
    inputs = tokens.clone()
    inputs[selected & (action < mask)] = mask_id
    to_random = selected & (action >= mask) & (action < mask + random)
    inputs[to_random] = replacement[to_random]
    return inputs, selected


@lru_cache(maxsize=8)
def _special_and_ordinary_ids(vocab_size: int, special: frozenset[int], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The special ids (sorted) and every other id below ``vocab_size``: made once per vocabulary, not per batch."""
    ordinary = [i for i in range(vocab_size) if i not in special]
    return torch.tensor(sorted(special), dtype=dtype), torch.tensor(ordinary, dtype=dtype)


class MaskedLanguageModel(nn.Module):
    """Encoder + BERT's MLM head, the output layer tied to the embeddings; logits at the selected positions."""

    def __init__(self, cfg: TransformerConfig, vocab_size: int, pad_id: int = PAD_ID) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.encoder = TransformerEncoder(cfg, vocab_size, pad_id=pad_id)
        self.transform = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), nn.GELU(), nn.LayerNorm(cfg.d_model))
        self.output_bias = nn.Parameter(torch.zeros(vocab_size))
        xavier_init_(self)

    def forward(self, tokens: Tensor, selected: Tensor) -> Tensor:
        """``tokens`` ``(B, T)`` (corrupted, padded), ``selected`` ``(B, T)`` bool -> logits ``(N, V)``."""
        hidden, _, _ = self.encoder(tokens)  # (B, T, D)
        h = self.transform(hidden[selected])  # (N, D)
        return F.linear(h, self.encoder.embed.weight, self.output_bias)  # (N, V), tied to the embedding


class MLMLoss(nn.Module):
    """Summed cross-entropy of the original subwords at the selected positions, in float32."""

    def __init__(self, model: MaskedLanguageModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, selected: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
        logits = self.model(tokens, selected)  # (N, V)
        return F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing, reduction="sum")
