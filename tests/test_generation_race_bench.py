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
           "attnkit eager *", "transformers *", "CTranslate2 *", "llama.cpp *", "--serve", "--serve-engine", "eager"]
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
    [served] = run["served"]  # attnkit serve --engine eager: one client, then 3 at once (the largest batch)
    assert served["steps"] == "eager" and served["clients"] == 3 and run["prompt_forward_s"]["1"] > 0
    assert served["single"][0]["ttft_s"] > 0 and served["streams"][0]["tok_s"] > 0
    bars = [t for t in run["targets"] if t["target"].startswith(("served", "3 served"))]
    assert [t["peer"] for t in bars] == ["forward pass", "attnkit eager float32"]
    assert all(t["met"] is not None for t in bars)  # the offline batch of 3 ran: both bars judged
    text = bench.markdown_table([run])
    assert "**smollm2**" in text and "| 1 | eager |" in text and "| <= 1.5 |" in text


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
    weights = {"attnkit eager float32": "float32", "attnkit compiled float32": "float32",
               "attnkit compiled int8": "int8", "llama.cpp F32": "float32", "llama.cpp Q8_0": "q8_0",
               "transformers float32": "float32", "CTranslate2 float32": "float32"}
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


def test_a_run_judges_only_the_targets_it_asked_for(bench) -> None:
    """A run of some contenders (``--contenders``, ``--batches``) judges the targets between them, not the others."""
    rows = run_record(bench, "2026-01-01T00:00:00+00:00", {("attnkit compiled float32", 32): 300.0,
                                                           ("CTranslate2 float32", 32): 250.0})["offline"]
    limits = {fmt: {"bytes_per_token": 1e8, "tok_s": 100.0} for fmt in bench.bandwidth.FORMATS}
    assert bench.judge(rows, limits, {"attnkit compiled float32"}) == []  # CTranslate2 was not asked for
    [target] = bench.judge(rows, limits, {"attnkit compiled float32", "CTranslate2 float32"})
    assert target["batch"] == 32 and target["ratio"] == pytest.approx(1.2) and target["met"]


def test_served_bars_compare_the_first_token_with_a_forward_pass_and_streams_with_the_offline_batch(bench) -> None:
    """The served bars: the median first token over the median forward pass of the prompt (at most 1.5), the median
    tokens/s of the concurrent streams over the offline batch of as many rows by the same engine at the same
    threads (at least 0.8)."""
    run = run_record(bench, "2026-01-01T00:00:00+00:00", {("attnkit compiled float32", 32): 400.0})
    run["offline"] += [{**run["offline"][0], "threads": 2, "tok_s": x} for x in (390.0, 420.0, 400.0)]
    run["offline"][0]["tok_s"] = 300.0  # 1 thread: one pass
    run["prompt_forward_s"] = {"1": 0.100, "2": 0.060}
    run["served"] = [{"threads": t, "steps": "compiled", "clients": 32, "client": "raw",
                      "single": [{"ttft_s": x, "tok_s": 20.0} for x in first],
                      "streams": [{"tok_s": x, "ttft_s_median": 0.2} for x in rates]}
                     for t, first, rates in ((1, (0.2, 0.12, 0.13), (250.0, 300.0, 310.0)),
                                             (2, (0.08, 0.07, 0.09), (350.0, 330.0, 340.0)))]
    first_token, streams, first_token2, streams2 = bench.judge_served(run)
    assert first_token["ratio"] == pytest.approx(1.3) and first_token["met"] and first_token["at_most"]
    assert streams["ratio"] == pytest.approx(300 / 300) and streams["met"]  # against 1 thread's offline batch
    assert first_token2["ratio"] == pytest.approx(0.08 / 0.06) and first_token2["met"]
    assert streams2["ratio"] == pytest.approx(340 / 400) and streams2["met"]
    assert bench.first_token_ratio(run) == pytest.approx(1.3)  # the best (lowest) of the thread counts
    run["served"][0]["steps"] = "eager"  # no offline eager batch of 32: that bar is not judged
    assert bench.judge_served(run)[1]["met"] is None
    text = bench.markdown_table([{**run, "served_prompt_tokens": [63, 64], "targets": bench.judge_served(run)}])
    assert "| 2 | compiled | 80.0 ms | 60.0 ms | 1.33x | 32 | 340.0 | 400.0 | 0.85x |" in text
    assert "| <= 1.5 | yes |" in text and "(63 to 64 tokens as the server reads them)" in text


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
