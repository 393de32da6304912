"""Why ``attnkit serve`` computes with one thread on its main thread: two OpenMP pools on two cores. A probe.

    flock /tmp/attnkit-bench.lock python experiments/openmp_pools.py [--threads 2] [--repeats 3] [--rounds 2]

The server runs each model on a worker thread of its own (:class:`attnkit.serve.batching.ModelWorker`), and
OpenMP keeps a pool of threads for every thread that starts a parallel region. libgomp, when it manages more
threads than there are cores, lets an idle thread sleep at once instead of spinning for a while, so each parallel
region then pays to wake its threads. This probe decodes the generation race's batch (a randomly initialised model
of its shape: 4 layers x 192, blocks of 256; 32 prompts of 64 tokens, greedy, 128 new tokens, ``generate`` eager)
at ``--threads`` threads, in a fresh process for each arrangement:

* ``main thread``: the process's main thread loads the model and decodes (the race's offline contenders);
* ``worker thread, main thread computed at N threads``: the main thread loads the model with N threads (its own
  pool), a worker thread decodes with N (the server before 2026-11-26);
* ``worker thread, main thread at 1 thread``: the main thread loads with one thread (no pool), the worker sets N
  for itself and decodes (the server since).

Each process decodes the batch once untimed, then ``--repeats`` times timed; the arrangements' processes run one at
a time, ``--rounds`` rounds in turn. Writes ``benchmarks/results/openmp-pools.json`` (every run kept);
:func:`markdown_table` renders it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the tables
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from attnkit.common.measure import stamp  # noqa: E402
from nbsvm import cpu_model  # noqa: E402
from tables import append_run, markdown, measured  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "openmp-pools.json"
ARRANGEMENTS = ("main thread", "worker thread, main thread computed at N threads",
                "worker thread, main thread at 1 thread")
BATCH, PROMPT, NEW_TOKENS = 32, 64, 128


def decode(threads: int, repeats: int) -> list[float]:
    """Tokens/s of ``repeats`` timed passes of the batch, on the calling thread at ``threads`` threads."""
    from attnkit.engine import to_eager
    from attnkit.lm import LanguageModel
    from attnkit.sampling import generate
    from attnkit.transformer import TransformerConfig
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = TransformerConfig(d_model=192, n_heads=6, d_ff=768, decoder_layers=4, dropout=0.0, max_len=256,
                            positions="learned", activation="gelu", bias=False, scale_embeddings=False)
    model = to_eager(LanguageModel(cfg, 65)).eval()
    prompt = torch.randint(4, 65, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    rates = []
    with torch.inference_mode():
        for r in range(repeats + 1):  # the first pass untimed
            start = time.perf_counter()
            list(generate(model, prompt, NEW_TOKENS, temperature=0.0, ignore_eos=True))
            if r:
                rates.append(BATCH * NEW_TOKENS / (time.perf_counter() - start))
    return rates


def arrangement(name: str, threads: int, repeats: int) -> list[float]:
    """One arrangement (see the module docstring), in this (fresh) process."""
    if name == ARRANGEMENTS[0]:
        return decode(threads, repeats)
    torch.set_num_threads(threads if name == ARRANGEMENTS[1] else 1)
    torch.ones(1 << 22).add_(1)  # a parallel region on the main thread, as loading a model runs some
    out: list[float] = []
    worker = threading.Thread(target=lambda: out.extend(decode(threads, repeats)))
    worker.start()
    worker.join()
    return out


def markdown_table(data: dict) -> str:
    parts = []
    for run in data["runs"]:
        base = sorted(run["results"][ARRANGEMENTS[0]])[len(run["results"][ARRANGEMENTS[0]]) // 2]
        rows = []
        for name in ARRANGEMENTS:
            rates = run["results"][name]
            median = sorted(rates)[len(rates) // 2]
            rows.append([name.replace("N", str(run["threads"])), f"{median:.0f}",
                         " / ".join(f"{r:.0f}" for r in rates), f"{median / base:.2f}x"])
        parts.append(markdown(["who decodes", "tok/s (median)", "every pass", "of the main thread's"], rows, "lrrr")
                     + f"\n\n{run['cpu']}, {run['threads']} threads; eager `generate`, batch {BATCH}, prompts of "
                       f"{PROMPT} tokens, {NEW_TOKENS} new tokens, a random model of the generation race's shape; "
                       f"a fresh process per arrangement and round; {measured(run)}."
                     + (f" {run['note']}" if run.get("note") else ""))
    return "\n\n".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed passes per process")
    p.add_argument("--rounds", type=int, default=2, help="processes per arrangement, taken in turn")
    p.add_argument("--note", default="", help="a line kept with the run (e.g. what else ran on the machine)")
    args = p.parse_args()
    results: dict[str, list[float]] = {name: [] for name in ARRANGEMENTS}
    context = multiprocessing.get_context("spawn")
    for _ in range(args.rounds):
        for name in ARRANGEMENTS:
            with context.Pool(1) as pool:  # a fresh process: no pool of threads from before
                results[name] += pool.apply(arrangement, (name, args.threads, args.repeats))
    result = {**stamp(), "cpu": cpu_model(), "threads": args.threads, "results": results}
    append_run(OUT, result, args.note)
    print(markdown_table({"runs": [result]}))


if __name__ == "__main__":
    main()
