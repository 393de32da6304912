"""benchmarks/nbsvm.py: NBSVM-bi, the bag-of-bigrams anchor beside the IMDB Transformers, on toy reviews."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("sklearn", reason="scikit-learn (the dev extra) runs the NBSVM benchmark")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from report import script  # imports a benchmark script by its path, as the report does

    return script("benchmarks/nbsvm.py")


def reviews(n: int, seed: int) -> list[tuple[str, str]]:
    """Toy reviews whose sentiment is carried by a bigram ("not good" is negative, "not bad" positive)."""
    rng = random.Random(seed)
    filler = ["the", "film", "plot", "was", "actors", "story", "and", "it"]
    rows = []
    for i in range(n):
        label = "pos" if i % 2 else "neg"
        cue = rng.choice(["not bad", "really good"] if label == "pos" else ["not good", "really bad"])
        words = rng.sample(filler, 4)
        words.insert(rng.randrange(5), cue)
        rows.append((" ".join(words), label))
    return rows


def test_log_count_ratio_and_predictions(bench) -> None:
    train, test = reviews(200, 1), reviews(60, 2)
    x_train, x_test, n_features = bench.features([t for t, _ in train], [t for t, _ in test])
    model = bench.fit_nbsvm(x_train, [label for _, label in train])
    assert (model.positive, model.negative) == ("pos", "neg")
    assert model.r.shape == (n_features,) == model.w.shape
    vocabulary = {f: i for i, f in enumerate(sorted(_vocabulary(bench, train)))}
    # the naive-Bayes ratio: positive for the positive bigram, negative for the negative one, ~0 for filler
    assert model.r[vocabulary["not bad"]] > 1 > -1 > model.r[vocabulary["not good"]]
    assert abs(model.r[vocabulary["film"]]) < 0.5
    # the unigram "not" and "good" occur in both classes: only the bigrams separate them, and NBSVM-bi does
    assert model.predict(x_test) == [label for _, label in test]
    scores = model.decision(x_test)
    assert np.allclose(scores, x_test.toarray() * model.r @ model.w + model.b)  # sparse == dense


def _vocabulary(bench, rows: list[tuple[str, str]]) -> set[str]:
    from sklearn.feature_extraction.text import CountVectorizer

    v = CountVectorizer(ngram_range=(1, 2), binary=True, token_pattern=bench.TOKEN).fit([t for t, _ in rows])
    return set(v.vocabulary_)


def test_interpolation_is_between_uniform_and_svm_weights(bench) -> None:
    train = reviews(100, 3)
    x, _, _ = bench.features([t for t, _ in train], [])
    labels = [label for _, label in train]
    svm_only, uniform = bench.fit_nbsvm(x, labels, beta=1.0), bench.fit_nbsvm(x, labels, beta=0.0)
    mixed = bench.fit_nbsvm(x, labels, beta=0.25)
    assert np.allclose(uniform.w, uniform.w[0])  # beta 0: every feature weighs mean |w|
    assert np.allclose(mixed.w, 0.75 * np.abs(svm_only.w).mean() + 0.25 * svm_only.w)


def test_table_lists_each_run_it_is_given(bench) -> None:
    run = {"date": "2026-11-23T12:00:00+00:00", "commit": "abc1234", "config": "configs/imdb.yaml",
           "train_reviews": 22577, "held_out_reviews": 2423, "features": 1360170, "held_out_accuracy": 90.05,
           "seconds": 27.0, "peak_rss_gb": 0.8, "cpu": "AMD EPYC"}
    table = bench.markdown_table([run, {**run, "held_out_accuracy": 89.5, "commit": "def5678"}])
    assert "**90.05**" in table and "**89.50**" in table and len(table.strip().splitlines()) == 4
    assert bench.split(run) == [("`configs/imdb.yaml` split", run)] and bench.nbsvm_accuracy(run) == 90.05


def test_nblr_is_logistic_regression_on_the_same_nb_features(bench) -> None:
    """NB-LR (the linear model attnkit's n-gram expert trains): the NBSVM's ratio, logistic weights, no mixing."""
    from sklearn.linear_model import LogisticRegression

    train, test = reviews(200, 1), reviews(60, 2)
    x_train, x_test, _ = bench.features([t for t, _ in train], [t for t, _ in test])
    labels = [label for _, label in train]
    nblr, nbsvm = bench.fit_nblr(x_train, labels), bench.fit_nbsvm(x_train, labels)
    assert np.array_equal(nblr.r, nbsvm.r)
    want = LogisticRegression(max_iter=5_000).fit(x_train.multiply(nblr.r).tocsr(), [y == "pos" for y in labels])
    assert np.allclose(nblr.decision(x_test), want.decision_function(x_test.multiply(nblr.r).tocsr()))
    assert nblr.predict(x_test) == [label for _, label in test]
