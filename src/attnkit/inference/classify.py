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
"""

from __future__ import annotations

from typing import Literal

import torch

from ..common.errors import UserError
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


def predict(run: LoadedRun, texts: list[str], batch_size: int = 256, reading: Reading = "whole"
            ) -> tuple[torch.Tensor, list[list[int]]]:
    """Class probabilities ``(N, C)`` of ``texts`` read as ``reading`` says (module docstring), and the token
    ids of each text as truncation gives them (what ``--with-attention`` shows)."""
    data = run.cfg.data
    n = window_length(data)
    full = document_ids(run.tok, texts, data)
    inputs = [framed(truncate(ids, n, data.truncate), data) for ids in full]  # as in training
    if reading == "whole":
        windows = [[framed(w, data) for w in reading_windows(ids, n, empty=[])] for ids in full]
    else:
        windows = [[framed(truncate(ids, n, reading), data)] for ids in full]
    owner = torch.tensor([i for i, w in enumerate(windows) for _ in w], dtype=torch.long)  # (W,) text of each
    logits = _logits(run, [x for w in windows for x in w], batch_size)  # (W, C)
    summed = torch.zeros(len(texts), logits.size(1)).index_add_(0, owner, logits)  # (N, C)
    mean = summed / torch.bincount(owner, minlength=len(texts)).clamp(min=1).unsqueeze(1)  # mean of window logits
    return mean.softmax(-1), inputs


def classify_texts(run: LoadedRun, texts: list[str], *, with_attention: bool = False, top: int = 5,
                   reading: Reading = "whole") -> list[str]:
    """``label<TAB>probability<TAB>text`` per input (plus ``<TAB>token:share ...`` with attention)."""
    classes = _classes(run)
    probs, ids = predict(run, texts, reading=reading)
    lines = []
    for i, text in enumerate(texts):
        p, c = probs[i].max(dim=0)
        line = f"{classes[int(c)]}\t{p.item():.4f}\t{text}"
        if with_attention:
            share = run.model.token_importance(pad_batch([ids[i]], PAD_ID))[0]  # (T,)
            pieces = run.tok.src_pieces_from_ids(ids[i])
            best = share.argsort(descending=True)[: min(top, len(pieces))].tolist()
            line += "\t" + " ".join(f"{pieces[j]}:{share[j].item():.2f}" for j in best)
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
