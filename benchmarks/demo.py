"""``attnkit demo``'s figures: exact match, minutes, updates and peak RSS, for the README.

    flock /tmp/attnkit-bench.lock python benchmarks/demo.py     # about 3 minutes

Runs ``attnkit demo --json FILE`` in a temporary directory (the run and the heatmap are thrown away),
exactly as a user would from a fresh clone; extra arguments go to the demo. Appends what it wrote, with the
host's CPU, to ``benchmarks/results/demo.json`` (every run kept).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tables import append_run, cpu_info, markdown, measured

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "demo.json"


def exact_match(run: dict) -> float:
    return run["exact_match"]


def markdown_table(runs: list[dict]) -> str:
    """The demo's exact match and cost, one row per run, newest first."""
    rows = []
    for results in sorted(runs, key=lambda r: r["date"], reverse=True):
        changed = f" with `{' '.join(results['overrides'])}`" if results["overrides"] else ""
        rows.append([f"**{results['exact_match']:.1f}%** of {results['held_out']:,}{changed}",
                     f"{results['minutes']:.1f}", f"{results['train_minutes']:.1f}", f"{results['updates']:,}",
                     f"{results['peak_rss_gb']:.2f}", measured(results), ">= 99% in < 3 min"])
    return markdown(["exact match on held-out dates", "minutes, whole command", "training min", "updates",
                     "peak RSS GB", "measured", "target"], rows, "lrrrrll")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="attnkit-demo-") as out:
        figures = Path(out) / "demo.json"
        subprocess.run([sys.executable, "-m", "attnkit", "demo", "-o", out, "--json", str(figures), *sys.argv[1:]],
                       check=True)
        append_run(OUT, {**json.loads(figures.read_text(encoding="utf-8")), "cpu": cpu_info()})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
