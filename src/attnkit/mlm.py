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

Replaced-token detection (ELECTRA, Clark et al. 2020) trains the same encoder as a discriminator instead:
a small generator fills the masked positions with samples, and the encoder tells, at every position,
whether its subword is the original (:class:`ReplacedTokenDetection`, :class:`ReplacedTokenDetectionLoss`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import padding_mask
from .layers import EncoderLayer, xavier_init_
from .transformer import TransformerConfig, TransformerEncoder, layer_stack
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
        self.transform = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), nn.GELU(),
                                       nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps))
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


# -- replaced-token detection (ELECTRA) -------------------------------------------------------------


def generator_config(cfg: TransformerConfig, width: float) -> TransformerConfig:
    """ELECTRA's small generator (section 3.2): ``d_model``, ``d_ff`` and the heads times ``width``, as many layers.

    Scaling the heads with ``d_model`` keeps ``d_k = d_model / n_heads`` the discriminator's; at least one head,
    lowered to the nearest count that divides the generator's ``d_model``.
    """
    d_model = max(1, round(cfg.d_model * width))
    heads = max(1, min(round(cfg.n_heads * width), d_model))
    while d_model % heads:
        heads -= 1
    return replace(cfg, d_model=d_model, n_heads=heads, d_ff=max(1, round(cfg.d_ff * width)))


class Generator(nn.Module):
    """ELECTRA's generator: a narrow MLM reading the discriminator's embeddings (shared, section 3.2)::

        H^G = Encoder_G(Dropout(Embed(x^masked) + PE) W_in)          # (B, T, d_G); Embed, PE: the discriminator's
        logits_i = LayerNorm(GELU(H^G_i W_t + b_t)) E^T + b          # (N, V); W_t: d_G -> d_model, E tied

    ``W_in`` projects the shared ``d_model``-wide embeddings down to the generator's width ``d_G`` (as the
    paper's code does for small generators); ``W_t`` projects back up so the output layer is tied to ``E``.
    """

    def __init__(self, cfg: TransformerConfig, d_embed: int, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.dropout = nn.Dropout(cfg.dropout)
        self.project = nn.Linear(d_embed, cfg.d_model)  # W_in
        self.layers = layer_stack(EncoderLayer, cfg, cfg.encoder_layers)
        self.final_norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else None
        self.transform = nn.Sequential(nn.Linear(cfg.d_model, d_embed), nn.GELU(), nn.LayerNorm(d_embed))
        self.output_bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, embedded: Tensor, mask: Tensor, selected: Tensor, embedding: Tensor) -> Tensor:
        """``embedded`` ``(B, T, d_model)``, ``mask`` ``(B, 1, 1, T)``, ``selected`` ``(B, T)`` -> logits ``(N, V)``."""
        x = self.project(self.dropout(embedded))  # (B, T, d_G)
        for layer in self.layers:
            x, _ = layer(x, mask)
        if self.final_norm is not None:
            x = self.final_norm(x)
        h = self.transform(x[selected])  # (N, d_model)
        return F.linear(h, embedding, self.output_bias)  # (N, V), tied to the shared embedding


def sample_replacements(logits: Tensor, never: Sequence[int] = (), generator: torch.Generator | None = None
                        ) -> Tensor:
    """``x^_i ~ softmax(logits_i)`` at each selected position: ``(N, V)`` -> ``(N,)``, never an id in ``never``.

    By the inverse of each row's cumulative distribution ``F_i(v) = sum_{w <= v} p_i(w)``::

        x^_i = min { v : F_i(v) > u_i * F_i(V - 1) },    u_i ~ U[0, 1)

    (scaling by the total keeps the draw inside the vocabulary when float rounding leaves ``F_i(V - 1)`` just
    below 1; a banned id has ``p = 0``, so ``F`` does not rise there and it is never the first to exceed).
    The same distribution as ``torch.multinomial``, which draws row by row and was the slowest part of an
    ELECTRA update on the CPU with an 8,000-subword vocabulary.

    Detached: no gradient flows through the sampling (ELECTRA section 2), so the generator learns from its
    MLM loss alone. Drawn on the CPU from ``generator`` (torch's default generator when None).
    """
    with torch.no_grad():
        banned = torch.tensor(list(never), dtype=torch.long)
        probs = logits.detach().float().cpu().index_fill(1, banned, -math.inf).softmax(-1)  # (N, V), a copy
        if not len(probs):
            return torch.zeros(0, dtype=torch.long, device=logits.device)
        cdf = probs.cumsum(dim=1)  # (N, V)
        u = torch.rand(len(probs), 1, generator=generator) * cdf[:, -1:]  # (N, 1)
        return torch.searchsorted(cdf, u, right=True).squeeze(1).to(logits.device)  # (N,)


@dataclass
class RTDOutput:
    """What :class:`ReplacedTokenDetection` returns: logits, and the input its discriminator saw."""

    generator_logits: Tensor  # (N, V) at the selected positions
    corrupted: Tensor  # (B, T) x^corrupt: the selected positions hold the generator's samples
    replaced_logits: Tensor  # (B, T) the discriminator's logit that a position's subword was replaced


class ReplacedTokenDetection(nn.Module):
    """ELECTRA (Clark et al. 2020): a generator fills the masked positions, the encoder detects the fakes::

        x^masked = x with the selected positions (15%) -> <mask>
        x^_i ~ p_G(. | x^masked) = softmax(Generator(x^masked)_i)    # at each selected i, no gradient
        x^corrupt = x with x_i -> x^_i at the selected positions
        D_t = sigmoid(w^T Encoder(Embed(x^corrupt) + PE)_t + b)      # (B, T): p(x^corrupt_t was replaced)

    The discriminator is ``encoder`` (fine-tuned afterwards, like the MLM's) plus ``replaced_head``; the
    :class:`Generator` (``generator_width`` times narrower) shares ``encoder``'s token embeddings and positions.
    """

    def __init__(self, cfg: TransformerConfig, vocab_size: int, *, generator_width: float = 0.25,
                 never_sample: Sequence[int] = (), pad_id: int = PAD_ID) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.encoder = TransformerEncoder(cfg, vocab_size, pad_id=pad_id)
        self.generator = Generator(generator_config(cfg, generator_width), cfg.d_model, vocab_size)
        self.replaced_head = nn.Linear(cfg.d_model, 1)  # w, b
        self.never_sample = tuple(sorted({pad_id, *never_sample}))  # ids no target is (<pad>, <mask>, ...)
        xavier_init_(self)

    def generator_logits(self, tokens: Tensor, selected: Tensor) -> Tensor:
        """The generator's logits ``(N, V)`` at the ``selected`` positions of ``tokens`` ``(B, T)`` (x^masked)."""
        enc = self.encoder
        mask = padding_mask(tokens, enc.pad_id).unsqueeze(1)  # (B, 1, 1, T)
        embedded = enc.embed(tokens) + enc.positions(tokens.size(1))  # (B, T, d_model), shared
        return self.generator(embedded, mask, selected, enc.embed.weight)

    def forward(self, tokens: Tensor, selected: Tensor, generator: torch.Generator | None = None) -> RTDOutput:
        """``tokens`` ``(B, T)`` (x^masked, padded), ``selected`` ``(B, T)`` bool; samples from ``generator``."""
        logits = self.generator_logits(tokens, selected)  # (N, V)
        samples = sample_replacements(logits, self.never_sample, generator)  # (N,), detached
        corrupted = tokens.masked_scatter(selected, samples)  # (B, T) x^corrupt
        hidden, _, _ = self.encoder(corrupted)  # (B, T, d_model)
        return RTDOutput(logits, corrupted, self.replaced_head(hidden).squeeze(-1))


def replaced_labels(corrupted: Tensor, original: Tensor, pad_id: int = PAD_ID) -> tuple[Tensor, Tensor]:
    """``(replaced, real)``, both ``(B, T)`` bool: ``replaced_t = [x^corrupt_t != x_t]``, ``real_t = [x_t != <pad>]``.

    A sample equal to the original subword counts as original (ELECTRA section 2).
    """
    real = original != pad_id
    return (corrupted != original) & real, real


class ReplacedTokenDetectionLoss(nn.Module):
    """ELECTRA's objective, summed: the trainer divides it by N, the number of selected positions::

        L = sum_{i selected} -log p_G(x_i | x^masked) + lambda * (N / M) * sum_{t not <pad>} BCE(D_t, replaced_t)

    With M the non-pad positions, ``L / N`` is the paper's ``mean MLM loss + lambda * mean BCE`` (lambda = 50).
    """

    def __init__(self, model: ReplacedTokenDetection, weight: float = 50.0) -> None:
        super().__init__()
        self.model = model
        self.weight = weight

    def forward(self, tokens: Tensor, selected: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
        out = self.model(tokens, selected)
        mlm = F.cross_entropy(out.generator_logits.float(), targets, label_smoothing=label_smoothing,
                              reduction="sum")
        original = tokens.masked_scatter(selected, targets)  # (B, T) x
        replaced, real = replaced_labels(out.corrupted, original, self.model.encoder.pad_id)
        bce = F.binary_cross_entropy_with_logits(out.replaced_logits.float()[real], replaced[real].float(),
                                                 reduction="sum")
        return mlm + self.weight * (int(selected.sum()) / max(int(real.sum()), 1)) * bce
