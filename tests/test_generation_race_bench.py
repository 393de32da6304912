"""benchmarks/generation_race.py: a smoke run on a tiny Llama of SmolLM2's kind (every contender installed here
decodes it, and the float32 ones give the same greedy tokens), and its pure parts: the bytes a token reads, the
agreement, the targets, the docs' table of the latest run per host kind."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "shakespeare" / "input.txt"
#: A Llama of SmolLM2's kind, small enough to build, import, export and convert in seconds.
TINY = ["num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4", "num_key_value_heads=2",
        "intermediate_size=128", "vocab_size=600", "max_position_embeddings=256"]


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/generation_race.py", "generation_race_bench")


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="needs ../shared/data/shakespeare/input.txt")
def test_smoke_race_on_a_tiny_llama(bench, tmp_path: Path) -> None:
    out = tmp_path / "race.json"
    cmd = [sys.executable, "benchmarks/generation_race.py", "--models", "smollm2", "--shape", *TINY,
           "--batches", "1", "3", "--threads", "1", "--new-tokens", "8", "--repeats", "1", "--bandwidth-mb", "32",
           "--work", str(tmp_path / "work"), "--out", str(out), "--contenders", "attnkit reference float32",
           "attnkit eager *", "transformers *", "CTranslate2 *", "llama.cpp *"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(out.read_text(encoding="utf-8"))["runs"][0]
    rows = {(r["contender"], r["batch"]): r for r in run["offline"]}
    float32 = ["attnkit reference float32", "attnkit eager float32", "transformers float32"]
    float32 += ["CTranslate2 float32"] if installed("ctranslate2") else []
    if installed("llama_cpp"):
        float32.append("llama.cpp F32")
        assert run["gguf_converter"].endswith("vendor/llama.cpp/convert_hf_to_gguf.py")
        assert {("llama.cpp F16", 3), ("llama.cpp Q8_0", 3)} <= rows.keys()
    else:
        assert run["not_run"]["llama.cpp F32"].startswith("llama-cpp-python is not installed")
    for name in float32:  # the same weights in float32: the same greedy tokens, whoever decodes them
        for batch in (1, 3):
            row = rows[name, batch]
            assert row["tokens"] == 8 * batch and row["same_rows"] == 1.0, (name, batch, row)
    assert ("attnkit eager int8", 3) in rows  # int8 may round a greedy choice the other way: it runs, that is all
    assert set(run["limits"]) == {"float32", "bf16", "f16", "int8", "q8_0"} and run["bandwidth"][0]["read_gb_s"] > 0
    assert any(t["peer"] == "transformers float32" for t in run["targets"])
    assert "**smollm2**" in bench.markdown_table([run])


def test_bytes_per_token_hand_counted(bench) -> None:
    shapes, vectors = [(64, 32), (10, 64)], 96
    assert bench.bandwidth.matrix_bytes(shapes, vectors, "float32") == 4 * (64 * 32 + 10 * 64 + 96)
    assert bench.bandwidth.matrix_bytes(shapes, vectors, "bf16") == 2 * (64 * 32 + 10 * 64) + 4 * 96
    # int8: a byte a weight and a float32 scale per output row; Q8_0: 34 bytes per block of 32 weights of a row
    assert bench.bandwidth.matrix_bytes(shapes, vectors, "int8") == 64 * 32 + 10 * 64 + 4 * (64 + 10) + 4 * 96
    assert bench.bandwidth.matrix_bytes(shapes, vectors, "q8_0") == 34 * (64 * 1 + 10 * 2) + 4 * 96


def test_agreement_counts_rows_and_the_tokens_before_the_first_difference(bench) -> None:
    yardstick = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert bench.agreement([[1, 2, 3, 4], [5, 6, 7, 8]], yardstick) == (1.0, 1.0)
    assert bench.agreement([[1, 2, 9, 4], [5, 6, 7, 8]], yardstick) == (0.5, (0.5 + 1.0) / 2)
    assert bench.agreement([[1, 2], [0, 6, 7, 8]], yardstick) == (0.0, (0.5 + 0.0) / 2)  # a row that stopped early


def run_record(bench, date: str, rates: dict[tuple[str, int], float], cpu: str = "Some CPU") -> dict:
    weights = {"attnkit eager float32": "float32", "attnkit compiled int8": "int8", "llama.cpp F32": "float32",
               "llama.cpp Q8_0": "q8_0", "transformers float32": "float32", "CTranslate2 float32": "float32"}
    rows = [{"contender": name, "weights": weights[name], "threads": 1, "batch": b, "repeat": 1, "tok_s": rate,
             "tokens": 128 * b, "same_rows": 1.0, "same_prefix": 1.0} for (name, b), rate in rates.items()]
    limits = {fmt: {"bytes_per_token": 1e8, "tok_s": 100.0} for fmt in bench.bandwidth.FORMATS}
    return {"date": date, "commit": "abc1234", "cpu": {"model": cpu, "amx_bf16": False, "avx512_bf16": True},
            "command": "python benchmarks/generation_race.py", "new_tokens": 128, "prompt_tokens": 64,
            "model": {"name": "smollm2", "source": "random", "layers": 30, "d_model": 576, "heads": 9, "kv_heads": 3,
                      "parameters": 134_515_008},
            "bandwidth": [{"threads": 1, "read_gb_s": 10.0}], "limits": limits, "offline": rows, "not_run": {},
            "yardstick": "attnkit eager float32",
            "targets": bench.judge(rows, limits)}


def test_targets_judge_the_fastest_attnkit_mode_of_each_weight_format(bench) -> None:
    rates = {("attnkit eager float32", 1): 40.0, ("attnkit compiled int8", 1): 85.0, ("llama.cpp F32", 1): 50.0,
             ("llama.cpp Q8_0", 1): 80.0, ("transformers float32", 1): 30.0, ("CTranslate2 float32", 32): 500.0,
             ("attnkit eager float32", 32): 600.0}
    targets = {t["target"]: t for t in run_record(bench, "2026-01-01T00:00:00+00:00", rates)["targets"]}
    f32 = targets["attnkit >= llama.cpp at the same weights (float32)"]
    assert f32["attnkit"] == "attnkit eager float32" and f32["ratio"] == pytest.approx(0.8) and not f32["met"]
    assert targets["attnkit >= llama.cpp at the same weights (8-bit)"]["met"]
    assert targets["attnkit int8 >= 0.8 of the bandwidth limit"]["ratio"] == pytest.approx(0.85)  # of 100 tok/s
    assert targets["attnkit >= 2x transformers"]["ratio"] == pytest.approx(40 / 30)
    assert targets["attnkit >= CTranslate2 float32 at batch 32"]["met"]
    assert len(targets) == len(bench.TARGETS)  # every target recorded, the ones that could not be judged too
    f16 = targets["attnkit >= llama.cpp at the same weights (16-bit)"]
    assert f16["met"] is None and f16["why"] == "attnkit bf16 did not run at batch 1"


def test_table_of_a_run_gives_each_contender_its_share_of_the_limit(bench) -> None:
    run = run_record(bench, "2026-01-02T00:00:00+00:00", {("attnkit eager float32", 1): 36.0})
    text = bench.markdown_table([run])
    assert text.count("| 1 | attnkit eager float32 |") == 1 and "| 36.0 |" in text
    assert "| 0.36 |" in text  # 36 tok/s of a 100 tok/s limit
    assert bench.model_name(run) == [("**smollm2**", run)] and bench.fastest_attnkit(run) == 36.0


def test_every_contender_names_a_weight_format_with_a_limit(bench, tmp_path: Path) -> None:
    model = bench.RaceModel("smollm2", "random", tmp_path / "run", tmp_path / "hf")
    specs = bench.contenders(model, bf16=True)
    assert len(specs) == len({s.name for s in specs}) == 8 + 1 + 2 + 3  # attnkit's modes, transformers, CT2, llama.cpp
    assert {s.weights for s in specs} <= bench.bandwidth.FORMATS.keys()
    assert specs[0].name == "attnkit reference float32"  # the agreement's yardstick


@pytest.mark.parametrize("compiled", [False, True])
def test_the_served_rows_start_attnkit_serve_with_arguments_it_accepts(compiled: bool) -> None:
    """generate_race.py's served rows start ``attnkit serve`` with options it has (its ``--compile`` was renamed
    ``--engine compiled`` once, and the served rows would have failed)."""
    from attnkit.cli import build_parser

    race = load_script("benchmarks/generate_race.py", "generate_race_bench")
    args = build_parser().parse_args(race.serve_arguments(Path("runs/lm"), 8000, 2, "cpu", compiled))
    assert args.engine == ("compiled" if compiled else "eager") and args.max_batch == race.STREAMS
