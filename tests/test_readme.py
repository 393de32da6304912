"""The README's Python example runs and prints the seeds' numbers; its test command is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_readme_python_example_runs(capsys) -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    numbers = [float(x) for x in re.findall(r"-?\d+\.\d+", printed)]
    torch.testing.assert_close(torch.tensor(numbers[:3]), torch.tensor([1.8639, 6.3194, 1.7042]), atol=1e-4, rtol=0)


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    command = next(line for line in readme.splitlines() if line.startswith("python3 -m venv") and "pytest" in line)
    assert command in ci.splitlines()
