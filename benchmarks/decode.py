"""The decoding race: attnkit's own beam search against CTranslate2 on the same trained model.

    python benchmarks/decode.py --de-en runs/de-en --en-de runs/en-de      # the whole race (a few minutes)
    python benchmarks/decode.py --de-en runs/de-en                          # without the en->de cache rows

On test_2016_flickr (1,000 sentences), beam 4 (length penalty: the run's decode_lenpen), batches
of 32 sentences, at 1 and at 2 threads (``--threads 1 2``, the default), the de->en model is decoded by

* attnkit float32 and attnkit bf16 (``torch.autocast``), through ``attnkit.inference.translate.translate_texts``;
* CTranslate2 float32 and int8, through ``attnkit.export.ctranslate2.ExportedTranslator`` (the run exported by
  ``attnkit export`` beforehand, untimed);
* attnkit float32 without the key/value cache (``attnkit.search.Uncached``), and the same cached /
  uncached pair for the en->de model when ``--en-de`` is given.

Each contender runs at each thread count in its own subprocess, one after the other, so its peak
RSS (``wait4``) is its own; the race compares the best thread count of each (CTranslate2 at one thread
can beat itself at two on a host whose second core is busy or slow to share); a worker translates one
batch untimed first, then the whole test set timed (tokenization
included, for both engines). Target tokens are the SentencePiece pieces of the outputs. Two
untimed workers decode greedily in float32 with attnkit and with CTranslate2 for the agreement
rate. BLEU is sacreBLEU (cased, 13a) via ``attnkit.inference.scores``.

Appends the race to ``benchmarks/results/decode.json`` (every race kept); :func:`markdown_table` renders it.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from tables import append_run, cpu_info  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "multi30k"
RESULTS = ROOT / "benchmarks" / "results" / "decode.json"
TEST = "test_2016_flickr"

# contender -> (engine, precision, cache); "greedy-*" workers decode with beam 1, untimed
CONTENDERS = {
    "attnkit-fp32": ("attnkit", "fp32", True),
    "attnkit-bf16": ("attnkit", "bf16", True),
    "ct2-float32": ("ctranslate2", "float32", True),
    "ct2-int8": ("ctranslate2", "int8", True),
    "attnkit-fp32-uncached": ("attnkit", "fp32", False),
}
LABELS = {"attnkit-fp32": "attnkit float32", "attnkit-bf16": "attnkit bf16 (autocast)",
          "ct2-float32": "CTranslate2 float32", "ct2-int8": "CTranslate2 int8",
          "attnkit-fp32-uncached": "attnkit float32, no key/value cache"}


def read_test(direction: str) -> tuple[list[str], list[str]]:
    sys.path.insert(0, str(ROOT / "src"))
    from attnkit.data.readers import read_parallel

    src, tgt = direction.split("-")
    pairs = read_parallel(DATA / f"{TEST}.{src}.gz", DATA / f"{TEST}.{tgt}.gz")
    return [s for s, _ in pairs], [t for _, t in pairs]


def rss_mb() -> float:
    """Current resident set size of this process (MB), from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(args: argparse.Namespace) -> None:
    """Runs in the child: load one contender, translate one batch untimed, then the test set timed."""
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from attnkit.export.ctranslate2 import ExportedTranslator
    from attnkit.inference.translate import translate_texts
    from attnkit.search import Uncached
    from attnkit.tasks import load_run

    threads = args.threads[0]  # a worker runs at one thread count
    torch.set_num_threads(threads)
    engine, precision, cache = CONTENDERS[args.worker] if args.worker in CONTENDERS else ("attnkit", "fp32", True)
    if args.worker == "greedy-ct2":
        engine = "ctranslate2"
    beam = 1 if args.worker.startswith("greedy") else args.beam
    sources, _ = read_test(args.direction)
    sources = sources[: args.sentences]
    imported_mb = rss_mb()
    if engine == "ctranslate2":
        model = ExportedTranslator(args.model, threads=threads)
        lenpen = model.decode.lenpen

        def translate(texts: list[str]) -> list[list[str]]:
            return model.translate(texts, beam=beam, lenpen=lenpen, batch_size=args.batch_size)
    else:
        run = load_run(args.model)
        lenpen = run.cfg.decode_lenpen
        decoder = run.model if cache else Uncached(run.model)

        def translate(texts: list[str]) -> list[list[str]]:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                return translate_texts(decoder, run.tok, texts, beam=beam, lenpen=lenpen,
                                       batch_size=args.batch_size)
    translate(sources[: args.batch_size])  # warm-up: one batch, untimed
    start = time.perf_counter()
    hyps = [h[0] for h in translate(sources)]
    seconds = time.perf_counter() - start
    Path(args.hyps_out).write_text(json.dumps(hyps, ensure_ascii=False), encoding="utf-8")
    print("RESULT " + json.dumps({"seconds": seconds, "lenpen": lenpen, "rss_after_import_mb": round(imported_mb)}),
          flush=True)


def run_worker(name: str, direction: str, model: Path, args: argparse.Namespace, threads: int) -> dict:
    """Run one contender at ``threads`` in a subprocess; its result with hypotheses and peak RSS (GB, from
    ``wait4``)."""
    with tempfile.TemporaryDirectory(prefix="attnkit-decode-") as tmp:
        hyps_file = Path(tmp) / "hyps.json"
        cmd = [sys.executable, __file__, "--worker", name, "--direction", direction, "--model", str(model),
               "--hyps-out", str(hyps_file), "--beam", str(args.beam), "--batch-size", str(args.batch_size),
               "--threads", str(threads), "--sentences", str(args.sentences)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        out = proc.stdout.read() if proc.stdout else ""
        _, status, usage = os.wait4(proc.pid, 0)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if os.waitstatus_to_exitcode(status) != 0 or not lines:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{out[-3000:]}")
        result = json.loads(lines[-1].removeprefix("RESULT "))
        result["hyps"] = json.loads(hyps_file.read_text(encoding="utf-8"))
        result["peak_rss_gb"] = round(usage.ru_maxrss / 1024 ** 2, 2)  # ru_maxrss is in KB on Linux
        result["date"] = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
        result["load_average_1min"] = round(os.getloadavg()[0], 2)  # other sessions' jobs share the 2 cores
        result["threads"] = threads
        print(f"  {name} {direction}, {threads} thread(s): {result['seconds']:.1f} s, "
              f"peak RSS {result['peak_rss_gb']} GB, load average {result['load_average_1min']}", flush=True)
        return result


def score(result: dict, refs: list[str], tok) -> dict:
    """tokens/s, sentences/s and BLEU of one worker's result (its hypotheses dropped)."""
    from attnkit.inference.scores import translation_scores

    hyps, seconds = result.pop("hyps"), result["seconds"]
    tokens = sum(len(ids) for ids in tok.encode_tgt(hyps))
    return {**result, "seconds": round(seconds, 2), "target_tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1), "sentences_per_s": round(len(hyps) / seconds, 1),
            "bleu": round(translation_scores(hyps, refs[: len(hyps)]).bleu, 2)}


def race(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT / "src"))
    from attnkit.common.measure import stamp
    from attnkit.data.tokenizer import Tokenizer
    from attnkit.export.ctranslate2 import export_ctranslate2

    results: dict = {**stamp(), "cpu": cpu_info(),
                     "load_average_1min_at_start": round(os.getloadavg()[0], 2),
                     "test": TEST, "sentences": args.sentences, "beam": args.beam, "batch_size": args.batch_size,
                     "threads": args.threads, "command": " ".join(["python", "benchmarks/decode.py", *sys.argv[1:]]),
                     "by_threads": {}, "contenders": {}, "cache": {}}
    with tempfile.TemporaryDirectory(prefix="attnkit-export-") as tmp:
        exports = {q: export_ctranslate2(args.de_en, Path(tmp) / q, quantization=q) for q in ("float32", "int8")}
        _, refs = read_test("de-en")
        tok = Tokenizer.load(exports["float32"])
        raw: dict[int, dict] = {}
        for threads in args.threads:
            raw[threads] = {}
            for name, (engine, precision, _) in CONTENDERS.items():
                model = exports[precision] if engine == "ctranslate2" else args.de_en
                raw[threads][name] = run_worker(name, "de-en", model, args, threads)
        greedy = {name: run_worker(name, "de-en", model, args, args.threads[0])["hyps"]
                  for name, model in (("greedy-attnkit", args.de_en), ("greedy-ct2", exports["float32"]))}
    identical = all(r["attnkit-fp32"]["hyps"] == r["attnkit-fp32-uncached"]["hyps"] for r in raw.values())
    for threads, contenders in raw.items():
        results["by_threads"][str(threads)] = {name: score(result, refs, tok) for name, result in contenders.items()}
    # the race compares each contender at its own best thread count
    for name in CONTENDERS:
        results["contenders"][name] = max((by[name] for by in results["by_threads"].values()),
                                          key=lambda r: r["tokens_per_s"])
    agree = sum(a == b for a, b in zip(greedy["greedy-attnkit"], greedy["greedy-ct2"], strict=True))
    results["greedy_float32_agreement"] = round(agree / len(greedy["greedy-attnkit"]), 4)
    c = results["contenders"]
    results["int8_minus_float32_bleu"] = round(c["ct2-int8"]["bleu"] - c["ct2-float32"]["bleu"], 2)
    results["attnkit_over_ct2_int8_tokens"] = {
        name: round(c[name]["tokens_per_s"] / c["ct2-int8"]["tokens_per_s"], 3)
        for name in ("attnkit-fp32", "attnkit-bf16")}
    best_ct2 = max(c["ct2-int8"], c["ct2-float32"], key=lambda r: r["tokens_per_s"])
    results["attnkit_over_best_ct2_tokens"] = {
        name: round(c[name]["tokens_per_s"] / best_ct2["tokens_per_s"], 3) for name in ("attnkit-fp32", "attnkit-bf16")}
    # the cache comparison at attnkit float32's best thread count, against the uncached run at the same count
    fastest = c["attnkit-fp32"]["threads"]
    cached, uncached = (results["by_threads"][str(fastest)][n] for n in ("attnkit-fp32", "attnkit-fp32-uncached"))
    results["cache"]["de-en"] = {"identical": identical, "threads": fastest, "cached": cached, "uncached": uncached,
                                 "speedup": round(uncached["seconds"] / cached["seconds"], 2)}
    if args.en_de:
        _, refs_en_de = read_test("en-de")
        tok_en_de = Tokenizer.load(args.en_de)
        pair = {name: run_worker(name, "en-de", args.en_de, args, fastest)
                for name in ("attnkit-fp32", "attnkit-fp32-uncached")}
        same = pair["attnkit-fp32"]["hyps"] == pair["attnkit-fp32-uncached"]["hyps"]
        cached, uncached = (score(pair[n], refs_en_de, tok_en_de) for n in ("attnkit-fp32", "attnkit-fp32-uncached"))
        results["cache"]["en-de"] = {"identical": same, "threads": fastest, "cached": cached, "uncached": uncached,
                                     "speedup": round(uncached["seconds"] / cached["seconds"], 2)}
    return results


def _gb(x: float) -> str:
    return f"{x:.2f} GB"


def _threads(r: dict) -> str:
    """A race's thread counts as words: "2 threads", or "1 and 2 threads"."""
    counts = r["threads"] if isinstance(r["threads"], list) else [r["threads"]]
    return " and ".join(str(t) for t in counts) + (" thread" if counts == [1] else " threads")


def bf16_over_int8(run: dict) -> float:
    """attnkit bf16's tokens/s over CTranslate2 int8's, the headline."""
    return run["attnkit_over_ct2_int8_tokens"]["attnkit-bf16"]


def markdown_table(runs: list[dict]) -> str:
    """Each race, newest first: every contender at each thread count."""
    return "\n".join(_race_table(r) for r in sorted(runs, key=lambda r: r["date"], reverse=True))


def _race_table(results: dict) -> str:
    """One race: the contenders at each thread count (the best of each in bold), the ratios of the bests,
    the cache comparison. A race from before ``--threads 1 2`` has one thread count."""
    c = results["contenders"]
    by_threads = results.get("by_threads") or {str(results["threads"]): c}
    loads = [r["load_average_1min"] for by in by_threads.values() for r in by.values() if "load_average_1min" in r]
    shared = f"; 1-min load average {min(loads):.1f}-{max(loads):.1f} on the 2 cores while it ran" if loads else ""
    cpu = f" on {results['cpu']}" if results.get("cpu") else ""
    lines = [f"de->en `small`, {results['test']} ({results['sentences']:,} sentences), beam {results['beam']}, "
             f"batches of {results['batch_size']}, {_threads(results)}{cpu} "
             f"(measured {results['date'][:10]}, "
             f"commit {results['commit']}{shared})"
             + ("; in bold each contender's best thread count, which the ratios use:" if len(by_threads) > 1 else ":"),
             "",
             "| decoder | " + " | ".join(f"target tokens/s, {t} thread{'s' if t != '1' else ''}" for t in by_threads)
             + " | sentences/s (best) | BLEU | peak RSS |",
             "|---|" + "---:|" * (len(by_threads) + 3)]
    for name, label in LABELS.items():
        best = c[name]
        speeds = [f"**{by[name]['tokens_per_s']:,.0f}**" if len(by_threads) > 1 and by[name] == best
                  else f"{by[name]['tokens_per_s']:,.0f}" for by in by_threads.values()]
        lines.append(f"| {label} | {' | '.join(speeds)} | {best['sentences_per_s']:.1f} | {best['bleu']:.2f} | "
                     f"{_gb(best['peak_rss_gb'])} |")
    ratio = results["attnkit_over_ct2_int8_tokens"]
    lines += ["",
              f"attnkit's beam search reaches {ratio['attnkit-fp32']:.2f}x (float32) and {ratio['attnkit-bf16']:.2f}x "
              f"(bf16) of CTranslate2 int8's tokens/s (goal: 0.67x)"]
    if "attnkit_over_best_ct2_tokens" in results:
        best = results["attnkit_over_best_ct2_tokens"]
        lines[-1] += (f"; {best['attnkit-fp32']:.2f}x and {best['attnkit-bf16']:.2f}x of CTranslate2's faster "
                      f"precision")
    lines[-1] += (f". Greedy float32: CTranslate2's output equals attnkit's for "
                  f"{100 * results['greedy_float32_agreement']:.1f}% of the sentences; int8 BLEU minus "
                  f"float32 BLEU: {results['int8_minus_float32_bleu']:+.2f}.")
    cache = results["cache"]
    parts = []
    for direction in ("de-en", "en-de"):
        if direction in cache:
            k = cache[direction]
            at = f" at {k['threads']} thread(s)" if "threads" in k else ""
            parts.append(f"{direction.replace('-', '->')}{at} {k['cached']['sentences_per_s']:.1f} vs "
                         f"{k['uncached']['sentences_per_s']:.1f} sentences/s = **{k['speedup']:.2f}x**"
                         f" ({'identical output' if k['identical'] else 'outputs differ'})")
    lines += ["", "Key/value cache, attnkit float32, same run: " + "; ".join(parts) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--de-en", type=Path, help="the trained de->en Transformer run directory")
    p.add_argument("--en-de", type=Path, help="the trained en->de run (for the cache comparison in both directions)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                   help="thread counts to run every contender at; the race compares each one's best (default: 1 2)")
    p.add_argument("--sentences", type=int, default=1000, help="first N test sentences (default: all 1,000)")
    p.add_argument("--table", action="store_true", help="print the README table of the committed JSON and exit")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--direction", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--hyps-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.table:
        print(markdown_table(json.loads(RESULTS.read_text(encoding="utf-8"))["runs"][-1:]), end="")
        return
    if not DATA.exists():
        sys.exit(f"{DATA} is missing: this benchmark needs ../shared/data/multi30k beside the repository")
    if args.de_en is None:
        sys.exit("give the trained de->en run: --de-en RUN_DIR")
    results = race(args)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    append_run(RESULTS, results)
    print(markdown_table([results]))
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
