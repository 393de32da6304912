"""Predicting with a trained classifier: labels, probabilities, and the tokens the prediction drew on."""

from __future__ import annotations

import torch

from ..common.errors import UserError
from ..data.batching import pad_batch
from ..data.documents import classifier_inputs
from ..data.labelled import LabelledData
from ..data.tokenizer import PAD_ID
from ..runs.load import LoadedRun
from .scores import ClassificationScores, classification_scores


def _classes(run: LoadedRun) -> list[str]:
    if run.classes is None:
        raise UserError(f"{run.weights_path}: this is a {run.cfg.task} model, not a classifier")
    return run.classes


def predict(run: LoadedRun, texts: list[str], batch_size: int = 256) -> tuple[torch.Tensor, list[list[int]]]:
    """Class probabilities ``(N, C)`` and the token ids fed to the model."""
    ids = classifier_inputs(run.tok, texts, run.cfg.data)
    probs = []
    with torch.inference_mode():
        for start in range(0, len(ids), batch_size):
            x = pad_batch(ids[start: start + batch_size], PAD_ID)
            probs.append(run.model(x).float().softmax(-1))
    return (torch.cat(probs) if probs else torch.zeros(0, len(run.classes or []))), ids


def classify_texts(run: LoadedRun, texts: list[str], *, with_attention: bool = False, top: int = 5) -> list[str]:
    """``label<TAB>probability<TAB>text`` per input (plus ``<TAB>token:share ...`` with attention)."""
    classes = _classes(run)
    probs, ids = predict(run, texts)
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


def evaluate_classifier(run: LoadedRun, data: LabelledData) -> tuple[ClassificationScores, list[str]]:
    """Scores on labelled data and one predicted label per line; unknown labels are an error."""
    classes = _classes(run)
    index = {c: i for i, c in enumerate(classes)}
    unknown = sorted(set(data.labels) - set(index))
    if unknown:
        raise UserError(f"{data.path}: label(s) {unknown} in column '{data.label_column}' were not seen in "
                        f"training (known: {classes})")
    probs, _ = predict(run, data.texts)
    predicted = probs.argmax(-1).tolist()
    scores = classification_scores([index[y] for y in data.labels], predicted, classes)
    return scores, [classes[p] for p in predicted]
