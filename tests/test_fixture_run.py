"""A run and an export written by the code before the package layout changed still load, translate
exactly as that code did, and resume (tests/fixtures/before-layout/README.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from attnkit.cli import main

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "before-layout"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text(encoding="utf-8"))


def translate(capsys, model: Path, tmp_path: Path, *options: str) -> list[str]:
    inputs = tmp_path / "inputs.txt"
    inputs.write_text("".join(line + "\n" for line in EXPECTED["inputs"]), encoding="utf-8")
    capsys.readouterr()
    assert main(["translate", str(model), "-i", str(inputs), *options]) == 0
    return capsys.readouterr().out.splitlines()


def test_the_run_translates_as_before(capsys, tmp_path) -> None:
    assert translate(capsys, FIXTURE / "dates-run", tmp_path, "--beam", "1") == EXPECTED["greedy"]
    beam = translate(capsys, FIXTURE / "dates-run", tmp_path, "--beam", "4", "--n-best", "2")
    assert [line.split("\t") for line in beam] == EXPECTED["beam4_nbest2"]


def test_the_export_translates_as_before(capsys, tmp_path) -> None:
    pytest.importorskip("ctranslate2")
    assert translate(capsys, FIXTURE / "dates-ct2", tmp_path, "--beam", "1") == EXPECTED["exported_greedy"]


def test_the_run_resumes(capsys, tmp_path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE / "dates-run", run)
    assert main(["train", str(run / "config.yaml"), "--run-dir", str(run), "--resume", "train.max_updates=320"]) == 0
    last = json.loads((run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()[-1])
    expected = EXPECTED["resumed_to_320"]
    assert last["step"] == expected["step"]
    assert last["valid_loss"] == pytest.approx(expected["valid_loss"], abs=2e-3)  # float32 sums differ across CPUs
    assert (FIXTURE / "dates-run" / "checkpoints" / "step-00000300").is_dir()  # the fixture itself is untouched
