"""Batch-1 decoding's matrix-vector products on this CPU: PyTorch's ``F.linear`` against two other ways. A probe.

    flock /tmp/attnkit-bench.lock python experiments/matvec_probe.py [--threads 1 2]

Sampling one sequence (batch 1) multiplies one row by every weight matrix at every token, so its speed is how
fast those matrix-vector products read the weights. For each weight shape of a model (``--shapes``: the
6 x 384 model of ``benchmarks/lm.py``'s sampling row, GPT-2 small's, the generation race's 4 x 192 model, and one
large square matrix), a list of matrices of that shape large enough to leave the caches (cycled through, as
decoding cycles through its layers) is multiplied by one row, ``--repeats`` times, three ways:

* ``F.linear(x, W)``: what ``nn.Linear`` runs;
* ``(W * x).sum(-1)``: an elementwise product and a row sum, which PyTorch spreads over its threads;
* ``torch.utils.mkldnn.to_mkldnn`` of an ``nn.Linear``: oneDNN's inner product with prepacked weights.

Reported: milliseconds per pass over the list, and the weights' bytes read per second, at each thread count.
Writes ``benchmarks/results/matvec-probe.json`` (every run kept); :func:`markdown_table` renders it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the tables
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.mkldnn  # noqa: E402
from torch import nn  # noqa: E402

from attnkit.common.measure import stamp  # noqa: E402
from nbsvm import cpu_model  # noqa: E402
from tables import append_run, markdown, measured  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "matvec-probe.json"
#: (out, in) weight shapes, each with how many matrices of it are cycled through (about 40 MB or more of them).
SHAPES = {"6 x 384 (lm.py sampling)": [(1152, 384), (384, 384), (1536, 384), (384, 1536)],
          "GPT-2 small": [(2304, 768), (768, 768), (3072, 768), (768, 3072)],
          "4 x 192 (generation race)": [(576, 192), (192, 192), (768, 192), (192, 768)],
          "4096 x 4096": [(4096, 4096)]}
WAYS = ("F.linear", "product and row sum", "oneDNN (to_mkldnn)")


def probe(shapes: list[tuple[int, int]], threads: int, repeats: int) -> dict[str, float]:
    """Seconds per pass over enough matrices of ``shapes`` to hold at least 40 MB, each way."""
    torch.set_num_threads(threads)
    per_pass = sum(o * i for o, i in shapes) * 4
    copies = max(1, -(-40_000_000 // per_pass))
    linears = [nn.Linear(i, o, bias=False).eval() for _ in range(copies) for o, i in shapes]
    onednn = [torch.utils.mkldnn.to_mkldnn(m) for m in linears]
    rows = {i: torch.randn(1, i) for _, i in shapes}
    ways = {"F.linear": lambda k: F.linear(rows[linears[k].in_features], linears[k].weight),
            "product and row sum": lambda k: (linears[k].weight * rows[linears[k].in_features]).sum(-1),
            "oneDNN (to_mkldnn)": lambda k: onednn[k](rows[linears[k].in_features])}
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    with torch.inference_mode():
        for _ in range(2):  # warm-up
            for way in ways.values():
                for k in range(len(linears)):
                    way(k)
        for _ in range(repeats):  # the ways interleaved
            for name, way in ways.items():
                start = time.perf_counter()
                for k in range(len(linears)):
                    way(k)
                times[name].append(time.perf_counter() - start)
    return {"bytes": per_pass * copies, **{w: sorted(t)[len(t) // 2] for w, t in times.items()}}


def markdown_table(data: dict) -> str:
    parts = []
    for run in data["runs"]:
        rows = []
        for model, by_threads in run["results"].items():
            for threads, r in by_threads.items():
                base = r["F.linear"]
                rows.append([model, threads, f"{r['bytes'] / 1e6:.0f} MB"]
                            + [f"{r[w] * 1000:.2f} ms ({r['bytes'] / r[w] / 1e9:.1f} GB/s, {base / r[w]:.2f}x)"
                               for w in WAYS])
        parts.append(markdown(["weights", "threads", "per pass", *WAYS], rows, "lrrrrr")
                     + f"\n\n{run['cpu']}, float32, one row, medians of {run['repeats']} passes; {measured(run)}."
                     + (f" {run['note']}" if run.get("note") else ""))
    return "\n\n".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--note", default="", help="a line kept with the run (e.g. what else ran on the machine)")
    args = p.parse_args()
    results = {model: {str(t): probe(shapes, t, args.repeats) for t in args.threads}
               for model, shapes in SHAPES.items()}
    result = {**stamp(), "cpu": cpu_model(), "repeats": args.repeats, "results": results}
    append_run(OUT, result, args.note)
    print(markdown_table({"runs": [result]}))


if __name__ == "__main__":
    main()
