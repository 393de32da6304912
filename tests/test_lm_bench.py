"""benchmarks/lm.py, the race against nanoGPT: every row at ``--smoke`` sizes against a nanoGPT checkout (named by
the ``NANOGPT`` environment variable: nanoGPT is no dependency, so without it the smoke run skips), and its pure
parts: the precision attnkit's run recorded, the targets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "shakespeare" / "input.txt"
NANOGPT = Path(os.environ.get("NANOGPT", "/nonexistent"))


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/lm.py", "lm_bench")


@pytest.mark.skipif(not (NANOGPT / "train.py").exists(),
                    reason="nanoGPT is not a dependency: set NANOGPT to a checkout of it to run the smoke race")
@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="needs ../shared/data/shakespeare/input.txt")
def test_smoke_every_row_against_nanogpt(bench, tmp_path: Path) -> None:
    out = tmp_path / "lm.json"
    assert bench.main(["--nanogpt", str(NANOGPT), "--smoke", "--minutes", "0.1", "--sampling-batches", "1", "2",
                       "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    run = json.loads(out.read_text(encoding="utf-8"))["runs"][0]
    rows = {(r["row"], r["contender"]): r for r in run["rows"]}
    for row in ("documented", "budget"):
        assert rows[row, "nanoGPT"]["valid_loss"] > 0 and rows[row, "attnkit"]["valid_loss"] > 0
        assert rows[row, "attnkit"]["precision"]["precision"] in ("float32", "bf16")  # what precision: auto chose
    assert rows["throughput", "nanoGPT"]["tok_s"] > 0 and rows["throughput", "attnkit"]["tok_s"] > 0
    assert {t["target"] for t in run["targets"]} == {"ahead at equal wall time (validation loss, budget row)",
                                                     ">= 1.5x nanoGPT's tokens/s at its smoke shape"}
    assert "Targets: " in bench.markdown_table([run])


def test_the_precision_attnkit_chose_is_read_from_its_run(bench, tmp_path: Path) -> None:
    assert bench.recorded_precision(tmp_path) is None  # a run that recorded none (the sampling row's models)
    (tmp_path / "precision.json").write_text(json.dumps({"precision": "bf16", "source": "measured"}), encoding="utf-8")
    chosen = bench.recorded_precision(tmp_path)
    assert chosen == {"precision": "bf16", "source": "measured"}
    rows = [{"precision": chosen}, {"precision": {"precision": "float32"}}, {"precision": None}]
    assert bench.attnkit_precisions(rows) == "bf16 and float32"
    assert bench.attnkit_precisions([{"precision": None}]) == "float32"


def test_targets_are_judged_on_the_rows(bench) -> None:
    rows = [{"row": "budget", "contender": "nanoGPT", "valid_loss": 1.51},
            {"row": "budget", "contender": "attnkit", "valid_loss": 1.50},
            {"row": "throughput", "contender": "nanoGPT", "tok_s": 1000, "shape_name": "15-minute"},
            {"row": "throughput", "contender": "attnkit", "tok_s": 1400, "shape_name": "15-minute"},
            {"row": "throughput", "contender": "nanoGPT, compiled", "not_run": "no triton", "shape_name": "15-minute"}]
    loss, speed = bench.targets(rows)
    assert loss["met"] and loss["attnkit"] == 1.50
    assert speed["ratio"] == pytest.approx(1.4) and not speed["met"] and speed["bar"] == 1.5


def test_a_run_splits_into_one_race_per_measurement_each_with_its_own_targets(bench) -> None:
    rows = [{"row": "budget", "contender": "nanoGPT", "valid_loss": 1.51, "train_seconds": 900, "iterations": 10},
            {"row": "budget", "contender": "attnkit", "valid_loss": 1.50, "train_seconds": 900, "updates": 12},
            {"row": "throughput", "contender": "nanoGPT", "tok_s": 1000, "shape_name": "15-minute"},
            {"row": "throughput", "contender": "attnkit", "tok_s": 1400, "shape_name": "15-minute"}]
    run = {"date": "2026-01-01T00:00:00+00:00", "commit": "abc1234", "cpu": "Some CPU", "threads": 2, "minutes": 15,
           "rows": rows, "targets": bench.targets(rows)}
    parts = dict(bench.row(run))
    budget, speed = parts["15 minutes of training each"], next(v for k, v in parts.items() if k.startswith("training"))
    assert [r["row"] for r in budget["rows"]] == ["budget"] * 2
    assert [r["row"] for r in speed["rows"]] == ["throughput"] * 2
    assert [t["target"].split()[0] for t in budget["targets"]] == ["ahead"]
    assert [t["target"].split()[0] for t in speed["targets"]] == [">="]
    assert bench.attnkit_figure(budget) == ("attnkit's validation loss", 1.50)
    assert bench.attnkit_figure(speed) == ("attnkit's tokens/s over nanoGPT's", 1.4)
    table = bench.markdown_table([budget, speed])
    assert table.count("| Some CPU, 2 threads |") == 4 and "Targets: ahead" in table
