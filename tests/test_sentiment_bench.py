"""benchmarks/imdb.py's pure parts: recording a pretraining probe and the table of probes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    for folder in (ROOT / "benchmarks", ROOT / "src"):
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location("imdb_bench", ROOT / "benchmarks" / "imdb.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _probe_run(run_dir: Path, lr: float, curve: list[tuple[int, float, float]]) -> Path:
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(
        "task: pretrain\ndata:\n  train: corpus.txt\n  valid_fraction: 0.1\n  max_len: 128\n"
        f"model:\n  transformer:\n    dropout: 0.0\ntrain:\n  lr: {lr}\n  threads: 1\n", encoding="utf-8")
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "minutes": s / 100, "valid_loss": loss, "valid_mlm_acc": acc, "score": acc}) + "\n"
        for s, loss, acc in curve), encoding="utf-8")
    return run_dir


def test_probes_are_recorded_with_their_commit_and_compared_at_common_steps(bench, tmp_path: Path) -> None:
    out = tmp_path / "probes.json"
    a = bench.record_probe(_probe_run(tmp_path / "a", 2e-3, [(250, 6.4, 9.7), (500, 6.3, 11.8)]), "a: slow",
                           out, "abc1234")
    bench.record_probe(_probe_run(tmp_path / "b", 5e-3, [(250, 6.3, 11.1), (500, 6.2, 12.1), (750, 6.0, 14.2)]),
                       "b: fast", out, None)
    assert a["commit"] == "abc1234" and a["lr"] == 2e-3 and a["window"] == 128 and a["dropout"] == 0.0
    data = json.loads(out.read_text())
    assert [p["settings"] for p in data["probes"]] == ["a: slow", "b: fast"]
    lines = bench.markdown_probes(data).splitlines()
    assert "step 250" in lines[0] and "step 500" in lines[0] and "step 750" not in lines[0]  # common steps only
    assert "6.40 / 9.7%" in lines[2] and "6.00 / 14.2% (750 updates, 7.5 min)" in lines[3]


def test_the_brief_table_lists_classifiers_with_their_pretraining_minutes(bench) -> None:
    stamp = {"date": "2026-11-26T00:00:00+00:00", "commit": "abc1234", "threads": 1}
    results = {"results": {
        "configs/imdb-lm.yaml": {**stamp, "config": "configs/imdb-lm.yaml", "task": "lm", "valid_ppl": 88.4,
                                 "train_minutes": 40.2, "updates": 2119},
        "configs/imdb-lm-ngrams.yaml": {**stamp, "config": "configs/imdb-lm-ngrams.yaml", "task": "classify",
                                        "valid_accuracy": 92.2, "train_minutes": 21.7, "updates": 1201,
                                        "init_from": "runs/imdb-lm"},
        "configs/imdb.yaml": {**stamp, "config": "configs/imdb.yaml", "task": "classify", "valid_accuracy": 88.0,
                              "train_minutes": 18.3, "updates": 3542}}}
    table = bench.markdown_brief(results)
    assert "| `configs/imdb-lm-ngrams.yaml` | 92.20 | 91.5 | 40.2 + 21.7 | 2,119 + 1,201 | 1 |" in table
    assert "| `configs/imdb.yaml` | 88.00 | 89.0 | 18.3 | 3,542 | 1 |" in table
    assert "imdb-lm.yaml`" not in table  # a pretraining stage is counted in its classifier's row


def test_the_seed_table_splits_by_budgets_and_adds_the_minutes_in_all(bench) -> None:
    def run(config: str, seed: int, settings: str, budget: float, minutes: float, **more) -> dict:
        return {"config": config, "seed": seed, "settings": settings, "max_minutes": budget, "minutes_total": minutes,
                "updates": 100 * seed, "threads": 1, "date": "2026-11-26T00:00:00+00:00", "commit": "abc1234", **more}
    lm, ng = "configs/imdb-lm.yaml", "configs/imdb-lm-ngrams.yaml"
    trials = {"runs": {
        lm: [run(lm, s, f"old {s}", 40, 42.0) for s in (1, 2)] + [run(lm, s, f"new {s}", 37, 38.9) for s in (1, 2)],
        ng: [run(ng, s, f"old {s}", 20, 21.0, valid_accuracy=92.0 + s / 10) for s in (1, 2)]
        + [run(ng, s, f"new {s}", 18, 19.1, valid_accuracy=91.6 + s / 10) for s in (1, 2)]}}
    text = bench.seed_table(trials, "imdb-lm", "imdb-lm-ngrams", lambda r: True)
    old, new = text.split("Budgets 37 + 18 minutes:")
    assert old.startswith("Budgets 40 + 20 minutes:")
    assert "| 2 | 92.20 | 200 | 200 | 63.0 | 1 |" in old and "mean **92.15**" in old
    assert "| 1 | 91.70 | 100 | 100 | 58.0 | 1 |" in new and "mean **91.75**" in new
