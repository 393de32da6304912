"""Where the time of one attnkit training update goes: torch.profiler over a few bf16 updates of `small`.

    python experiments/profile_update.py [--updates 5] [--warmup-updates 15]

Builds the same Trainer as ``throughput.py``'s attnkit child (``configs/multi30k-de-en.yaml`` on
Multi30k de->en, ``--precision``, ``train.max_tokens`` 4800), runs ``--warmup-updates`` untimed
updates, then profiles ``--updates`` more (``torch.profiler``, CPU activities). Each op's *self*
time (the time inside the op minus the ops it called) is divided by the number of profiled
updates; its share is of the sum of all self times, which is the update's time on the calling
thread as the profiler saw it (the profiler adds some overhead per op, so the shares are what
to read, not the sum). The top ``--top`` ops are listed, the rest summed as "other".

Writes ``benchmarks/results/profile.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' throughput and tables

from tables import markdown, measured, num  # noqa: E402
from throughput import ROOT, attnkit_trainer  # noqa: E402


def profile(precision: str, warmup: int, updates: int, max_tokens: int, overrides: list[str], top: int) -> dict:
    """Profile ``updates`` training updates after ``warmup``; the top ops by self time and the rest."""
    import torch
    from torch.profiler import ProfilerActivity

    trainer = attnkit_trainer(precision, max_tokens, overrides)
    batches = iter(trainer.task.batches(0))
    for _ in range(warmup):
        trainer.train_step([next(batches)])
    tokens = 0
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(updates):
            tokens += trainer.train_step([next(batches)])[1]
        wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in events)
    ops = [{"op": e.key, "self_ms_per_update": round(e.self_cpu_time_total / 1e3 / updates, 2),
            "share": round(e.self_cpu_time_total / total_us, 4), "calls_per_update": round(e.count / updates, 1)}
           for e in events[:top]]
    rest = sum(e.self_cpu_time_total for e in events[top:])
    ops.append({"op": "other", "self_ms_per_update": round(rest / 1e3 / updates, 2), "share": round(rest / total_us, 4),
                "calls_per_update": round(sum(e.count for e in events[top:]) / updates, 1)})
    return {"precision": precision, "bf16": trainer.bf16, "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "warmup_updates": warmup, "profiled_updates": updates, "tgt_tokens_per_update": round(tokens / updates, 1),
            "self_ms_per_update": round(total_us / 1e3 / updates, 1),
            "wall_ms_per_update_profiled": round(wall * 1e3 / updates, 1), "ops": ops}


def markdown_table(results: dict) -> str:
    """benchmarks/README.md: the profiled ops, their self ms per update and share, then when and how."""
    rows = [[f"`{o['op']}`", num(o["calls_per_update"], 1), num(o["self_ms_per_update"], 1), f"{o['share']:.1%}"]
            for o in results["ops"]]
    rows.append(["total (self times)", "", num(results["self_ms_per_update"], 1), "100.0%"])
    return (markdown(["op", "calls per update", "self ms per update", "share of the update"], rows, "lrrr") +
            f"\n\n{measured(results)}: {results['profiled_updates']} {results['precision']} updates of `small` "
            f"(~{num(results['tgt_tokens_per_update'])} target tokens each) after {results['warmup_updates']} "
            f"untimed, {results['threads']} threads, `{results['command']}`; wall time under the profiler "
            f"{num(results['wall_ms_per_update_profiled'])} ms per update.\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--warmup-updates", type=int, default=15)
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=4800, help="attnkit's train.max_tokens, as in throughput.py")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra config overrides for attnkit")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "profile.json"))
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from attnkit.common.measure import stamp

    stamped = stamp()  # the checkout measured
    result = profile(args.precision, args.warmup_updates, args.updates, args.max_tokens, args.set, args.top)
    result = {**stamped, **result, "command": " ".join(["python", "experiments/profile_update.py", *sys.argv[1:]])}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(markdown_table(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
