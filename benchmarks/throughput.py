"""Training throughput and peak memory: attnkit vs the plain torch.nn.Transformer reference loop.

    python benchmarks/throughput.py                 # fp32 and bf16, 120 s measured per contender
    python benchmarks/throughput.py --time 60 --precisions bf16

Both train the `small` Transformer (d_model 256, 4 heads, ff 1024, 3+3 layers, joint 8k
SentencePiece unigram vocabulary, tied embeddings) on Multi30k de->en with length-bucketed
batches of about 4,000 real target tokens, label smoothing 0.1 and Adam. The two budgets count
differently: the reference's ``--max-tokens`` (4096) counts padded *target* positions and its
batches are sorted by target length alone; attnkit's ``train.max_tokens`` counts padded positions
of the *longer* side (rounded to ``train.pad_multiple``), as fairseq does, so
``--attnkit-max-tokens 4800`` gives it about as many target tokens per update (the table and the
JSON give both contenders' ``tok_per_update``); the 4096 of ``configs/multi30k-de-en.yaml`` gives
it fewer. Each contender runs in its own
subprocess, one after the other (never concurrently), so the peak RSS (from ``wait4``) is its
own. Target tokens/s are counted after ``--warmup-updates`` untimed updates; the ratio is
attnkit over the reference's fp32 figure measured in the same run.

Writes ``benchmarks/results/throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tables import markdown, measured, num

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
REFERENCE = SHARED / "bench" / "torch_reference.py"


def attnkit_worker(precision: str, seconds: float, warmup: int, max_tokens: int, overrides: list[str]) -> None:
    """Runs in the child: the real attnkit training step (Trainer.train_step) on Multi30k."""
    sys.path.insert(0, str(ROOT / "src"))
    from attnkit.config import load_config
    from attnkit.runconfig import RunConfig
    from attnkit.train import Trainer

    data = SHARED / "data" / "multi30k"
    cfg = load_config(RunConfig, ROOT / "configs" / "multi30k-de-en.yaml",
                      [f"train.precision={precision}", f"train.max_tokens={max_tokens}", "train.progress=false",
                       f"data.train={data}/train.de.gz", f"data.train_tgt={data}/train.en.gz",
                       f"data.valid={data}/val.de.gz", f"data.valid_tgt={data}/val.en.gz", *overrides])
    trainer = Trainer(cfg, tempfile.mkdtemp(prefix="attnkit_tp_"), log=lambda m: print(m, flush=True))
    step, tokens, updates, t_start = 0, 0, 0, None
    epoch = 0
    while True:
        for batch in trainer.task.batches(epoch):
            _, n_targets = trainer.train_step([batch])
            step += 1
            now = time.perf_counter()
            if step == warmup:
                t_start = now
            elif t_start is not None:
                tokens += n_targets
                updates += 1
                if now - t_start >= seconds:
                    secs = now - t_start
                    print("RESULT " + json.dumps({"tgt_tok_per_s": round(tokens / secs, 1), "updates": updates,
                                                  "secs": round(secs, 1), "tok_per_update": round(tokens / updates, 1),
                                                  "bf16": trainer.bf16}), flush=True)
                    return
        epoch += 1


def run_child(cmd: list[str]) -> tuple[dict, float, str]:
    """Run ``cmd``; return its RESULT json, its peak RSS in GB, and its output tail."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    return json.loads(lines[-1][7:]), usage.ru_maxrss / 1024 / 1024, out


def markdown_table(results: dict[str, dict]) -> str:
    """README: every run in ``benchmarks/results/`` (``{path: result JSON}``), newest first, one row per contender."""
    rows = []
    for run in sorted(results.values(), key=lambda r: r["date"], reverse=True):
        targets = run["targets"]
        for r in run["rows"]:
            ours_bf16 = r["contender"] == "attnkit" and r["precision"] == "bf16"
            bold = (lambda text: f"**{text}**") if ours_bf16 else (lambda text: text)
            target = (f">= {targets['tok_per_s_ratio_to_reference_fp32']:g}x, <= {targets['peak_rss_gb_bf16']:g} GB"
                      if ours_bf16 else "")
            rows.append([measured(run), r["contender"], r["precision"], num(r["tgt_tok_per_s"]),
                         bold(f"{r['ratio_to_reference_fp32']:.2f}x"), bold(f"{r['peak_rss_gb']:.2f}"),
                         f"{run['measured_seconds']:g} s, {run['threads']} threads, ~{num(r['tok_per_update'])}",
                         target])
    return markdown(["measured", "contender", "precision", "target tok/s", "x reference fp32", "peak RSS GB",
                     "timed, threads, target tokens per update", "target"], rows, "lllrrrll")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--time", type=float, default=120.0, help="measured seconds per contender")
    p.add_argument("--warmup-updates", type=int, default=15)
    p.add_argument("--max-tokens", type=int, default=4096, help="the reference's budget (padded target tokens)")
    p.add_argument("--attnkit-max-tokens", type=int, default=4800,
                   help="attnkit's train.max_tokens (padded tokens of the longer side); see above")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra config overrides for attnkit, e.g. train.pad_multiple=4")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "throughput.json"))
    p.add_argument("--worker", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        attnkit_worker(args.worker, args.time, args.warmup_updates, args.max_tokens, args.set)
        return
    if not REFERENCE.exists():
        sys.exit(f"{REFERENCE} is missing: this benchmark needs ../shared beside the repository")

    rows = []
    for precision in args.precisions:
        ref_cmd = [sys.executable, str(REFERENCE), "--time", str(args.time), "--warmup-updates",
                   str(args.warmup_updates), "--max-tokens", str(args.max_tokens)]
        ref_cmd += ["--bf16"] if precision == "bf16" else []
        ours_cmd = [sys.executable, __file__, "--worker", precision, "--time", str(args.time),
                    "--warmup-updates", str(args.warmup_updates), "--max-tokens", str(args.attnkit_max_tokens),
                    "--set", *args.set]
        for who, cmd in (("torch.nn.Transformer reference", ref_cmd), ("attnkit", ours_cmd)):
            print(f"running {who} ({precision}) ...", flush=True)
            result, rss_gb, _ = run_child(cmd)
            rows.append({"contender": who, "precision": precision, "tgt_tok_per_s": result["tgt_tok_per_s"],
                         "tok_per_update": result["tok_per_update"], "updates": result["updates"],
                         "peak_rss_gb": round(rss_gb, 2)})
    ref_fp32 = next((r["tgt_tok_per_s"] for r in rows
                     if r["contender"].startswith("torch") and r["precision"] == "fp32"), None)
    print(f"\n{'contender':<32} {'prec':<5} {'tgt tok/s':>10} {'tok/upd':>8} {'x ref fp32':>10} {'peak RSS GB':>11}")
    for r in rows:
        r["ratio_to_reference_fp32"] = round(r["tgt_tok_per_s"] / ref_fp32, 2) if ref_fp32 else None
        print(f"{r['contender']:<32} {r['precision']:<5} {r['tgt_tok_per_s']:>10.0f} {r['tok_per_update']:>8.0f} "
              f"{r['ratio_to_reference_fp32'] or float('nan'):>10.2f} {r['peak_rss_gb']:>11.2f}")
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from attnkit.measure import stamp

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        **stamp(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "measured_seconds": args.time, "max_tokens": args.max_tokens,
        "attnkit_max_tokens": args.attnkit_max_tokens, "rows": rows,
        "command": " ".join(["python", "benchmarks/throughput.py", *sys.argv[1:]]),
        "targets": {"tok_per_s_ratio_to_reference_fp32": 3.0, "peak_rss_gb_bf16": 2.0}}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
