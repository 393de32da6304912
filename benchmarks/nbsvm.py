"""NBSVM-bi (Wang & Manning 2012) on attnkit's IMDB held-out reviews: the bag-of-bigrams anchor.

    python benchmarks/nbsvm.py                          # the split of configs/imdb.yaml; writes results/nbsvm.json
    python benchmarks/nbsvm.py --config configs/imdb-finetune.yaml

The same training rows and the same held-out reviews (10% of IMDB's labelled training reviews,
held out by movie) as the Transformer configs, read by attnkit's own reader and split
(:func:`attnkit.tasks.classification.read_validation` and the classification recipe), ``<br />``
tags as line breaks. The model, as in the paper's NBSVM-bi:

* features: binarized unigrams and bigrams of the whole review, ``x = 1{count > 0}``;
* the naive-Bayes log-count ratio ``r = log((p / |p|_1) / (q / |q|_1))`` with ``p = alpha + sum of x
  over positive reviews``, ``q`` the same over negative ones, ``alpha = 1``;
* a linear SVM (L2-regularised, squared hinge loss, ``C = 1``; liblinear through scikit-learn) on
  ``r * x``, then the interpolation ``w' = (1 - beta) * mean|w| + beta * w`` with ``beta = 0.25``.

Tokens: lowercased runs of word characters, plus ``!`` and ``?`` (the paper does not fix a
tokenizer). scikit-learn is a benchmark-only dependency (the ``dev`` extra); attnkit does not use it.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from attnkit.common.measure import peak_rss_gb, stamp  # noqa: E402
from attnkit.config.loader import load_config  # noqa: E402
from attnkit.config.schema import RunConfig  # noqa: E402
from attnkit.data.documents import clean_text  # noqa: E402
from attnkit.tasks.classification import ClassificationRecipe, read_validation  # noqa: E402
from tables import append_run, markdown, measured  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "nbsvm.json"
TOKEN = r"(?u)\b\w+\b|[!?]"


@dataclass
class NBSVM:
    """A fitted NBSVM: scores ``(r * x) . w + b``, positive for ``positive``."""

    r: np.ndarray  # (F,) log-count ratio
    w: np.ndarray  # (F,) interpolated SVM weights
    b: float
    positive: str
    negative: str

    def decision(self, x) -> np.ndarray:
        """``x`` (N, F) binary features (sparse or dense) -> (N,) scores."""
        return np.asarray(x.multiply(self.r).dot(self.w) if hasattr(x, "multiply") else (x * self.r) @ self.w) + self.b

    def predict(self, x) -> list[str]:
        return [self.positive if s > 0 else self.negative for s in self.decision(x)]


def nb_features(x, labels: list[str], alpha: float) -> tuple[np.ndarray, object, np.ndarray, str, str]:
    """The log-count ratio ``r`` (F,), the scaled features ``r * x``, the targets and the two class names."""
    negative, positive = sorted(set(labels))
    y = np.array([label == positive for label in labels])
    p = alpha + np.asarray(x[y].sum(axis=0)).ravel()  # (F,)
    q = alpha + np.asarray(x[~y].sum(axis=0)).ravel()
    r = np.log((p / p.sum()) / (q / q.sum()))  # (F,)
    return r, (x.multiply(r).tocsr() if hasattr(x, "multiply") else x * r), y, positive, negative


def fit_nbsvm(x, labels: list[str], *, alpha: float = 1.0, c: float = 1.0, beta: float = 0.25) -> NBSVM:
    """NBSVM on binary features ``x`` (N, F) of two classes (the second in sorted order is positive)."""
    from sklearn.svm import LinearSVC

    r, scaled, y, positive, negative = nb_features(x, labels, alpha)
    svm = LinearSVC(C=c, loss="squared_hinge", penalty="l2", dual=True, max_iter=10_000, random_state=0).fit(scaled, y)
    w = svm.coef_.ravel()
    w = (1 - beta) * np.abs(w).mean() + beta * w  # interpolation between a uniform and the SVM's weights
    return NBSVM(r, w, float(svm.intercept_[0]), positive, negative)


def fit_nblr(x, labels: list[str], *, alpha: float = 1.0, c: float = 1.0) -> NBSVM:
    """NB-LR: the same NB features with an L2-regularised logistic regression (scikit-learn's defaults, ``C = 1``)
    and no interpolation: the linear model attnkit's n-gram expert (``model.ngram_buckets``) trains by SGD."""
    from sklearn.linear_model import LogisticRegression

    r, scaled, y, positive, negative = nb_features(x, labels, alpha)
    lr = LogisticRegression(C=c, max_iter=5_000).fit(scaled, y)
    return NBSVM(r, lr.coef_.ravel(), float(lr.intercept_[0]), positive, negative)


def features(texts_train: list[str], texts_eval: list[str]):
    """Binary uni+bigram features of both sets, with the training set's vocabulary."""
    from sklearn.feature_extraction.text import CountVectorizer

    vectorizer = CountVectorizer(ngram_range=(1, 2), binary=True, lowercase=True, token_pattern=TOKEN,
                                 dtype=np.float64)
    return vectorizer.fit_transform(texts_train), vectorizer.transform(texts_eval), len(vectorizer.vocabulary_)


def cpu_model() -> str | None:
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        return None
    return found[1].strip() if found else None


def measure(config: str) -> dict:
    cfg = load_config(RunConfig, ROOT / config)
    start = time.perf_counter()
    train = list(ClassificationRecipe(cfg).examples())
    valid = read_validation(cfg, log=lambda message: print(message, file=sys.stderr))
    tags = cfg.data.line_break_tags
    x_train, x_valid, n_features = features([clean_text(t, tags) for t, _ in train],
                                            [clean_text(t, tags) for t in valid.texts])
    read_seconds = time.perf_counter() - start
    labels = [label for _, label in train]

    def accuracy(model: NBSVM) -> float:
        correct = sum(p == label for p, label in zip(model.predict(x_valid), valid.labels, strict=True))
        return round(100.0 * correct / len(valid.labels), 2)
    return {**stamp(), "cpu": cpu_model(), "command": "python benchmarks/nbsvm.py --config " + config,
            "config": config, "train_reviews": len(train), "held_out_reviews": len(valid.labels),
            "features": n_features, "held_out_accuracy": accuracy(fit_nbsvm(x_train, labels)),
            "nblr_held_out_accuracy": accuracy(fit_nblr(x_train, labels)),
            "seconds": round(time.perf_counter() - start, 1), "read_and_featurize_seconds": round(read_seconds, 1),
            "peak_rss_gb": round(peak_rss_gb(), 2), "alpha": 1.0, "C": 1.0, "beta": 0.25}


def split(run: dict) -> list[tuple[str, dict]]:
    """The race of each config's split."""
    return [(f"`{run['config']}` split", run)]


def nbsvm_accuracy(run: dict) -> float:
    return run["held_out_accuracy"]


def markdown_table(runs: list[dict]) -> str:
    """NBSVM-bi and NB-LR on the held-out reviews, per run."""
    rows = [[f"`{r['config']}` split", f"{r['train_reviews']:,}", f"{r['held_out_reviews']:,}", f"{r['features']:,}",
             f"**{r['held_out_accuracy']:.2f}**",
             f"**{r['nblr_held_out_accuracy']:.2f}**" if "nblr_held_out_accuracy" in r else "",
             f"{r['seconds']:.0f}", f"{r['peak_rss_gb']:.1f}", r.get("cpu") or "",
             measured(r)] for r in runs]
    return markdown(["held-out split", "training reviews", "held-out reviews", "uni+bigram features",
                     "NBSVM-bi held-out accuracy", "NB-LR held-out accuracy", "seconds, all", "peak RSS GB", "CPU",
                     "measured"], rows, "lrrrrrrrll")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/imdb.yaml", help="the classification config whose split to use")
    args = p.parse_args()
    result = measure(args.config)
    append_run(OUT, result)
    print(markdown_table([result]), end="")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
