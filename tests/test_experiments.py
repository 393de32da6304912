"""Every experiment in ``experiments/`` runs on tiny inputs, and its docs table renders what it wrote.

Each script is run as ``python experiments/NAME.py ...`` runs it (in this process, its ``__main__``), on a tiny
trained run (conftest's) or a few updates of a tiny model, with ``--figures`` pointing at a scratch folder, so
``docs/figures`` is never touched. The experiments read Multi30k and tiny Shakespeare from ``../shared``: without
it they skip.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from conftest import _trained
from tiny_runs import translation_config

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
MULTI30K, SHAKESPEARE = DATA / "multi30k", DATA / "shakespeare" / "input.txt"
needs_multi30k = pytest.mark.skipif(not (MULTI30K / "val.de.gz").exists(), reason="needs ../shared/data/multi30k")
#: A tiny Transformer and RNN for the experiments that train: Multi30k's dev set as the training set.
TINY_TRANSLATION = [f"data.train={MULTI30K / 'val.de.gz'}", f"data.train_tgt={MULTI30K / 'val.en.gz'}",
                    "data.tokenizer.vocab_size=300", "train.max_updates=2", "train.valid_every=2",
                    "train.valid_bleu_sentences=4", "train.warmup=1", "train.threads=1", "train.precision=fp32"]
TINY_TRANSFORMER = ["model.transformer.d_model=32", "model.transformer.n_heads=2", "model.transformer.d_ff=64",
                    "model.transformer.encoder_layers=1", "model.transformer.decoder_layers=1"]


@pytest.fixture(scope="module")
def multi30k_run(tmp_path_factory) -> Path:
    """A tiny Transformer trained for a few updates on Multi30k's dev pairs: it reads German, as the experiments'
    runs do, has positions for their longest sentences, and a first and a last layer to draw."""
    def config(tmp: Path) -> dict:
        raw = translation_config(tmp)
        raw["data"].update(train=str(MULTI30K / "val.de.gz"), train_tgt=str(MULTI30K / "val.en.gz"), max_len=256,
                           tokenizer={"vocab_size": 300})
        raw["model"]["transformer"].update(max_len=512, encoder_layers=2, decoder_layers=2)  # a first and a last
        return raw

    return _trained(tmp_path_factory, "multi30k", config)


def run_experiment(name: str, *args: str, monkeypatch: pytest.MonkeyPatch, figures: Path) -> dict:
    """Run ``experiments/NAME.py ARGS --figures FIGURES`` as a script; return the module's globals."""
    script = ROOT / "experiments" / f"{name}.py"
    monkeypatch.setattr(sys, "argv", [str(script), *args, "--figures", str(figures)])
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    try:
        return runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:  # a script that ends with sys.exit(main())
        assert done.code in (0, None), done.code
        return runpy.run_path(str(script), run_name="experiment")


def written(figures: Path, name: str) -> dict:
    data = json.loads((figures / f"{name}.json").read_text(encoding="utf-8"))
    assert data["command"].startswith("python experiments/") and data["run_seconds"] >= 0
    return data


def test_scaling_random_vectors(monkeypatch, tmp_path: Path) -> None:
    module = run_experiment("scaling", "--pairs", "2000", "--queries", "64", "--keys", "8", "--threads", "1",
                            monkeypatch=monkeypatch, figures=tmp_path)
    data = written(tmp_path, "scaling")
    assert (tmp_path / "scaling.png").exists()
    assert "| 1024 |" in module["markdown_table"](data)


@needs_multi30k
def test_scaling_training(monkeypatch, tmp_path: Path) -> None:
    module = run_experiment("scaling", "--train", "--minutes", "1", "--valid-every", "2", "--runs", str(tmp_path),
                            "--set", *TINY_TRANSLATION, *TINY_TRANSFORMER, "--threads", "1",
                            monkeypatch=monkeypatch, figures=tmp_path)
    data = written(tmp_path, "scaling-training")
    assert "dev loss" in module["markdown_training"](data)


@needs_multi30k
def test_bottleneck_on_a_trained_run(monkeypatch, tmp_path: Path, multi30k_run: Path) -> None:
    module = run_experiment("bottleneck", "--models", "transformer", "--run-dir", f"transformer={multi30k_run}",
                            "--sentences", "12", "--beam", "1", "--threads", "1",
                            monkeypatch=monkeypatch, figures=tmp_path)
    data = written(tmp_path, "bottleneck")
    assert [m["model"] for m in data["models"]] == ["transformer"] and data["sentences"] == 12
    assert module["markdown_table"](data).count("\n") > 2


@needs_multi30k
def test_heads_profile_of_a_trained_run(monkeypatch, tmp_path: Path, multi30k_run: Path) -> None:
    module = run_experiment("heads", "--skip-training", "--figure-run", str(multi30k_run), "--dev-sentences",
                            "8", "--example", "1", "--threads", "1", monkeypatch=monkeypatch, figures=tmp_path)
    data = written(tmp_path, "heads")
    profile = data["encoder_head_profile"]
    assert len(profile) == 4  # the tiny run: 2 encoder layers x 2 heads
    for head in profile:  # where a head's largest weight falls: a distribution over the relations
        shares = sum(head[k] for k in ("previous", "self", "next", "</s>", "elsewhere"))
        assert shares == pytest.approx(1.0, abs=1e-3)  # each share rounded
    table = module["markdown_profile"](data)
    assert all(f"| {h['layer']}.{h['head']} |" in table for h in profile)


@needs_multi30k
def test_hard_soft_on_a_trained_run(monkeypatch, tmp_path: Path, multi30k_run: Path) -> None:
    module = run_experiment("hard_soft", "--transformer", str(multi30k_run), "--rnn", str(tmp_path / "no-rnn"),
                            "--sentences", "6", "--peak-sentences", "4", monkeypatch=monkeypatch, figures=tmp_path)
    data = written(tmp_path, "hard_soft")
    assert [m["name"] for m in data["models"]] == ["Transformer"]
    assert [r["setting"] for r in data["models"][0]["results"]][-1] == "hard (argmax)"
    assert "hard" in module["markdown_table"](data)


@needs_multi30k
def test_no_projection_on_a_trained_run(monkeypatch, tmp_path: Path, multi30k_run: Path) -> None:
    module = run_experiment("no_projection", "--run", str(multi30k_run), "--sentences", "8", "--example", "1",
                            monkeypatch=monkeypatch, figures=tmp_path)
    data = written(tmp_path, "no_projection")
    for r in data["results"].values():  # a weight on itself is a probability
        assert 0.0 <= r["mean_weight_on_self"] <= 1.0
    assert "uniform" in module["markdown_table"](data).lower()


@needs_multi30k
def test_parallelism_tiny(monkeypatch, tmp_path: Path) -> None:
    tiny_rnn = ["model.rnn.embed_dim=32", "model.rnn.hidden_size=32"]  # after the experiment's hidden_size 256
    module = run_experiment("parallelism", "--minutes", "0.01", "--set", *TINY_TRANSLATION, *TINY_TRANSFORMER,
                            *tiny_rnn, "--d", "16",
                            "--heads", "2", "--batch", "2", "--repeats", "1", "--lengths", "4", "8", "--threads", "1",
                            monkeypatch=monkeypatch, figures=tmp_path)
    data = written(tmp_path, "parallelism")
    steps = {k: m["sequential_steps_per_update"] for k, m in data["models"].items()}
    assert steps["transformer"] == 0 and steps["rnn-attention"] > 0  # Table 1: O(1) against O(n) sequential steps
    assert [r["n"] for r in data["layer_timing"]["rows"]] == [4, 8]
    assert module["markdown_layers"](data).count("\n") > 2


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="needs ../shared/data/shakespeare/input.txt")
def test_length_extrapolation_tiny(monkeypatch, tmp_path: Path) -> None:
    module = run_experiment("length_extrapolation", "--updates", "1", "--runs", str(tmp_path / "runs"), "--set",
                            "data.valid_fraction=0.005", "model.transformer.d_model=16", "model.transformer.n_heads=2",
                            "model.transformer.d_ff=32", "model.transformer.decoder_layers=1", "train.threads=1",
                            "--threads", "1", monkeypatch=monkeypatch, figures=tmp_path)
    data = written(tmp_path, "length-extrapolation")
    rows = {r["positions"]: r["loss"] for r in data["rows"]}
    assert set(rows) == {"sinusoidal", "learned", "rope", "alibi", "none"}
    assert rows["learned"]["256"] is None and rows["learned"]["128"] is not None  # a table of 128 rows reads no further
    assert all(loss is not None for loss in rows["rope"].values())
    assert "rope" in module["markdown_table"](data)
