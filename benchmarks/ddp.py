"""Data-parallel training: 1 process vs N processes (DDP over gloo) on this machine, in target tokens/s.

    python benchmarks/ddp.py                    # 1 vs 2 processes, 120 s measured each, small model on Multi30k
    python benchmarks/ddp.py --time 5 --warmup-updates 2 --config configs/demo.yaml \\
        --set train.max_tokens=500 model.transformer.d_model=32 model.transformer.d_ff=64 data.generate_train=2000

Each contender is ``torchrun --standalone --nproc_per_node=P`` running the real trainer
(``Trainer.train_step`` on the sharded update, DDP all-reduce included), one after the other.
Both keep the same effective batch, ``train.tokens_per_update`` = max_tokens x 2 (1 process
accumulates 2 batches per update, 2 processes take one each), and share the cores: 1 process
uses them all as threads, P processes get cores / P threads each (the trainer's default).

Honest expectation: on a 2-core machine the processes split the same two cores, so the
arithmetic is the same and DDP adds the gradient all-reduce and one process's memory
traffic more. This measures that *overhead*; a speed-up needs more cores, GPUs or machines.

Appends the run to ``benchmarks/results/ddp.json`` (every run kept).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tables import append_run, cpu_info, markdown, measured, num

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "multi30k"
MULTI30K = ROOT / "configs" / "multi30k-de-en.yaml"


def worker(config: str, overrides: list[str], seconds: float, warmup: int) -> None:
    """Runs in each torchrun process: train for ``seconds`` after ``warmup`` updates; rank 0 prints RESULT."""
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from attnkit.config.loader import load_config
    from attnkit.config.schema import RunConfig
    from attnkit.training.trainer import Trainer

    cfg = load_config(RunConfig, config, overrides)
    run_dir = os.environ.get("ATTNKIT_BENCH_RUN_DIR") or tempfile.mkdtemp(prefix="attnkit_ddp_")
    trainer = Trainer(cfg, run_dir, log=lambda m: print(m, flush=True))
    w = trainer.workers
    per_update = trainer.accumulate * w.world_size
    tokens, updates, t_start, epoch = 0, 0, 0.0, 0
    while True:
        batches = trainer.task.batches(epoch)
        for pos in range(0, len(batches), per_update):
            _, n_targets = trainer.train_step(batches[pos: pos + per_update])  # targets of all ranks
            trainer.step += 1
            now = time.perf_counter()
            if trainer.step == max(warmup, 1):
                t_start = now
            elif trainer.step > max(warmup, 1):
                tokens, updates = tokens + n_targets, updates + 1
                if w.broadcast(now - t_start >= seconds):  # rank 0's clock decides, so no rank is left waiting
                    if w.is_main:
                        secs = now - t_start
                        print("RESULT " + json.dumps({
                            "tgt_tok_per_s": round(tokens / secs, 1), "updates": updates, "secs": round(secs, 1),
                            "tok_per_update": round(tokens / updates, 1), "threads": torch.get_num_threads(),
                            "accumulate": trainer.accumulate, "bf16": trainer.bf16}), flush=True)
                    return
        epoch += 1


def run_contender(processes: int, args: argparse.Namespace, overrides: list[str]) -> dict:
    """One torchrun launch with ``processes`` workers; its RESULT line."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
           __file__, "--worker", "--config", args.config, "--time", str(args.time),
           "--warmup-updates", str(args.warmup_updates), "--set", *overrides]
    with tempfile.TemporaryDirectory(prefix="attnkit_ddp_") as run_dir:
        env = {**os.environ, "ATTNKIT_BENCH_RUN_DIR": run_dir, "CUDA_VISIBLE_DEVICES": ""}
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def two_processes(run: dict) -> float:
    """The last layout's tokens/s over the first's, the headline."""
    return run["rows"][-1]["ratio_to_first"]


def markdown_table(runs: list[dict]) -> str:
    """Target tokens/s of each process layout at the same tokens per update, per run."""
    rows = [[f"{r['processes']} x {r['threads_per_process']}", str(r["accumulate"]), num(r["tokens_per_update"]),
             num(r["tgt_tok_per_s"]), f"**{r['ratio_to_first']:.2f}x**", measured(results)]
            for results in runs for r in results["rows"]]
    return markdown(["processes x threads", "accumulate", "tokens per update", "target tok/s", "x the first",
                     "measured"], rows, "lrrrrl")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--time", type=float, default=120.0, help="measured seconds per contender")
    p.add_argument("--warmup-updates", type=int, default=10, help="untimed updates first")
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="worker counts to compare")
    p.add_argument("--config", default=str(MULTI30K), help="run config (default: the small model on Multi30k)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ddp.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.config, args.set, args.time, args.warmup_updates)
        return

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    overrides = ["train.progress=false"]
    if Path(args.config).resolve() == MULTI30K:
        if not DATA.exists():
            sys.exit(f"{DATA} is missing: this benchmark needs ../shared beside the repository (or pass --config)")
        overrides += [f"data.train={DATA}/train.de.gz", f"data.train_tgt={DATA}/train.en.gz",
                      f"data.valid={DATA}/val.de.gz", f"data.valid_tgt={DATA}/val.en.gz"]
    overrides += args.set
    sys.path.insert(0, str(ROOT / "src"))
    from attnkit.config.loader import load_config
    from attnkit.config.schema import RunConfig

    max_tokens = load_config(RunConfig, args.config, overrides).train.max_tokens
    tokens_per_update = max_tokens * math.lcm(*args.processes)  # the same effective batch for every contender
    overrides.append(f"train.tokens_per_update={tokens_per_update}")

    rows = []
    for processes in args.processes:
        threads = [] if processes > 1 else [f"train.threads={cpus}"]  # > 1: the trainer gives each cpus // P
        print(f"running {processes} process(es) ...", flush=True)
        r = run_contender(processes, args, overrides + threads)
        rows.append({"processes": processes, "threads_per_process": r["threads"], "accumulate": r["accumulate"],
                     "tokens_per_update": tokens_per_update, "tgt_tok_per_s": r["tgt_tok_per_s"],
                     "updates": r["updates"], "s_per_update": round(r["secs"] / r["updates"], 3), "bf16": r["bf16"]})
    base = rows[0]["tgt_tok_per_s"]
    print(f"\n{'processes':>9} {'threads/proc':>12} {'accumulate':>10} {'tok/update':>10} {'tgt tok/s':>10} "
          f"{'s/update':>8} {'x 1st':>6}")
    for r in rows:
        r["ratio_to_first"] = round(r["tgt_tok_per_s"] / base, 2)
        print(f"{r['processes']:>9} {r['threads_per_process']:>12} {r['accumulate']:>10} {r['tokens_per_update']:>10} "
              f"{r['tgt_tok_per_s']:>10.0f} {r['s_per_update']:>8.3f} {r['ratio_to_first']:>6.2f}")
    note = (f"{cpus} CPU cores shared by all processes: the same arithmetic split {max(args.processes)} ways plus "
            f"DDP's gradient all-reduce (gloo), so this shows the overhead of data parallelism, not a speed-up; "
            f"a speed-up needs more cores, GPUs or machines")
    print(note)
    import torch

    from attnkit.common.measure import stamp

    append_run(Path(args.out), {
        **stamp(), "torch": torch.__version__, "cpus": cpus, "cpu": cpu_info(),
        "config": os.path.relpath(args.config, ROOT), "overrides": args.set, "measured_seconds": args.time,
        "warmup_updates": args.warmup_updates, "rows": rows, "note": note,
        "command": " ".join(["python", "benchmarks/ddp.py", *sys.argv[1:]])})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
