"""Predicting with a trained classifier: labels, probabilities, and the tokens the prediction drew on.

How a text longer than the model's window (``data.max_len`` subwords) is read (``reading``):

============  ===========================================================================================
``whole``     (default) overlapping windows of ``max_len`` subwords, half a window apart, covering the whole
              text (:func:`attnkit.data.documents.reading_windows`); the text's logits are the **mean of the
              windows' logits**, then the softmax. A text that fits is one window, read as it was trained.
``head``      its first ``max_len`` subwords.
``head+tail`` its first quarter and last three quarters of ``max_len`` subwords.
============  ===========================================================================================

Training reads the configured truncation (``data.truncate``), so ``head``/``head+tail`` give what
validation measured.

What a prediction drew on (:func:`explain`, shown by ``classify --with-attention``, ``attention`` and the
server's attention view): each window's **evidence** for the predicted class ``c``,
``e_w = z_w[c] - mean_k z_w[k]`` (the text's own centred logit is their mean, so the windows with the
largest ``e_w`` carried the prediction and those below zero argued against it), and each piece's
**importance**, ``sum_w (1/W) * share_w(piece)``: the windows' token importance
(:meth:`attnkit.classifier.TransformerClassifier.token_importance`) weighted as their logits are averaged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..common.errors import UserError
from ..config.schema import DataConfig
from ..data.batching import pad_batch
from ..data.documents import document_ids, framed, reading_windows, truncate, window_length
from ..data.labelled import LabelledData
from ..data.tokenizer import PAD_ID
from ..runs.load import LoadedRun
from .scores import ClassificationScores, classification_scores

Reading = Literal["whole", "head", "head+tail"]
READINGS: tuple[Reading, ...] = ("whole", "head", "head+tail")


def _classes(run: LoadedRun) -> list[str]:
    if run.classes is None:
        raise UserError(f"{run.weights_path}: this is a {run.cfg.task} model, not a classifier")
    return run.classes


def _logits(run: LoadedRun, windows: list[list[int]], batch_size: int) -> torch.Tensor:
    """The model's logits ``(W, C)`` of every window, in batches of similar length (less padding)."""
    order = sorted(range(len(windows)), key=lambda i: len(windows[i]))
    out = torch.zeros(len(windows), len(run.classes or []))
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            chunk = order[start: start + batch_size]
            out[chunk] = run.model(pad_batch([windows[i] for i in chunk], PAD_ID)).float()  # (b, C)
    return out


def text_windows(ids: Sequence[int], data: DataConfig, reading: Reading
                 ) -> tuple[list[list[int]], list[list[int]]]:
    """The windows a classifier reads of one text's ids as ``reading`` says (module docstring), framed
    (:func:`~attnkit.data.documents.framed`), and for each of their ids its position in ``ids`` (-1 for
    ``<s>``, ``</s>`` and the ``<pad>`` of an empty text)."""
    n = window_length(data)
    everywhere = range(len(ids))
    spans = reading_windows(everywhere, n, empty=[]) if reading == "whole" else [truncate(everywhere, n, reading)]
    windows = [framed([ids[p] for p in span], data) for span in spans]
    positions = [[-1, *span, -1] if data.frame else (span or [-1]) for span in spans]  # where framed() puts ids
    return windows, positions


def predict(run: LoadedRun, texts: list[str], batch_size: int = 256, reading: Reading = "whole"
            ) -> tuple[torch.Tensor, list[list[int]]]:
    """Class probabilities ``(N, C)`` of ``texts`` read as ``reading`` says (module docstring), and the token
    ids of each text as training truncated it."""
    data = run.cfg.data
    full = document_ids(run.tok, texts, data)
    inputs = [framed(truncate(ids, window_length(data), data.truncate), data) for ids in full]  # as in training
    windows = [text_windows(ids, data, reading)[0] for ids in full]
    owner = torch.tensor([i for i, w in enumerate(windows) for _ in w], dtype=torch.long)  # (W,) text of each
    logits = _logits(run, [x for w in windows for x in w], batch_size)  # (W, C)
    summed = torch.zeros(len(texts), logits.size(1)).index_add_(0, owner, logits)  # (N, C)
    mean = summed / torch.bincount(owner, minlength=len(texts)).clamp(min=1).unsqueeze(1)  # mean of window logits
    return mean.softmax(-1), inputs


@dataclass(frozen=True)
class Explanation:
    """What a classifier's prediction for one text drew on (module docstring).

    :param probs: ``(C,)``: the softmax of the mean of the windows' logits, as :func:`predict`.
    :param pieces: the text's pieces, ``L`` of them, in order.
    :param windows: the framed ids of each window the text was read as (``W`` of them).
    :param positions: per window, the position in ``pieces`` of each id (-1: ``<s>``, ``</s>``, ``<pad>``).
    :param window_logits: ``(W, C)``; ``window_importance``: per window ``(T_w,)``, summing to 1.
    """

    probs: Tensor
    pieces: list[str]
    windows: list[list[int]]
    positions: list[list[int]]
    window_logits: Tensor
    window_importance: list[Tensor]

    @property
    def predicted(self) -> int:
        return int(self.probs.argmax())

    def evidence(self) -> Tensor:
        """``(W,)``: ``e_w = z_w[c] - mean_k z_w[k]`` for the predicted class ``c``; their mean is the text's."""
        z = self.window_logits  # (W, C)
        return z[:, self.predicted] - z.mean(dim=1)

    def importance(self) -> Tensor:
        """``(L,)``: ``sum_w (1/W) * share_w(piece)``, a piece read by two windows counted in both;
        sums to 1 less what ``<s>``, ``</s>`` drew."""
        out = torch.zeros(len(self.pieces))
        for share, where in zip(self.window_importance, self.positions, strict=True):
            real = torch.tensor(where) >= 0  # (T_w,)
            out.index_add_(0, torch.tensor(where)[real], share[real] / len(self.windows))
        return out


def explain(run: LoadedRun, text: str, reading: Reading = "whole") -> Explanation:
    """Read ``text`` as :func:`predict` does and say what the prediction drew on (:class:`Explanation`)."""
    _classes(run)
    data = run.cfg.data
    ids = document_ids(run.tok, [text], data)[0]
    windows, positions = text_windows(ids, data, reading)
    batch = pad_batch(windows, PAD_ID).to(next(run.model.parameters()).device)  # (W, T)
    with torch.inference_mode():
        logits = run.model(batch).float().cpu()  # (W, C)
        share = run.model.token_importance(batch).float().cpu()  # (W, T)
    return Explanation(logits.mean(dim=0).softmax(-1), run.tok.src_pieces_from_ids(ids), windows, positions,
                       logits, [share[w, : len(x)] for w, x in enumerate(windows)])


def classify_texts(run: LoadedRun, texts: list[str], *, with_attention: bool = False, top: int = 5,
                   reading: Reading = "whole") -> list[str]:
    """``label<TAB>probability<TAB>text`` per input (plus ``<TAB>piece:importance ...``, the ``top`` pieces of
    :meth:`Explanation.importance`, with attention)."""
    classes = _classes(run)
    probs, _ = predict(run, texts, reading=reading)
    lines = []
    for i, text in enumerate(texts):
        p, c = probs[i].max(dim=0)
        line = f"{classes[int(c)]}\t{p.item():.4f}\t{text}"
        if with_attention:
            e = explain(run, text, reading)
            share = e.importance()  # (L,)
            best = share.argsort(descending=True)[: min(top, len(e.pieces))].tolist()
            line += "\t" + " ".join(f"{e.pieces[j]}:{share[j].item():.2f}" for j in best)
        lines.append(line)
    return lines


def evaluate_classifier(run: LoadedRun, data: LabelledData, reading: Reading = "whole"
                        ) -> tuple[ClassificationScores, list[str]]:
    """Scores on labelled data and one predicted label per line; unknown labels are an error."""
    classes = _classes(run)
    index = {c: i for i, c in enumerate(classes)}
    unknown = sorted(set(data.labels) - set(index))
    if unknown:
        raise UserError(f"{data.path}: label(s) {unknown} in column '{data.label_column}' were not seen in "
                        f"training (known: {classes})")
    probs, _ = predict(run, data.texts, reading=reading)
    predicted = probs.argmax(-1).tolist()
    scores = classification_scores([index[y] for y in data.labels], predicted, classes)
    return scores, [classes[p] for p in predicted]
