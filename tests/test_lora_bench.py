"""benchmarks/lora.py on a tiny random Llama: both contenders train the same model on the same batches (their first
losses agree), each reports its tokens/s, and the table renders. A smoke run, not a timing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its siblings `tables` and `nbsvm`
    spec = importlib.util.spec_from_file_location("lora_bench", ROOT / "benchmarks" / "lora.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_both_contenders_train_the_same_model_on_the_same_batches(bench, tmp_path):
    """A random Llama of SmolLM2-135M's kind, shrunk (its tokenizer is trained on ../shared's tiny Shakespeare)."""
    from test_lm_task import corpus

    if not (ROOT.parent / "shared" / "data" / "shakespeare").is_dir():
        pytest.skip("../shared/data/shakespeare is not beside this checkout: the random model's tokenizer learns on it")
    (tmp_path / "train.txt").write_text(corpus(400), encoding="utf-8")
    tiny = ["num_hidden_layers=2", "hidden_size=32", "num_attention_heads=4", "num_key_value_heads=2",
            "intermediate_size=64", "vocab_size=512", "max_position_embeddings=256"]
    args = bench.arguments(["--set", *tiny, "--data", str(tmp_path / "train.txt"), "--dropout", "0", "--block", "16",
                            "--batch", "2", "--steps", "2", "--warmup", "1", "--threads", "1"])
    threads = torch.get_num_threads()
    try:
        setting = bench.prepare(args, tmp_path)
        cpu = torch.device("cpu")
        attnkit_seconds, attnkit_loss = bench.run_attnkit(args, tmp_path, cpu)
        peft_seconds, peft_loss = bench.run_peft(args, tmp_path, cpu, Path(setting["hf"]), setting["model_type"])
    finally:
        torch.set_num_threads(threads)
    assert attnkit_seconds > 0 and peft_seconds > 0
    assert abs(attnkit_loss - peft_loss) < 1e-4 * max(1.0, peft_loss)  # the same weights, batch and loss
    rows = [{"contender": name, "seconds": s, "tokens_per_s": 64 / s, "peak_memory_gb": 1.0, "repeat": 1}
            for name, s in zip(bench.CONTENDERS, (attnkit_seconds, peft_seconds), strict=True)]
    run = {"date": "2026-01-01T00:00:00", "commit": "abc1234", "device": "cpu", "host": "test", "rank": 8,
           "batch": 2, "block": 16, "precision": "float32", **setting, "measurements": rows}
    table = bench.markdown_table([run])
    assert table.count("\n| ") == 3 and "transformers + PEFT" in table and "1.00x" in table
    assert bench.attnkit_over_peft(run) == pytest.approx(peft_seconds / attnkit_seconds)
