"""benchmarks/throughput.py's pure parts: the matmul FLOP count, the results table, pip's failure line."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its sibling `tables`
    spec = importlib.util.spec_from_file_location("throughput_bench", ROOT / "benchmarks" / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_flops_of_a_hand_counted_case(bench) -> None:
    dims = bench.ModelDims(d_model=2, n_heads=1, d_ff=4, encoder_layers=1, decoder_layers=1, vocab=3)
    S, T, d, ff, V = 2, 3, 2, 4, 3
    macs = (4 * S * d * d + S * d * S + S * S * d + S * d * ff + S * ff * d  # encoder: Q K V O, QK^T, AV, FFN
            + 4 * T * d * d + T * d * T + T * T * d  # decoder self attention
            + 2 * T * d * d + 2 * S * d * d + T * d * S + T * S * d  # cross: Q, O over T; K, V over S; QK^T, AV
            + T * d * ff + T * ff * d + T * d * V)  # FFN, output projection
    n = bench.Lengths(src=S, tgt=T, src_sq=S * S, tgt_sq=T * T, src_tgt=S * T)
    assert bench.forward_matmul_flops(dims, n) == 2 * macs == 588
    assert bench.training_flops(dims, n) == 3 * 588


def test_flops_equal_torchs_count_of_nn_transformer(bench) -> None:
    """Two sentences, each run alone (no padding), counted by torch's FlopCounterMode; backward is 2x forward."""
    torch.manual_seed(0)
    d, h, ff, V, layers = 8, 2, 16, 11, 2
    model = nn.Transformer(d, h, layers, layers, ff, 0.0, batch_first=True).train()
    out_proj = torch.randn(V, d, requires_grad=True)
    forward = total = 0
    for S, T in ((5, 7), (9, 3)):
        src, tgt = torch.randn(1, S, d, requires_grad=True), torch.randn(1, T, d, requires_grad=True)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # attention as bmm, counted
            logits = model(src, tgt, tgt_mask=causal) @ out_proj.t()
            forward += counter.get_total_flops()
            logits.sum().backward()
        total += counter.get_total_flops()
    dims = bench.ModelDims(d, h, ff, layers, layers, V)
    n = bench.Lengths(src=5 + 9, tgt=7 + 3, src_sq=25 + 81, tgt_sq=49 + 9, src_tgt=35 + 27)
    assert bench.forward_matmul_flops(dims, n) == forward
    assert bench.training_flops(dims, n) == total


def test_batch_lengths_real_padded_and_per_target(bench) -> None:
    lengths = (torch.tensor([3.0, 5.0, 2.0]).numpy(), torch.tensor([4.0, 2.0, 7.0]).numpy())
    real = bench.batch_lengths(lengths, [0, 1])
    assert real == bench.Lengths(8, 6, 9 + 25, 16 + 4, 12 + 10)
    padded = bench.batch_lengths(lengths, [0, 1], pad_multiple=4)  # S 5 -> 8, T 4 -> 4, 2 rows
    assert padded == bench.Lengths(16, 8, 128, 32, 64, scored=6)
    dims = bench.MODELS["small"]
    assert bench.forward_matmul_flops(dims, padded) > bench.forward_matmul_flops(dims, real)
    per = real.per_target()
    assert per.tgt == 1 and per.times(real.tgt) == pytest.approx(real)  # FLOPs are linear in these sums
    assert bench.forward_matmul_flops(dims, per.times(6)) == pytest.approx(bench.forward_matmul_flops(dims, real))


def test_score_and_markdown_table(bench) -> None:
    dims = bench.MODELS["small"]
    corpus = bench.Lengths(1.1, 1.0, 20.0, 18.0, 19.0)
    rows = [{"contender": "HF MarianMTModel", "precision": "fp32", "tgt_tok_per_s": 1500.0, "tok_per_update": 4000.0,
             "updates": 20, "peak_rss_gb": 2.5},
            {"contender": "fairseq transformer", "precision": "fp32", "skipped": "pip install failed: X"},
            {"contender": "attnkit", "precision": "bf16", "tgt_tok_per_s": 4500.0, "tok_per_update": 3900.0,
             "updates": 60, "peak_rss_gb": 1.7, "lengths_per_update": bench.asdict(corpus.times(3900.0)),
             "padded_per_update": bench.asdict(corpus.times(4300.0))}]
    bench.score(rows, dims, corpus, {"fp32": 300.0, "bf16": 2000.0})
    marian, skipped, ours = rows
    assert ours["ratio_to_best_peer"] == 3.0 and marian["ratio_to_best_peer"] == 1.0 and "gflops" not in skipped
    flops = bench.training_flops(dims, corpus.times(1.0)) / 1e9
    assert marian["gflops"] == pytest.approx(flops * 1500, rel=1e-3)  # tok/s x FLOPs per target token
    assert ours["fraction_of_peak"] == pytest.approx(flops * 4500 / 2000, rel=1e-3)
    assert ours["gflops_executed"] > ours["gflops"]

    new = {"date": "2026-11-23T10:00:00+00:00", "commit": "abc1234", "threads": 2, "measured_seconds": 60.0,
           "model": "small", "matmul_peak_gflops": {"fp32": 300.0, "bf16": 2000.0}, "rows": rows,
           "targets": bench.TARGETS["small"]}
    old = {"date": "2026-11-22T12:00+00:00", "commit": "b73c08f", "threads": 2, "measured_seconds": 90.0,
           "targets": {"tok_per_s_ratio_to_reference_fp32": 3.0, "peak_rss_gb_bf16": 2.0},
           "rows": [{"contender": "torch.nn.Transformer reference", "precision": "fp32", "tgt_tok_per_s": 1000.0,
                     "tok_per_update": 4000.0, "updates": 30, "peak_rss_gb": 2.8, "ratio_to_reference_fp32": 1.0},
                    {"contender": "attnkit", "precision": "bf16", "tgt_tok_per_s": 3500.0, "tok_per_update": 4000.0,
                     "updates": 90, "peak_rss_gb": 1.9, "ratio_to_reference_fp32": 3.5}]}
    new["cpu"] = {"model": "Some CPU", "amx_bf16": True, "avx512_bf16": True}
    table, notes = bench.markdown_table([old, new]).split("\n\n")
    assert notes == ("- 2026-11-23, `abc1234`, small: matmul peak fp32 300 / bf16 2,000 GFLOP/s at 2 threads "
                     "(Some CPU, AMX-BF16); fairseq transformer skipped: pip install failed: X.")
    lines = table.splitlines()
    assert len(lines) == 2 + 5 and "`abc1234`" in lines[2] and "`b73c08f`" in lines[-1]  # newest first
    assert "| skipped (below) |" in lines[3]
    assert "| **3.00x** |" in lines[4] and f"**{ours['fraction_of_peak']:.1%} of 2,000**" in lines[4]
    assert ">= 3x, <= 2 GB, >= 35% of peak" in lines[4]
    assert "| **3.50x ref. fp32** |" in lines[-1] and ">= 3x the reference's fp32" in lines[-1]  # as measured
    assert bench.attnkit_bf16(new) == 4500.0 and bench.attnkit_bf16(old) == 3500.0  # the race's headline
    assert bench.model(new) == [("`small`", new)] and bench.model(old) == [("`small`", old)]  # older: no model


def test_failure_line_names_the_exception(bench) -> None:
    output = ("Collecting fairseq\n  error: subprocess-exited-with-error\n"
              "  ValueError: mutable default <class 'X'> for field common is not allowed\n"
              "note: This error originates from a subprocess, and is likely not a problem with pip.\n"
              "ERROR: Failed building wheel for fairseq\n")
    assert bench.failure_line(output) == "ValueError: mutable default <class 'X'> for field common is not allowed"
    ninja = ("ninja: error: '/tmp/pip-install-ab_c/fairseq_0f/fairseq/x.cpp', needed by '/tmp/pip-install-ab_c/"
             "fairseq_0f/build/x.o', missing and no known rule to make it")
    assert bench.failure_line(output + "  " + ninja + "\n  RuntimeError: Error compiling\n") == (
        "ninja: error: 'fairseq/x.cpp', needed by 'build/x.o', missing and no known rule to make it")
    assert bench.failure_line("ERROR: No matching distribution found for fairseq\n").startswith("ERROR: No matching")
