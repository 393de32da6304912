"""Corpora of any size: `attnkit prepare` and the first training updates from 29k to 5M sentence pairs.

    python benchmarks/scale.py generate                      # the corpora, into --work-dir (not timed)
    flock /tmp/attnkit-bench.lock python benchmarks/scale.py measure [--updates 300] [--sizes 29000 ...]
    python benchmarks/scale.py table                         # the latest run's table

The corpora recombine Multi30k's training pairs: each line joins 1-3 pairs drawn at random (both
sides alike), seeded by the corpus size, so every size is a deterministic corpus of Multi30k-like
text. They are written to ``--work-dir`` (default ``/tmp/attnkit-scale``), never into the repository.

``measure`` runs, one size at a time and each in its own process: ``prepare`` from scratch (time,
pairs/s, peak RSS of the main process and of its encoding workers, disk size of ``data/``), then
training with the prepared data (``configs/multi30k-de-en.yaml``: time from process start to the end
of the first update, peak RSS and target tokens/s over the first ``--updates`` updates). It adds the run to
``benchmarks/results/scale.json`` (updated after each size; every run kept; ``--keep`` and ``--train-only`` measure
the latest run again) and draws ``docs/figures/scale.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from tables import cpu_info, write_runs

START = time.perf_counter()  # process start, for the time to the first update (before torch is imported)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "multi30k"
RESULTS = ROOT / "benchmarks" / "results" / "scale.json"
FIGURE = ROOT / "docs" / "figures" / "scale.png"
CONFIG = ROOT / "configs" / "multi30k-de-en.yaml"
SIZES = (29_000, 290_000, 2_900_000, 5_000_000)
TRAIN_OVERRIDES = ["train.progress=false", "train.max_minutes=0", "train.valid_bleu_sentences=0"]
GB = 1024 ** 3


# -- corpora ------------------------------------------------------------------------------


def corpus_paths(work: Path, size: int) -> tuple[Path, Path]:
    return work / f"pairs-{size}.de", work / f"pairs-{size}.en"


def generate(work: Path, size: int) -> tuple[Path, Path]:
    """``size`` lines per side, each 1-3 Multi30k training pairs joined by a space (seeded by ``size``)."""
    src, tgt = corpus_paths(work, size)
    done = work / f"pairs-{size}.done"
    if done.exists():
        return src, tgt
    sys.path.insert(0, str(ROOT / "src"))
    from attnkit.data.readers import read_parallel

    pairs = read_parallel(DATA / "train.de.gz", DATA / "train.en.gz")
    rng = random.Random(size)
    work.mkdir(parents=True, exist_ok=True)
    with open(src, "w", encoding="utf-8") as fs, open(tgt, "w", encoding="utf-8") as ft:
        for _ in range(size):
            chosen = [pairs[rng.randrange(len(pairs))] for _ in range(rng.randint(1, 3))]
            fs.write(" ".join(s for s, _ in chosen) + "\n")
            ft.write(" ".join(t for _, t in chosen) + "\n")
    done.touch()
    return src, tgt


# -- the measuring children ---------------------------------------------------------------


def overrides(src: Path, tgt: Path) -> list[str]:
    return [f"data.train={src}", f"data.train_tgt={tgt}", f"data.valid={DATA}/val.de.gz",
            f"data.valid_tgt={DATA}/val.en.gz"]


def status_gb(key: str) -> float:
    """A memory figure of this process from /proc/self/status (VmHWM, RssAnon, RssFile), in GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024 / GB
    return float("nan")


def rss_gb(pid: int) -> float:
    """Resident memory of a process now (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return 0.0


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


class PeakTotalRss:
    """Samples the resident memory of this process plus its children (the encoding workers) every 0.1 s.

    (``ru_maxrss`` of a child started by fork+exec includes its parent's memory at the fork, so it
    cannot tell what a worker itself used.)
    """

    def __init__(self) -> None:
        import threading

        self.peak, self.worker_peak = 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.wait(0.1):
            workers = [rss_gb(c) for c in children(me)]
            self.worker_peak = max([self.worker_peak, *workers])
            self.peak = max(self.peak, rss_gb(me) + sum(workers))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and of its finished children (the encoding workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def prepare_child(work: Path, size: int) -> dict:
    """Runs in a fresh process: prepare the corpus of ``size`` pairs from scratch."""
    sys.path.insert(0, str(ROOT / "src"))
    from attnkit.config.loader import load_config
    from attnkit.config.schema import RunConfig
    from attnkit.runs.layout import DATA_DIR
    from attnkit.tasks import prepare

    src, tgt = corpus_paths(work, size)
    run = work / f"run-{size}"
    shutil.rmtree(run, ignore_errors=True)
    cfg = load_config(RunConfig, CONFIG, overrides(src, tgt))
    marks: dict[str, float] = {}

    def log(msg: str) -> None:
        marks.setdefault(msg.split(":")[0].split(" (")[0], time.perf_counter())
        print(msg, file=sys.stderr, flush=True)

    sampler = PeakTotalRss()
    start, cpu_start = time.perf_counter(), cpu_seconds()
    data = prepare(cfg, run, log)
    end, cpu = time.perf_counter(), cpu_seconds() - cpu_start
    sampler.stop()
    tok_start, tok_end = marks["training a unigram SentencePiece tokenizer"], marks["trained the tokenizer"]
    disk = sum(f.stat().st_size for f in (run / DATA_DIR).iterdir())
    seconds = end - start
    return {"pairs": size, "kept": len(data), "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
            "pairs_per_cpu_s": round(size / cpu),
            "pairs_per_s": round(size / seconds), "hash_seconds": round(tok_start - start, 2),
            "tokenizer_seconds": round(tok_end - tok_start, 2), "encode_seconds": round(end - tok_end, 2),
            "encode_pairs_per_s": round(size / (end - tok_end)),
            "tokens": sum(s["tokens"] for s in data.manifest["sides"].values()), "disk_bytes": disk,
            "peak_rss_gb": round(status_gb("VmHWM"), 3),
            "worker_peak_rss_gb": round(sampler.worker_peak, 3), "total_peak_rss_gb": round(sampler.peak, 3),
            "input_bytes": src.stat().st_size + tgt.stat().st_size}


def train_child(work: Path, size: int, updates: int) -> dict:
    """Runs in a fresh process: the first ``updates`` training updates on the prepared corpus of ``size`` pairs."""
    sys.path.insert(0, str(ROOT / "src"))
    from attnkit.config.loader import load_config
    from attnkit.config.schema import RunConfig
    from attnkit.training.trainer import Trainer

    src, tgt = corpus_paths(work, size)
    run = work / f"run-{size}"
    shutil.rmtree(run / "checkpoints", ignore_errors=True)  # a new run that reuses the prepared data
    for name in ("config.yaml", "metrics.jsonl"):
        (run / name).unlink(missing_ok=True)
    logged: list[str] = []
    cfg = load_config(RunConfig, CONFIG, overrides(src, tgt) + TRAIN_OVERRIDES)
    trainer = Trainer(cfg, run, log=logged.append)
    if not any(m.startswith("using the prepared data") for m in logged):
        raise SystemExit(f"the training run did not reuse the prepared data: {logged}")
    done, tokens, first, last, cpu_first = 0, 0, 0.0, 0.0, 0.0
    epoch = 0
    while done < updates:
        for batch in trainer.task.batches(epoch):
            _, n_targets = trainer.train_step([batch])
            done += 1
            last = time.perf_counter()
            if done == 1:
                first, cpu_first = last, time.process_time()
            else:
                tokens += n_targets
            if done == updates:
                break
        epoch += 1
    return {"pairs": size, "updates": updates, "first_update_seconds": round(first - START, 2),
            "tgt_tok_per_s": round(tokens / (last - first), 1) if updates > 1 else None,
            "tgt_tok_per_cpu_s": round(tokens / (time.process_time() - cpu_first), 1) if updates > 1 else None,
            "peak_rss_gb": round(status_gb("VmHWM"), 3), "rss_anon_gb": round(status_gb("RssAnon"), 3),
            "rss_file_gb": round(status_gb("RssFile"), 3), "bf16": trainer.bf16,
            "threads": __import__("torch").get_num_threads()}


def run_child(args: list[str]) -> dict:
    cmd = [sys.executable, __file__, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# -- results ------------------------------------------------------------------------------


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=ROOT).stdout.strip()


def size_ratio(run: dict) -> float:
    """Target tokens/s at the largest corpus over the smallest, the headline."""
    sizes = {r["pairs"]: r["train"]["tgt_tok_per_s"] for r in run["sizes"]}
    return sizes[max(sizes)] / sizes[min(sizes)]


def markdown_table(runs: list[dict]) -> str:
    """Each run, newest first: one row per corpus size, the cost per million pairs, the targets."""
    return "\n".join(_run_table(r) for r in sorted(runs, key=lambda r: r["date"], reverse=True))


def _run_table(results: dict) -> str:
    """One run: a row per corpus size."""
    rows = ["| pairs | prepare (CPU) | pairs/s (all / encoding) | prepare peak RSS (main / all processes) | "
            "disk (data/) | train peak RSS | target tok/s | first update |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["sizes"]:
        p, t = r["prepare"], r["train"]
        rows.append(f"| {r['pairs']:,} | {p['seconds']:.0f} s ({p['cpu_seconds']:.0f} s) | "
                    f"{p['pairs_per_s']:,} / {p['encode_pairs_per_s']:,} | "
                    f"{p['peak_rss_gb']:.2f} / {p['total_peak_rss_gb']:.2f} GB | {p['disk_bytes'] / 1e6:,.0f} MB | "
                    f"{t['peak_rss_gb']:.2f} GB | {t['tgt_tok_per_s']:,.0f} | {t['first_update_seconds']:.1f} s |")
    small, large = results["sizes"][0], results["sizes"][-1]
    millions = (large["pairs"] - small["pairs"]) / 1e6
    if millions > 0:
        def per_million(get) -> float:
            return (get(large) - get(small)) / millions

        lp, lt, st = large["prepare"], large["train"], small["train"]
        disk = per_million(lambda r: r["prepare"]["disk_bytes"]) / 1e6
        train = per_million(lambda r: r["train"]["peak_rss_gb"]) * 1024
        seconds = per_million(lambda r: r["prepare"]["seconds"])

        def met(ok: bool) -> str:
            return "met" if ok else "**not met**"

        rss = lt["peak_rss_gb"] - st["peak_rss_gb"]
        speed = lt["tgt_tok_per_s"] / st["tgt_tok_per_s"]
        train_at = large.get("train_commit", large["commit"])
        rows += ["", f"Per million pairs ({small['pairs']:,} -> {large['pairs']:,}): {disk:,.0f} MB on disk, "
                     f"{seconds:,.0f} s of prepare, {train:+,.0f} MB of training peak RSS.", "",
                 f"- prepare at {large['pairs']:,} pairs: {lp['pairs_per_s']:,} pairs/s on the shared cores "
                 f"({lp['pairs_per_cpu_s']:,} pairs per CPU-second); target >= 40,000 pairs/s: "
                 f"{met(lp['pairs_per_s'] >= 40_000)}",
                 f"- training peak RSS at {large['pairs']:,} vs {small['pairs']:,} pairs: {rss:+.2f} GB; "
                 f"target <= +0.3 GB: {met(rss <= 0.3)}",
                 f"- target tokens/s at {large['pairs']:,} / at {small['pairs']:,} pairs: {speed:.2f}; "
                 f"target within 10%: {met(abs(speed - 1) <= 0.1)}",
                 f"- time to the first update at {large['pairs']:,} pairs (data prepared): "
                 f"{lt['first_update_seconds']:.1f} s; target <= 30 s: {met(lt['first_update_seconds'] <= 30)}",
                 "", f"Prepare measured {results['date'][:10]} at {results['commit']}; training over the first "
                     f"{results['updates']} updates at {train_at}."]
    return "\n".join(rows) + "\n"


def scale_figure(results: dict):
    """Log-log: cost against corpus size (a pure function: returns a Figure, draws nothing global)."""
    from matplotlib.figure import Figure

    sizes = results["sizes"]
    pairs = [r["pairs"] for r in sizes]
    fig = Figure(figsize=(7.5, 4.5))
    ax = fig.add_subplot()
    series = [("prepare time (s)", [r["prepare"]["seconds"] for r in sizes], "o-"),
              ("disk of data/ (MB)", [r["prepare"]["disk_bytes"] / 1e6 for r in sizes], "s-"),
              ("time to first update (s)", [r["train"]["first_update_seconds"] for r in sizes], "^-"),
              ("training peak RSS (GB)", [r["train"]["peak_rss_gb"] for r in sizes], "D-"),
              ("prepare peak RSS, main (GB)", [r["prepare"]["peak_rss_gb"] for r in sizes], "v-")]
    for label, values, style in series:
        ax.plot(pairs, values, style, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("sentence pairs in the training corpus")
    ax.set_ylabel("cost (unit in the legend)")
    ax.set_title("attnkit prepare + training: cost against corpus size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def measure(args: argparse.Namespace) -> None:
    work = Path(args.work_dir)
    history = json.loads(RESULTS.read_text())["runs"] if RESULTS.exists() else []
    keep = (args.keep or args.train_only) and history
    results = history.pop() if keep else {"sizes": []}  # a run measured again replaces its earlier self
    if args.train_only:  # training again on the prepared data of the last full run
        for entry in results["sizes"]:
            if entry["pairs"] in args.sizes:
                entry["train"] = run_child(["_train", str(entry["pairs"]), "--work-dir", str(work),
                                            "--updates", str(args.updates)])
                entry.update(train_date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                             train_commit=commit())
                print(f"{entry['pairs']:>9,} pairs: train {entry['train']}", flush=True)
        results.update(updates=args.updates, train_note=args.note)
        write_runs(RESULTS, [*history, results])
        args.sizes = []
    for size in args.sizes:
        generate(work, size)
        prep = run_child(["_prepare", str(size), "--work-dir", str(work)])
        print(f"{size:>9,} pairs: prepare {prep['seconds']} s ({prep['pairs_per_s']:,} pairs/s), "
              f"peak RSS {prep['peak_rss_gb']} GB", flush=True)
        train = run_child(["_train", str(size), "--work-dir", str(work), "--updates", str(args.updates)])
        print(f"{'':>9}  train: first update {train['first_update_seconds']} s, {train['tgt_tok_per_s']} tok/s, "
              f"peak RSS {train['peak_rss_gb']} GB", flush=True)
        entry = {"pairs": size, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "commit": commit(), "prepare": prep, "train": train}
        results["sizes"] = sorted([r for r in results["sizes"] if r["pairs"] != size] + [entry],
                                  key=lambda r: r["pairs"])
        results.update(date=entry["date"], commit=entry["commit"], cpu=cpu_info(), cpus=os.cpu_count(),
                       config=str(CONFIG.relative_to(ROOT)), train_overrides=TRAIN_OVERRIDES,
                       updates=args.updates, note=args.note)
        write_runs(RESULTS, [*history, results])
    sys.path.insert(0, str(ROOT / "src"))
    from attnkit.viz.plot import save_figure

    save_figure(scale_figure(results), FIGURE)
    print(markdown_table([results]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["generate", "measure", "table", "_prepare", "_train"])
    p.add_argument("size", nargs="?", type=int, help="(children) the corpus size")
    p.add_argument("--work-dir", default="/tmp/attnkit-scale", help="where corpora and runs go (not the repo)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--updates", type=int, default=300, help="training updates measured per size (default 300)")
    p.add_argument("--keep", action="store_true", help="keep the JSON's other sizes (measure a few sizes again)")
    p.add_argument("--train-only", action="store_true",
                   help="measure the training again on the prepared data in --work-dir (prepare results kept)")
    p.add_argument("--note", default="", help="recorded in the JSON (e.g. what else ran on the machine)")
    args = p.parse_args()
    if not DATA.exists():
        sys.exit(f"{DATA} is missing: this benchmark needs ../shared/data/multi30k beside the repository")
    if args.command == "generate":
        for size in args.sizes:
            t = time.perf_counter()
            generate(Path(args.work_dir), size)
            print(f"{size:,} pairs in {time.perf_counter() - t:.0f} s", flush=True)
    elif args.command == "measure":
        measure(args)
    elif args.command == "table":
        print(markdown_table(json.loads(RESULTS.read_text())["runs"][-1:]), end="")
    elif args.command == "_prepare":
        print("RESULT " + json.dumps(prepare_child(Path(args.work_dir), args.size)), flush=True)
    else:
        print("RESULT " + json.dumps(train_child(Path(args.work_dir), args.size, args.updates)), flush=True)


if __name__ == "__main__":
    main()
