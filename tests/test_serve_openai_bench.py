"""benchmarks/serve_openai.py on a tiny run (a smoke test, not a measurement): it serves the run, drives both
contenders with the same prompts and writes its JSON, in which the chat's answers are /generate's texts for the
same ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_chat import PLAY
from test_lm_task import corpus, lm_config, train_lm

ROOT = Path(__file__).resolve().parents[1]


def test_the_benchmark_runs_both_contenders_and_writes_json(tmp_path):
    (tmp_path / "train.txt").write_text(corpus(200), encoding="utf-8")
    train_lm(lm_config(tmp_path / "train.txt", chat_template=PLAY, train_options={"max_updates": 4}),
             tmp_path / "play")
    (tmp_path / "questions.txt").write_text("my lord\nthe king\n", encoding="utf-8")
    out = tmp_path / "serve-openai.json"
    script = ROOT / "benchmarks" / "serve_openai.py"
    argv = ["--run", tmp_path / "play", "--prompts", tmp_path / "questions.txt", "--streams", 2, "--new-tokens", 8,
            "--repeats", 1, "--threads", 1, "--out", out]
    done = subprocess.run([sys.executable, str(script), *map(str, argv)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = json.loads(out.read_text(encoding="utf-8"))["runs"]
    assert run["same"] is True and run["ratio"] > 0
    rounds = run["rounds"]
    assert rounds["/generate"][0]["tokens"] == rounds["/v1/chat/completions"][0]["tokens"] == 2 * 8
    assert rounds["/generate"][0]["prompt_tokens"] == rounds["/v1/chat/completions"][0]["prompt_tokens"]
    assert "ratio" in done.stdout and "/v1/chat/completions" in done.stdout
