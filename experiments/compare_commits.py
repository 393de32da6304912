"""Training throughput (or serving throughput) of two or more commits, measured alternately in one run.

    python experiments/compare_commits.py ddca0a2 HEAD                       # bf16, 2 rounds of 60 s each
    OMP_NUM_THREADS=1 python experiments/compare_commits.py ddca0a2 HEAD     # 1 thread each: steadier on busy cores
    python experiments/compare_commits.py HEAD HEAD --set train.engine=reference --only 1 --rounds 2
    python experiments/compare_commits.py HEAD~1 HEAD --serve runs/m30k-de-en-int8 --rounds 3   # the server

Each commit is checked out into a temporary git worktree and its own ``benchmarks/throughput.py
--worker`` trains the ``small`` Transformer on Multi30k for ``--time`` seconds, in its own
subprocess, one contender at a time; the contenders alternate (A B A B ...) so that a machine
that speeds up or slows down during the run affects them alike. ``--set`` passes config
overrides to the contenders listed by ``--only`` (1-based; default: all), e.g. the reference
engine on the same commit. Writes ``benchmarks/results/compare-<name>.json`` with every run's
target tokens/s and peak RSS, so both figures of every contender are reported, not the best.

With ``--serve RUN``, each run is instead the contender's own ``benchmarks/serve.py`` on ``RUN``
(``--serve-args``; default one thread, ``--max-wait-ms 0``) with ``--levels`` levels of 32
one-sentence clients, and the JSON (``benchmarks/results/compare-serving/<name>.json``) keeps every
level's sentences/s and its share of that run's offline batched throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # tables, throughput: the benchmarks' helpers
sys.path.insert(0, str(ROOT / "src"))

from attnkit.common.measure import stamp  # noqa: E402
from tables import markdown, measured, num  # noqa: E402
from throughput import run_child  # noqa: E402


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("commits", nargs="+", help="commits to compare (HEAD = the working tree as committed)")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--time", type=float, default=60.0, help="measured seconds per run")
    p.add_argument("--rounds", type=int, default=2, help="runs per contender, alternating")
    p.add_argument("--max-tokens", type=int, default=4800, help="train.max_tokens (as throughput.py gives attnkit)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for --only contenders")
    p.add_argument("--only", type=int, nargs="*", help="1-based contenders that get --set (default: all)")
    p.add_argument("--name", default=None, help="results/compare-NAME.json (default: the commits joined)")
    p.add_argument("--serve", metavar="RUN",
                   help="compare serving instead: each contender's benchmarks/serve.py on RUN")
    p.add_argument("--serve-args", default="--threads 1 --max-wait-ms 0", help="serve.py's options (with --serve)")
    p.add_argument("--levels", type=int, default=4, help="levels of 32 clients per serving run (with --serve)")
    args = p.parse_args()

    contenders = []
    with tempfile.TemporaryDirectory(prefix="attnkit_cmp_") as tmp:
        (Path(tmp) / "shared").symlink_to(ROOT.parent / "shared")  # each checkout reads ../shared
        for i, commit in enumerate(args.commits, start=1):
            sha = git("rev-parse", "--short", commit)
            tree = Path(tmp) / f"{i}-{sha}"
            git("worktree", "add", "--detach", "-q", str(tree), sha)
            overrides = args.set if args.only is None or i in args.only else []
            contenders.append({"label": f"{i}: {sha}" + (f" {' '.join(overrides)}" if overrides else ""),
                               "commit": sha, "overrides": overrides, "tree": tree, "runs": []})
        try:
            for r in range(args.rounds):
                for c in contenders:
                    if args.serve:
                        c["runs"].append(serve_run(c["tree"], args, Path(tmp) / "serve.json"))
                        print(f"round {r + 1} {c['label']:40s} " + " / ".join(
                            f"{x:.0f}" for x in c["runs"][-1]["sent_per_s"]) + " sentences/s", flush=True)
                        continue
                    cmd = [sys.executable, str(c["tree"] / "benchmarks" / "throughput.py"), "--worker",
                           args.precision, "--time", str(args.time), "--max-tokens", str(args.max_tokens),
                           "--set", *c["overrides"]]
                    load = os.getloadavg()[0]
                    result, rss, _ = run_child(cmd)
                    c["runs"].append({"tgt_tok_per_s": result["tgt_tok_per_s"], "peak_rss_gb": round(rss, 2),
                                      "updates": result["updates"], "tok_per_update": result["tok_per_update"],
                                      "load_average_1min_at_start": round(load, 2)})
                    print(f"round {r + 1} {c['label']:40s} {result['tgt_tok_per_s']:8.0f} tok/s  {rss:.2f} GB",
                          flush=True)
        finally:
            for c in contenders:
                git("worktree", "remove", "--force", str(c["tree"]))
    if args.serve:
        write_serving(contenders, args)
        return
    base = statistics.mean(run["tgt_tok_per_s"] for run in contenders[0]["runs"])
    rows = []
    for c in contenders:
        speeds = [run["tgt_tok_per_s"] for run in c["runs"]]
        rows.append({"label": c["label"], "commit": c["commit"], "overrides": c["overrides"], "runs": c["runs"],
                     "mean_tgt_tok_per_s": round(statistics.mean(speeds), 1),
                     "ratio_to_first": round(statistics.mean(speeds) / base, 3)})
        print(f"{c['label']:40s} " + " / ".join(f"{s:,.0f}" for s in speeds) + f" tok/s, x{rows[-1]['ratio_to_first']}")
    name = args.name or "-".join(c["commit"] for c in contenders)
    out = ROOT / "benchmarks" / "results" / f"compare-{name}.json"
    threads = os.environ.get("OMP_NUM_THREADS")  # torch's default threads in every contender, when set
    out.write_text(json.dumps({**stamp(), "threads": int(threads) if threads else None,
                               "command": "python experiments/compare_commits.py " + " ".join(sys.argv[1:]),
                               "precision": args.precision, "seconds_per_run": args.time, "rounds": args.rounds,
                               "contenders": rows}, indent=2) + "\n")
    print(f"wrote {out}")


def serve_run(tree: Path, args: argparse.Namespace, out: Path) -> dict:
    """One run of the checkout ``tree``'s ``benchmarks/serve.py``: each level of 32 clients' sentences/s and its share
    of the offline batched throughput measured in the same run."""
    cmd = [sys.executable, str(tree / "benchmarks" / "serve.py"), "--run", str(Path(args.serve).resolve()),
           *shlex.split(args.serve_args), "--clients", ",".join(["32"] * args.levels), "--malformed", "50",
           "--mixes", "1", "--out", str(out)]
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    result = json.loads(out.read_text(encoding="utf-8"))
    levels = result["clients"]
    return {"sent_per_s": [lv["sent_per_s"] for lv in levels], "vs_offline": [lv["vs_offline"] for lv in levels],
            "mean_batch": [lv["mean_batch"] for lv in levels], "p50_ms": [lv["p50_ms"] for lv in levels],
            "p99_ms": [lv["p99_ms"] for lv in levels], "offline_sent_per_s": result["offline"]["sent_per_s"],
            "engine": result["engine"]}


def write_serving(contenders: list[dict], args: argparse.Namespace) -> None:
    base = statistics.mean(x for run in contenders[0]["runs"] for x in run["sent_per_s"])
    rows = []
    for c in contenders:
        speeds = [x for run in c["runs"] for x in run["sent_per_s"]]
        shares = [x for run in c["runs"] for x in run["vs_offline"]]
        rows.append({"label": c["label"], "commit": c["commit"], "runs": c["runs"],
                     "mean_sent_per_s": round(statistics.mean(speeds), 1),
                     "mean_vs_offline": round(statistics.mean(shares), 3),
                     "ratio_to_first": round(statistics.mean(speeds) / base, 3)})
        print(f"{c['label']:40s} mean {rows[-1]['mean_sent_per_s']:,.1f} sentences/s, "
              f"{rows[-1]['mean_vs_offline']:.3f} of offline, x{rows[-1]['ratio_to_first']}")
    name = args.name or "-".join(c["commit"] for c in contenders)
    out = ROOT / "benchmarks" / "results" / "compare-serving" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({**stamp(), "command": "python experiments/compare_commits.py " + " ".join(sys.argv[1:]),
                               "run": Path(args.serve).name, "engine": contenders[0]["runs"][0]["engine"],
                               "serve_args": args.serve_args, "clients": 32, "levels_per_run": args.levels,
                               "rounds": args.rounds, "contenders": rows}, indent=2) + "\n")
    print(f"wrote {out}")


def markdown_serving(results: dict[str, dict]) -> str:
    """benchmarks/README.md: every serving comparison (``results/compare-serving/*.json``), every level of every
    run."""
    rows = []
    for run in sorted(results.values(), key=lambda r: r["date"], reverse=True):
        for c in run["contenders"]:
            speeds = " / ".join(num(x) for r in c["runs"] for x in r["sent_per_s"])
            p99 = " / ".join(f"{x:g}" for r in c["runs"] for x in r.get("p99_ms", [])) or "(not recorded)"
            rows.append([measured(run), f"`{c['commit']}`", f"{run['engine']}, `{run['serve_args']}`", speeds,
                         num(c["mean_sent_per_s"]), f"{c['mean_vs_offline']:.2f}", f"{c['ratio_to_first']:.3f}x", p99])
    return markdown(["measured", "contender", "engine, serve.py options", "32 clients: sentences/s, each level",
                     "mean", "mean share of offline", "mean vs first", "p99 ms, each level"], rows, "lllrrrrr")


def markdown_table(results: dict[str, dict]) -> str:
    """benchmarks/README.md: every comparison in ``results/compare-*.json``, every run of every contender."""
    rows = []
    for run in sorted(results.values(), key=lambda r: r["date"], reverse=True):
        for c in run["contenders"]:
            speeds = " / ".join(num(r["tgt_tok_per_s"]) for r in c["runs"])
            rss = " / ".join(f"{r['peak_rss_gb']:.2f}" for r in c["runs"])
            who = f"`{c['commit']}`" + (f" `{' '.join(c['overrides'])}`" if c["overrides"] else "")
            rows.append([measured(run), who, run["precision"], speeds, f"{c['ratio_to_first']:.3f}x", rss,
                         f"{run['rounds']} x {run['seconds_per_run']:g} s, {run.get('threads') or 'default'} threads"])
    return markdown(["measured", "contender", "precision", "target tok/s, each run", "mean vs first", "peak RSS GB",
                     "runs"], rows, "lllrrrl")


if __name__ == "__main__":
    main()
