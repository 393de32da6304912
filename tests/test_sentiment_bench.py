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
