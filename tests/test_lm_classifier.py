"""The language-model route to classification: :class:`DecoderClassifier` over a causal language model's layers,
fine-tuned from a ``task: lm`` run with ``model.init_from`` (``model.classifier: decoder``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnkit.classifier import DecoderClassifier, pool
from attnkit.cli import main
from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig
from attnkit.engine import to_eager
from attnkit.runs.checkpoint import load_weights
from attnkit.tasks import load_run, make_task
from attnkit.transformer import TransformerConfig
from attnkit.vocab import PAD_ID
from test_lm_task import TINY_LM, lm_config, quiet, train_lm
from tiny_runs import labelled_rows, write_lines, write_tsv, write_yaml

CFG = TransformerConfig(d_model=32, n_heads=4, d_ff=64, decoder_layers=2, dropout=0.0, max_len=64,
                        positions="rope", n_kv_heads=2, norm="rmsnorm", activation="swiglu", bias=False)


def padded_pair(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of two rows, the short one padded on the right, and the short row alone ``(1, 7)``."""
    g = torch.Generator().manual_seed(seed)
    long, short = torch.randint(5, 50, (12,), generator=g), torch.randint(5, 50, (7,), generator=g)
    batch = torch.full((2, 12), PAD_ID)
    batch[0], batch[1, :7] = long, short
    return batch, short[None]


@pytest.mark.parametrize("pooling", ["last", "mean", "max"])
@pytest.mark.parametrize("fast", [False, True])
def test_padding_on_the_right_changes_no_logit(pooling: str, fast: bool) -> None:
    torch.manual_seed(0)
    model = DecoderClassifier(CFG, 50, 3, pooling=pooling).eval()
    if fast:
        to_eager(model)
    batch, alone = padded_pair()
    with torch.no_grad():
        torch.testing.assert_close(model(batch)[1], model(alone)[0], atol=1e-5, rtol=1e-5)


def test_last_pooling_is_the_language_models_state_at_the_last_real_token() -> None:
    torch.manual_seed(0)
    model = DecoderClassifier(CFG, 50, 2, pooling="last").eval()
    batch, alone = padded_pair()
    with torch.no_grad():
        hidden = model.lm.features(alone)[0]  # (1, 7, D)
        z = pool(model.lm.features(batch)[0], batch != PAD_ID, "last")  # (2, D)
    torch.testing.assert_close(z[1], hidden[0, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(alone), model.head(hidden[:, -1]))


def test_token_importance_sums_to_one_over_real_tokens_and_skips_padding() -> None:
    torch.manual_seed(0)
    batch, _ = padded_pair()
    for pooling in ("last", "mean", "max"):
        share = DecoderClassifier(CFG, 50, 2, pooling=pooling).eval().token_importance(batch)  # (2, 12)
        torch.testing.assert_close(share.sum(dim=1), torch.ones(2))
        assert share[1, 7:].abs().sum() == 0


# -- fine-tuning a task: lm run ----------------------------------------------------------------


def sentiment_files(tmp: Path) -> tuple[Path, Path]:
    """The texts as a language model reads them (one per line) and the labelled rows."""
    rows = labelled_rows(300, seed=1)
    return write_lines(tmp / "texts.txt", [t for t, _ in rows]), write_tsv(tmp / "train.tsv", rows)


def classify_raw(tsv: Path, init_from: Path, **model) -> dict:
    return {"task": "classify",
            "data": {"train": str(tsv), "valid_fraction": 0.2, "max_len": 40},
            "model": {"classifier": "decoder", "pooling": "last", "init_from": str(init_from),
                      "transformer": {**TINY_LM, "dropout": 0.1}, **model},
            "train": {"max_tokens": 800, "max_updates": 150, "valid_every": 150, "progress": False, "precision": "fp32",
                      "threads": 1, "warmup": 2, "lr": 1e-2, "average_last": 0, "label_smoothing": 0.0}}


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("lm-route")
    texts, tsv = sentiment_files(tmp)
    train_lm(lm_config(texts, documents="lines", train_options={"max_updates": 100}), tmp / "lm")
    return tmp / "lm", tsv


def test_init_from_copies_every_language_model_weight(lm_run, tmp_path: Path) -> None:
    lm, tsv = lm_run
    task = make_task(load_config(RunConfig, classify_raw(tsv, lm)), tmp_path / "fine", quiet)
    model = task.build_model()
    assert isinstance(model, DecoderClassifier)
    source, _ = load_weights(lm / "best.safetensors")
    own = model.state_dict()
    body = {k: v for k, v in source.items() if not k.startswith("out_proj.")}  # the output layer is not a classifier's
    assert body and all(torch.equal(own[f"lm.{k}"], v) for k, v in body.items())
    assert {k for k in own if not k.startswith("lm.")} == {"head.weight", "head.bias"}
    assert {k[3:] for k in own if k.startswith("lm.")} == set(body)
    assert (tmp_path / "fine" / "tokenizer.json").read_bytes() == (lm / "tokenizer.json").read_bytes()


def test_a_language_model_fine_tuned_as_a_classifier_learns_classifies_and_evaluates(lm_run, tmp_path: Path,
                                                                                      capsys) -> None:
    lm, tsv = lm_run
    run = tmp_path / "fine"
    assert main(["train", str(write_yaml(tmp_path / "c.yaml", classify_raw(tsv, lm))), "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(run), "--data", str(tsv)]) == 0
    out = capsys.readouterr().out
    accuracy = float(out.split("accuracy")[1].split()[0].strip(":=%"))
    assert accuracy > 80  # one cue word per text, 150 updates: chance is 50
    assert isinstance(load_run(run).model, DecoderClassifier)
    inputs = write_lines(tmp_path / "in.txt", ["the film was superb", "an awful plot"])
    assert main(["classify", str(run), "-i", str(inputs), "--with-attention"]) == 0
    labels = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines() if "\t" in line]
    assert labels[:2] == ["pos", "neg"]
    # its causal self-attention and what the pooled states drew on (a traceback before)
    assert main(["attention", str(run), "--src", "the film was superb", "-o", str(tmp_path / "attn"), "--html"]) == 0
    page = next((tmp_path / "attn").glob("*.html")).read_text(encoding="utf-8")
    assert "causal self-attention" in page and "encoder self-attention" not in page


def test_the_wrong_kind_of_run_or_pooling_is_a_one_line_error(lm_run, tmp_path: Path, capsys) -> None:
    lm, tsv = lm_run
    encoder = classify_raw(tsv, lm, classifier="encoder")
    encoder["model"]["transformer"] = {**TINY_LM, "encoder_layers": 2, "positions": "sinusoidal"}
    encoder["model"]["pooling"] = "max"
    assert main(["train", str(write_yaml(tmp_path / "e.yaml", encoder)), "--run-dir", str(tmp_path / "e")]) == 2
    assert "is a lm run; give a `task: pretrain` run (model.classifier: decoder starts from a `task: lm` run)" in \
        capsys.readouterr().err
    first = classify_raw(tsv, lm, pooling="first")
    assert main(["train", str(write_yaml(tmp_path / "f.yaml", first)), "--run-dir", str(tmp_path / "f")]) == 2
    assert "model.pooling: first reads one token" in capsys.readouterr().err
    wider = classify_raw(tsv, lm)
    wider["model"]["transformer"]["d_ff"] = 96
    assert main(["train", str(write_yaml(tmp_path / "w.yaml", wider)), "--run-dir", str(tmp_path / "w")]) == 2
    assert "model.transformer.d_ff is 96 here but 64 in" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in "efw")


def test_an_untied_language_model_gives_its_embedding_not_its_output_layer(tmp_path: Path) -> None:
    """An untied language model (an imported Llama's) has an output layer apart from its embedding; the classifier
    starts from the embedding, and has no output layer to be overwritten by it."""
    texts, tsv = sentiment_files(tmp_path)
    train_lm(lm_config(texts, documents="lines", model={"tie_output": False}, train_options={"max_updates": 3}),
             tmp_path / "lm")
    raw = classify_raw(tsv, tmp_path / "lm")
    raw["model"]["transformer"]["tie_output"] = False
    model = make_task(load_config(RunConfig, raw), tmp_path / "fine", quiet).build_model()
    source, _ = load_weights(tmp_path / "lm" / "best.safetensors")
    assert not torch.equal(source["embed.embedding.weight"], source["out_proj.weight"])
    assert torch.equal(model.state_dict()["lm.embed.embedding.weight"], source["embed.embedding.weight"])
    assert not any(k.startswith("lm.out_proj") for k in model.state_dict())
