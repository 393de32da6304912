"""How a classifier reads a long review: head, head+tail or the whole review, on the same model and reviews.

    python benchmarks/reading.py runs/seed-imdb           # after `attnkit train configs/seed-imdb.yaml --run-dir ...`

Scores the run's best weights on the validation reviews its config holds out (IMDB: 10% of the
training reviews, by movie) three ways (:mod:`attnkit.inference.classify`): the first ``max_len``
subwords (``head``), the first quarter and last three quarters (``head+tail``), and the whole review
as overlapping windows of ``max_len`` subwords, half a window apart, whose logits are averaged
(``whole``). Appends to ``benchmarks/results/reading.json`` (every run kept) and prints the table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from attnkit.common.measure import stamp  # noqa: E402
from attnkit.data.documents import document_ids, reading_windows  # noqa: E402
from attnkit.inference.classify import READINGS, evaluate_classifier  # noqa: E402
from attnkit.tasks import load_run  # noqa: E402
from attnkit.tasks.classification import read_validation  # noqa: E402
from tables import append_run, cpu_info, markdown, measured  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "reading.json"


def measure(run_path: str, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    run = load_run(run_path)
    valid = read_validation(run.cfg, log=lambda message: print(message, file=sys.stderr))
    ids = document_ids(run.tok, valid.texts, run.cfg.data)
    max_len = run.cfg.data.max_len
    readings = {}
    for reading in READINGS:
        start = time.perf_counter()
        scores, _ = evaluate_classifier(run, valid, reading=reading)
        readings[reading] = {"accuracy": round(scores.accuracy, 2), "seconds": round(time.perf_counter() - start, 1)}
    return {**stamp(), "cpu": cpu_info(), "command": f"python benchmarks/reading.py {run_path} --threads {threads}",
            "run": run_path, "config": run.cfg.data.train, "weights": run.weights_path.name,
            "trained_with": run.cfg.data.truncate, "max_len": max_len, "reviews": len(ids),
            "longer_than_max_len": sum(len(x) > max_len for x in ids),
            "windows": sum(len(reading_windows(x, max_len)) for x in ids), "threads": threads, "readings": readings}


def model(run: dict) -> list[tuple[str, dict]]:
    """The race of each model read."""
    return [(f"`{run['run']}`", run)]


def whole(run: dict) -> float:
    """The whole review's accuracy, the headline."""
    return run["readings"]["whole"]["accuracy"]


def markdown_table(runs: list[dict]) -> str:
    """Held-out accuracy of one model under each reading, per run."""
    rows = []
    for r in runs:
        for reading in READINGS:
            got = r["readings"][reading]
            rows.append([f"`{r['run']}` (trained on {r['trained_with']}, {r['max_len']} subwords)", f"`{reading}`",
                         f"**{got['accuracy']:.2f}**", f"{r['reviews']:,} ({r['longer_than_max_len']:,} longer)",
                         f"{r['windows']:,}" if reading == "whole" else f"{r['reviews']:,}", f"{got['seconds']:.0f}",
                         measured(r)])
    return markdown(["model", "reading", "held-out accuracy", "reviews", "windows read", "seconds", "measured"],
                    rows, "llrrrrl")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a classification run directory")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    result = measure(args.run, args.threads)
    append_run(OUT, result)
    print(markdown_table([result]), end="")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
