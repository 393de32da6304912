"""The n-gram expert (``model.ngram_buckets``): NB-weighted logistic regression over hashed subword uni+bigrams,
beside a Transformer classifier's head, the prediction the product of the two experts (attnkit/ngrams.py)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnkit.classifier import DecoderClassifier, TransformerClassifier
from attnkit.cli import main
from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig
from attnkit.ngrams import BIGRAM_PRIME, NGramExpert, product_of_experts
from attnkit.tasks import load_run, make_task
from attnkit.tasks.objectives import ClassificationLoss
from attnkit.transformer import TransformerConfig
from attnkit.vocab import PAD_ID
from tiny_runs import classification_config, write_lines, write_yaml

V, BUCKETS = 20, 97


def ngrams_of(row: list[int]) -> set[int]:
    """The expert's n-gram ids of one unpadded row, by the module docstring's definition."""
    bigrams = {V + (a * BIGRAM_PRIME + b) % (BUCKETS - V) for a, b in zip(row[:-1], row[1:], strict=True)}
    return set(row) | bigrams


def test_features_are_each_distinct_ngram_of_a_row_once_and_never_padding() -> None:
    expert = NGramExpert(V, 2, BUCKETS, PAD_ID)
    rows = [[5, 6, 5, 6, 7], [9, 9, 9]]
    tokens = torch.full((2, 6), PAD_ID)
    tokens[0, :5], tokens[1, :3] = torch.tensor(rows[0]), torch.tensor(rows[1])
    r, ids = expert.features(tokens)
    found = [set(ids[r == i].tolist()) for i in range(2)]
    assert found == [ngrams_of(rows[0]), ngrams_of(rows[1])]
    assert len(ids) == sum(len(f) for f in found)  # binary: (5, 6) occurs twice, counted once
    assert PAD_ID not in ids.tolist() and all(0 <= i < BUCKETS for i in ids.tolist())


def test_ratios_are_the_naive_bayes_log_count_ratios_of_the_training_texts() -> None:
    expert = NGramExpert(V, 3, BUCKETS, PAD_ID, alpha=1.0)
    texts = [[5, 6, 7], [5, 5, 8], [9, 6], [7, 8, 9, 10], [5, 11]]
    labels = [0, 0, 1, 2, 1]
    tokens = torch.full((5, 4), PAD_ID)
    for i, t in enumerate(texts):
        tokens[i, :len(t)] = torch.tensor(t)
    expert.fit_ratios([(tokens[:2], torch.tensor(labels[:2])), (tokens[2:], torch.tensor(labels[2:]))])
    counts = [Counter(f for t, y in zip(texts, labels, strict=True) if y == c for f in ngrams_of(t))
              for c in range(3)]
    for c in range(3):
        p = [1 + counts[c][f] for f in range(BUCKETS)]
        q = [1 + sum(counts[o][f] for o in range(3) if o != c) for f in range(BUCKETS)]
        want = [math.log((p[f] / sum(p)) / (q[f] / sum(q))) for f in range(BUCKETS)]
        torch.testing.assert_close(expert.ratio[:, c], torch.tensor(want, dtype=torch.float32))


def test_logits_are_the_nb_weighted_linear_model_and_padding_changes_none() -> None:
    torch.manual_seed(0)
    expert = NGramExpert(V, 2, BUCKETS, PAD_ID)
    expert.ratio.normal_()
    torch.nn.init.normal_(expert.weight)
    torch.nn.init.normal_(expert.bias)
    row = [3, 4, 3, 12, 19]
    x = torch.zeros(BUCKETS)
    x[sorted(ngrams_of(row))] = 1.0  # the binary features
    want = (x[:, None] * expert.ratio * expert.weight).sum(dim=0) + expert.bias  # (C,)
    padded = torch.tensor([row + [PAD_ID] * 4])
    torch.testing.assert_close(expert(padded)[0], want)
    torch.testing.assert_close(expert(torch.tensor([row]))[0], want)


def test_product_of_experts_multiplies_the_probabilities() -> None:
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    assert product_of_experts([a]) is a
    joint = F.softmax(product_of_experts([a, b]), dim=-1)
    want = F.softmax(a, dim=-1) * F.softmax(b, dim=-1)
    torch.testing.assert_close(joint, want / want.sum(dim=-1, keepdim=True))


CFG = TransformerConfig(d_model=16, n_heads=2, d_ff=32, encoder_layers=1, decoder_layers=1, dropout=0.0,
                        max_len=16)


@pytest.mark.parametrize("kind", [TransformerClassifier, DecoderClassifier])
def test_each_expert_is_trained_on_its_own_loss(kind) -> None:
    """The loss is the sum of the experts' cross-entropies: the head's gradients are those it gets alone."""
    torch.manual_seed(0)
    tokens, targets = torch.randint(4, V, (3, 8)), torch.tensor([0, 1, 0])
    with_ngrams = kind(CFG, V, 2, ngram_buckets=BUCKETS)
    with_ngrams.ngrams.ratio.normal_()
    alone = kind(CFG, V, 2)
    alone.load_state_dict({k: v for k, v in with_ngrams.state_dict().items() if not k.startswith("ngrams.")})
    loss = ClassificationLoss(with_ngrams)(tokens, targets)
    head, expert = with_ngrams.experts(tokens)
    torch.testing.assert_close(loss, F.cross_entropy(head, targets, reduction="sum")
                               + F.cross_entropy(expert, targets, reduction="sum"))
    loss.backward()
    ClassificationLoss(alone)(tokens, targets).backward()
    for (name, p), q in zip(alone.named_parameters(), [p for n, p in with_ngrams.named_parameters()
                                                       if not n.startswith("ngrams.")], strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert with_ngrams.ngrams.weight.grad.abs().sum() > 0
    torch.testing.assert_close(with_ngrams(tokens), F.log_softmax(head, -1) + F.log_softmax(expert, -1))


def ngram_config(tmp: Path, **model) -> dict:
    raw = classification_config(tmp)
    raw["model"].update({"ngram_buckets": 4096, "ngram_lr": 4.0, **model})
    return raw


def test_a_classifier_with_an_ngram_expert_trains_saves_and_classifies(tmp_path: Path, capsys) -> None:
    raw = ngram_config(tmp_path)
    task = make_task(load_config(RunConfig, raw), tmp_path / "probe", lambda m: None)
    model = task.build_model()
    assert model.ngrams.ratio.abs().sum() > 0  # fitted on the training texts before the first update
    groups = task.parameter_groups(model)
    assert [g["lr_scale"] for g in groups] == [1.0, 4.0]
    assert groups[1]["params"] == [model.ngrams.weight, model.ngrams.bias]
    run = tmp_path / "run"
    assert main(["train", str(write_yaml(tmp_path / "c.yaml", raw)), "--run-dir", str(run)]) == 0
    loaded = load_run(run)
    torch.testing.assert_close(loaded.model.ngrams.ratio, model.ngrams.ratio)  # saved with the weights
    capsys.readouterr()
    assert main(["evaluate", str(run), "--data", raw["data"]["valid"]]) == 0
    accuracy = float(capsys.readouterr().out.split("accuracy")[1].split()[0].strip(":=%"))
    assert accuracy > 80  # one cue word per text: the n-gram expert alone learns that
    inputs = write_lines(tmp_path / "in.txt", ["the film was superb", "an awful plot"])
    assert main(["classify", str(run), "-i", str(inputs)]) == 0
    lines = [line.split("\t") for line in capsys.readouterr().out.splitlines() if "\t" in line]
    assert [label for label, *_ in lines] == ["pos", "neg"]
    assert all(0.5 < float(p) <= 1.0 for _, p, *_ in lines)


@pytest.mark.parametrize(("model", "message"), [
    ({"ngram_buckets": -1}, "model.ngram_buckets must be 0 (no n-gram expert) or a number of slots, got -1"),
    ({"ngram_buckets": 10}, "model.ngram_buckets (10) must exceed the vocabulary size"),
    ({"ngram_lr": 0}, "model.ngram_lr must be a positive multiple of train.lr, got 0"),
])
def test_bad_ngram_settings_are_one_line_errors(tmp_path: Path, capsys, model: dict, message: str) -> None:
    raw = ngram_config(tmp_path, **model)
    assert main(["train", str(write_yaml(tmp_path / "c.yaml", raw)), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
