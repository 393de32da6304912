"""Scores: sacreBLEU and chrF for translation; accuracy, macro-F1 and a confusion matrix for classification."""

from __future__ import annotations

from dataclasses import dataclass

import sacrebleu


@dataclass
class TranslationScores:
    bleu: float
    chrf: float
    bleu_lowercase: float
    signature: str  # sacreBLEU's signature of the cased BLEU, e.g. nrefs:1|case:mixed|eff:no|tok:13a|...

    def __str__(self) -> str:
        return (f"BLEU {self.bleu:.2f}  chrF {self.chrf:.2f}  BLEU(lowercased) {self.bleu_lowercase:.2f}\n"
                f"signature: {self.signature}")


def translation_scores(hypotheses: list[str], references: list[str]) -> TranslationScores:
    """Corpus BLEU (cased, detokenized, 13a), lowercased BLEU and chrF with sacreBLEU."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu = sacrebleu.metrics.BLEU()
    cased = bleu.corpus_score(hypotheses, [references])
    lower = sacrebleu.metrics.BLEU(lowercase=True).corpus_score(hypotheses, [references])
    chrf = sacrebleu.metrics.CHRF().corpus_score(hypotheses, [references])
    return TranslationScores(cased.score, chrf.score, lower.score, str(bleu.get_signature()))


@dataclass
class ClassificationScores:
    accuracy: float  # percent
    macro_f1: float  # percent
    classes: list[str]
    confusion: list[list[int]]  # confusion[true][predicted]

    def __str__(self) -> str:
        width = max(8, *(len(c) for c in self.classes)) + 1
        lines = [f"accuracy {self.accuracy:.2f}  macro-F1 {self.macro_f1:.2f}",
                 "confusion matrix (rows: true, columns: predicted)",
                 " " * width + "".join(c.rjust(width) for c in self.classes)]
        lines += [c.ljust(width) + "".join(str(n).rjust(width) for n in row)
                  for c, row in zip(self.classes, self.confusion, strict=True)]
        return "\n".join(lines)


def classification_scores(true: list[int], predicted: list[int], classes: list[str]) -> ClassificationScores:
    """Accuracy, macro-averaged F1 (classes absent from both lists count as F1 0) and the confusion matrix."""
    k = len(classes)
    confusion = [[0] * k for _ in range(k)]
    for t, p in zip(true, predicted, strict=True):
        confusion[t][p] += 1
    f1s = []
    for c in range(k):
        tp = confusion[c][c]
        fp = sum(confusion[r][c] for r in range(k)) - tp
        fn = sum(confusion[c]) - tp
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    accuracy = 100.0 * sum(confusion[c][c] for c in range(k)) / max(len(true), 1)
    return ClassificationScores(accuracy, 100.0 * sum(f1s) / k, classes, confusion)
