"""benchmarks/lm.py, the race against nanoGPT: every row at ``--smoke`` sizes against a nanoGPT checkout (named by
the ``NANOGPT`` environment variable: nanoGPT is no dependency, so without it the smoke run skips), and its pure
parts: the precision attnkit says it chose, the targets."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "shakespeare" / "input.txt"
NANOGPT = Path(os.environ.get("NANOGPT", "/nonexistent"))


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its siblings
    spec = importlib.util.spec_from_file_location("lm_bench", ROOT / "benchmarks" / "lm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


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
        assert rows[row, "attnkit"]["precision"] in ("fp32", "bf16 autocast")  # what precision: auto chose
    assert rows["throughput", "nanoGPT"]["tok_s"] > 0 and rows["throughput", "attnkit"]["tok_s"] > 0
    assert {t["target"] for t in run["targets"]} == {"ahead at equal wall time (validation loss, budget row)",
                                                     ">= 1.5x nanoGPT's tokens/s at its smoke shape"}
    assert "Targets: " in bench.markdown_table({"runs": [run]})


def test_the_precision_attnkit_chose_is_read_from_its_log(bench) -> None:
    log = ("lm: LanguageModel with 1.80M parameters on cpu (bf16 autocast, 2 threads, fast engine)\n"
           "trained 10 updates in 0.1 min; run: x\n")
    assert bench.chosen_precision(log) == "bf16 autocast"
    assert bench.chosen_precision("lm: LanguageModel with 0.1M parameters on cpu (fp32)\n") == "fp32"
    assert bench.chosen_precision("no such line") is None


def test_targets_are_judged_on_the_rows(bench) -> None:
    rows = [{"row": "budget", "contender": "nanoGPT", "valid_loss": 1.51},
            {"row": "budget", "contender": "attnkit", "valid_loss": 1.50},
            {"row": "throughput", "contender": "nanoGPT", "tok_s": 1000, "shape_name": "15-minute"},
            {"row": "throughput", "contender": "attnkit", "tok_s": 1400, "shape_name": "15-minute"},
            {"row": "throughput", "contender": "nanoGPT, compiled", "not_run": "no triton", "shape_name": "15-minute"}]
    loss, speed = bench.targets(rows)
    assert loss["met"] and loss["attnkit"] == 1.50
    assert speed["ratio"] == pytest.approx(1.4) and not speed["met"] and speed["bar"] == 1.5
