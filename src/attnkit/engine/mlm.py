"""The masked-language-model objective with the tied output layer fused into the loss.

Equals :class:`attnkit.mlm.MLMLoss`: the encoder, the selected positions gathered with
:func:`~attnkit.engine.loss.select_positions` (``index_select``, a cheap backward), BERT's transform,
then :func:`~attnkit.engine.loss.linear_cross_entropy` against the embedding table, which never holds
all ``N x V`` logits at once.
"""

from __future__ import annotations

from torch import Tensor, nn

from .loss import linear_cross_entropy, select_positions


class FusedMLMLoss(nn.Module):
    """The engine's training objective for :class:`attnkit.mlm.MaskedLanguageModel`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, selected: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
        m = self.model
        hidden, _, _ = m.encoder(tokens)  # (B, T, D)
        h = m.transform(select_positions(hidden, selected))  # (N, D)
        return linear_cross_entropy(h, m.encoder.embed.weight, m.output_bias, targets,
                                    label_smoothing=label_smoothing)
