"""What length-aware batching buys the server: the same queue drained by first-come batches and by attnkit's rule.

    flock /tmp/attnkit-bench.lock python benchmarks/serve_batching.py --run runs/m30k-de-en

In this process, on the server's own worker (:class:`attnkit.serve.batching.ModelWorker`) and the model's
servable (what ``attnkit serve`` runs), without HTTP: a burst of requests, one text each, most of them
test_2016_flickr sentences and every fifth a long one (several sentences joined, up to 400 characters),
is queued at once and drained greedily (beam 1) with ``--max-batch`` texts per batch, by three rules:

``first come``
    the oldest queued requests, in arrival order, up to ``max_batch`` texts (no token budget): a long
    text pads every short one in its batch to its length.
``length-aware``
    attnkit's rule (:meth:`ModelWorker._select`): the oldest request, then the queued ones closest to it
    in length, within ``max_batch`` texts and ``max_batch_tokens`` padded tokens.
``continuous``
    continuous batching (``attnkit serve --batching continuous``): the worker keeps one decoding batch
    running and the queued requests join it, oldest first, at every step as rows end
    (:class:`attnkit.engine.continuous.ContinuousGreedy`); a "batch" is then a decoding step, and its
    padding is not comparable with the others'.

Each rule drains the burst ``--repeats`` times, alternating, one at a time (this machine is shared and
noisy: the rules are compared side by side, every repeat reported). Reported: seconds, sentences/s,
batches, padding (the share of padded source positions), and the latency of short and of long requests
(from the burst to the answer: p50 / p90). Every output is checked equal between the rules.
Appends the run to ``benchmarks/results/batching.json`` (every run kept); :func:`markdown_table` renders it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from attnkit.common.measure import stamp  # noqa: E402
from attnkit.data.readers import read_lines  # noqa: E402
from attnkit.serve.batching import BatchRecord, Limits, ModelWorker, _Job  # noqa: E402
from attnkit.serve.servables import load_servable  # noqa: E402
from nbsvm import cpu_model  # noqa: E402
from serve import long_texts  # noqa: E402
from tables import append_run, markdown  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "multi30k"
RESULTS = ROOT / "benchmarks" / "results" / "batching.json"


class FirstCome(ModelWorker):
    """The worker with the rule length-aware batching replaced: the oldest jobs of the key, in order."""

    def _select(self, first: _Job) -> list[_Job]:
        batch, size = [], 0
        for job in self._jobs:
            if job.key == first.key and (not batch or size + len(job.texts) <= self.limits.max_batch):
                batch.append(job)
                size += len(job.texts)
        return batch

    def _full(self, batch: list[_Job]) -> bool:
        return sum(len(j.texts) for j in batch) >= self.limits.max_batch


def workload(sentences: list[str], requests: int, long_every: int = 5) -> list[str]:
    """``requests`` texts: test sentences in order, every ``long_every``-th a long text of several of them."""
    longs = long_texts(sentences, count=requests // long_every + 1, chars=400)
    return [longs[i // long_every] if i % long_every == long_every - 1 else sentences[i % len(sentences)]
            for i in range(requests)]


async def drain(worker_class: type[ModelWorker], servable, texts: list[str], lengths: list[int],
                limits: Limits, continuous: bool = False) -> dict:
    """Queue every text at once (one request each) on a fresh worker of ``worker_class``, decoded by the
    servable's continuous stepper when ``continuous``; wait for all."""
    batches: list[BatchRecord] = []
    worker = worker_class("bench", limits, on_batch=batches.append)
    run = lambda batch: servable.translate(batch, beam=1, n_best=1, lenpen=0.0)  # noqa: E731
    start = time.perf_counter()
    done = [0.0] * len(texts)

    async def one(i: int) -> list:
        out = await worker.submit(("translate", 1), run, [texts[i]], [lengths[i]],
                                  servable.stepper if continuous else None)
        done[i] = time.perf_counter() - start
        return out[0][0]

    outputs = await asyncio.gather(*(one(i) for i in range(len(texts))))
    seconds = time.perf_counter() - start
    worker.close()
    padded = sum(b.tokens for b in batches)
    short = [done[i] * 1000 for i in range(len(texts)) if lengths[i] < 40]
    long = [done[i] * 1000 for i in range(len(texts)) if lengths[i] >= 40]

    def q(values: list[float], p: int) -> float:
        return round(statistics.quantiles(values, n=100, method="inclusive")[p - 1], 1)

    return {"seconds": round(seconds, 2), "sent_per_s": round(len(texts) / seconds, 1), "batches": len(batches),
            "padding": None if continuous else round(1 - sum(lengths) / padded, 3),
            "short_p50_ms": q(short, 50), "short_p90_ms": q(short, 90),
            "long_p50_ms": q(long, 50), "long_p90_ms": q(long, 90), "outputs": outputs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default=str(ROOT / "runs" / "multi30k-de-en"), help="a de->en translation run or export")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--requests", type=int, default=400, help="requests in the burst (default: 400)")
    p.add_argument("--repeats", type=int, default=2, help="drains per rule, alternating (default: 2)")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=Limits().max_batch_tokens)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    source = DATA / "test_2016_flickr.de.gz"
    if not source.exists():
        sys.exit(f"{source} is missing: this benchmark needs ../shared/data/multi30k beside the repository")
    torch.set_num_threads(args.threads)
    servable = load_servable(args.run, args.threads, continuous=True)
    texts = workload(read_lines(source), args.requests)
    lengths = servable.lengths(texts)
    limits = Limits(max_batch=args.max_batch, max_batch_tokens=args.max_batch_tokens, max_wait_ms=0.0,
                    max_queue=10 * args.requests)
    servable.translate(texts[:32], beam=1, n_best=1, lenpen=0.0)  # warm-up
    rules = {"first come": (FirstCome, False), "length-aware": (ModelWorker, False), "continuous": (ModelWorker, True)}
    measured, outputs = [], {}
    for repeat in range(1, args.repeats + 1):
        for rule, (worker_class, continuous) in rules.items():
            r = asyncio.run(drain(worker_class, servable, texts, lengths, limits, continuous))
            outputs.setdefault(rule, r.pop("outputs"))
            measured.append({"rule": rule, "repeat": repeat, **r})
            print(json.dumps(measured[-1]), flush=True)
    results = {
        **stamp(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/serve_batching.py", *sys.argv[1:]]),
        "model": Path(args.run).name, "threads": args.threads, "requests": len(texts),
        "long_requests": sum(n >= 40 for n in lengths), "mean_length": round(sum(lengths) / len(lengths), 1),
        "max_batch": args.max_batch, "max_batch_tokens": args.max_batch_tokens,
        "same_outputs": outputs["first come"] == outputs["length-aware"] == outputs["continuous"],
        "cpu": cpu_model(), "torch": torch.__version__, "drains": measured,
    }
    append_run(Path(args.out), results)
    print(markdown_table([results]))


def length_aware_over_first_come(run: dict) -> float:
    """The length-aware rule's best sentences/s over first come's, the headline."""
    best = {}
    for d in run["drains"]:
        best[d["rule"]] = max(best.get(d["rule"], 0.0), d["sent_per_s"])
    return best["length-aware"] / best["first come"]


def markdown_table(runs: list[dict]) -> str:
    """Each run, newest first: every drain."""
    return "\n\n".join(_drains_table(r) for r in sorted(runs, key=lambda r: r["date"], reverse=True))


def _drains_table(results: dict) -> str:
    """One row per drain: each rule's time, padding and the latency of short and long requests."""
    rows = [[r["rule"], r["repeat"], f"{r['seconds']:.2f}", f"{r['sent_per_s']:.1f}", r["batches"],
             "" if r["padding"] is None else f"{100 * r['padding']:.0f}%",
             f"{r['short_p50_ms']:.0f} / {r['short_p90_ms']:.0f}",
             f"{r['long_p50_ms']:.0f} / {r['long_p90_ms']:.0f}"] for r in results["drains"]]
    table = markdown(["rule", "repeat", "seconds", "sentences/s", "batches", "padding", "short requests p50 / p90 ms",
                      "long requests p50 / p90 ms"], rows, "lrrrrrrr")
    return (f"{table}\n\nA burst of {results['requests']:,} requests of one text each ({results['long_requests']} of "
            f"them long, >= 40 source tokens; {results['mean_length']} tokens on average), model "
            f"`{results['model']}`, greedy, {results['threads']} thread, `--max-batch {results['max_batch']}`, "
            f"`--max-batch-tokens {results['max_batch_tokens']:,}`; outputs equal between the rules: "
            f"{'yes' if results['same_outputs'] else 'NO'}. {results['cpu']}; measured {results['date'][:10]} at "
            f"`{results['commit']}`.")


if __name__ == "__main__":
    main()
