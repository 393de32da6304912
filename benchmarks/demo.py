"""``attnkit demo``'s figures: exact match, minutes, updates and peak RSS, for the README.

    flock /tmp/attnkit-bench.lock python benchmarks/demo.py     # about 3 minutes

Runs ``attnkit demo --json benchmarks/results/demo.json`` in a temporary directory (the run and the
heatmap are thrown away), exactly as a user would from a fresh clone; extra arguments go to the demo.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from tables import markdown, measured

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "demo.json"


def markdown_table(runs: dict[str, dict]) -> str:
    """README: the demo's exact match and cost, one row per run (``benchmarks/results/demo.json``, then the
    earlier ones in ``results/earlier/demo.*.json``), newest first."""
    rows = []
    for results in sorted(runs.values(), key=lambda r: r["date"], reverse=True):
        changed = f" with `{' '.join(results['overrides'])}`" if results["overrides"] else ""
        rows.append([f"**{results['exact_match']:.1f}%** of {results['held_out']:,}{changed}",
                     f"{results['minutes']:.1f}", f"{results['train_minutes']:.1f}", f"{results['updates']:,}",
                     f"{results['peak_rss_gb']:.2f}", measured(results), ">= 99% in < 3 min"])
    return markdown(["exact match on held-out dates", "minutes, whole command", "training min", "updates",
                     "peak RSS GB", "measured", "target"], rows, "lrrrrll")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="attnkit-demo-") as out:
        subprocess.run([sys.executable, "-m", "attnkit", "demo", "-o", out, "--json", str(OUT), *sys.argv[1:]],
                       check=True)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
