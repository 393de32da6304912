"""The reference training objectives: losses computed from the model's logits, in float32.

The engine's fused versions (:mod:`attnkit.engine.loss`) compute the same values without keeping the
logits; ``train.engine`` chooses. The masked-language-model loss is the textbook's
:class:`attnkit.mlm.MLMLoss`.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class Seq2SeqLoss(nn.Module):
    """The training objective of a sequence-to-sequence model: summed label-smoothed cross-entropy.

    ``loss = sum_i -sum_v q_iv log softmax(z_i)_v`` with ``q_i = (1 - eps) onehot(y_i) + eps / V``
    (Szegedy et al. 2016) over the scored (non-padding) positions, in float32. The engine's
    :class:`~attnkit.engine.loss.FusedSeq2SeqLoss` computes the same without keeping the logits.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, src: Tensor, tgt_in: Tensor, scored: Tensor, targets: Tensor,
                label_smoothing: float = 0.0) -> Tensor:
        logits = self.model(src, tgt_in, scored)  # (N, V)
        return F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing, reduction="sum")


class ClassificationLoss(nn.Module):
    """Summed (label-smoothed) cross-entropy of a classifier's logits, in float32; a classifier with several
    experts (:meth:`~attnkit.classifier.TransformerClassifier.experts`: the head and an n-gram expert) trains
    each on its own cross-entropy, the sum of theirs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
        experts = self.model.experts(tokens)  # (B, C) each: the head's logits, then any n-gram expert's
        return sum(F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing, reduction="sum")
                   for logits in experts)  # type: ignore[return-value]



class LanguageModelLoss(nn.Module):
    """Summed cross-entropy of every next token, ``loss = sum_t -log p(y_{t+1} | y_1..y_t)``, in float32
    (optionally label-smoothed, as :class:`Seq2SeqLoss`); with ``scored`` ``(B, T)`` only over the positions it
    marks (a conversation's assistant tokens: the others add nothing, to the loss or its gradient)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: Tensor, targets: Tensor, label_smoothing: float = 0.0,
                scored: Tensor | None = None) -> Tensor:
        logits = self.model(inputs)  # (B, T, V)
        if scored is not None:
            logits, targets = logits[scored], targets[scored]  # (N, V), (N,)
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), label_smoothing=label_smoothing,
                               reduction="sum")
