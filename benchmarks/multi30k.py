"""Multi30k: train, decode test_2016_flickr with beam search, score with sacreBLEU — one command.

    python benchmarks/multi30k.py                                   # de->en Transformer (configs/multi30k-de-en.yaml)
    python benchmarks/multi30k.py --config configs/multi30k-en-de.yaml
    python benchmarks/multi30k.py --config configs/multi30k-de-en-rnn-bahdanau.yaml
    python benchmarks/multi30k.py --config configs/multi30k-de-en-rnn-noattn.yaml
    python benchmarks/multi30k.py --skip-train --run-dir runs/multi30k-de-en   # re-decode a trained run

Appends the run to ``benchmarks/results/<name>.json`` (BLEU cased/lowercased, chrF, signature, training
minutes, validation BLEU against training minutes, decoding speed with and without the
key/value cache; every run kept) and writes ``benchmarks/results/<name>.test-hyp.txt`` (the latest run's
detokenized hypotheses).
Reads ``../shared/data/multi30k``; trains for the config's ``train.max_minutes`` (60).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from attnkit.common.measure import stamp  # noqa: E402
from attnkit.config.loader import load_config  # noqa: E402
from attnkit.config.schema import RunConfig  # noqa: E402
from attnkit.data.readers import read_parallel  # noqa: E402
from attnkit.inference.scores import translation_scores  # noqa: E402
from attnkit.inference.translate import translate_texts  # noqa: E402
from attnkit.search import LENPEN, Uncached  # noqa: E402
from attnkit.tasks import load_run  # noqa: E402
from attnkit.training.trainer import Trainer  # noqa: E402
from attnkit.transformer import Transformer  # noqa: E402
from tables import append_run, cpu_info, markdown, measured, num  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "multi30k"


def timed_translate(model, tok, sources, beam, lenpen) -> tuple[list[str], float]:
    start = time.perf_counter()
    hyps = [h[0] for h in translate_texts(model, tok, sources, beam=beam, lenpen=lenpen)]
    return hyps, time.perf_counter() - start


#: What each configuration is expected to reach (the README's target column).
TARGETS = {"multi30k-de-en": ">= 40 in <= 60 min", "multi30k-en-de": ">= 38 in <= 60 min",
           "multi30k-de-en-rnn-bahdanau": ">= 30", "multi30k-de-en-rnn-noattn": "report it (the tutorial: 13.8)"}


def config(run: dict) -> list[tuple[str, dict]]:
    """The race of each configuration: the run under its config's name."""
    return [(f"`{run['config']}`", run)]


def bleu(run: dict) -> float:
    return run["bleu"]


def cached(run: dict) -> list[tuple[str, dict]]:
    """The race of each configuration's decoding with and without the cache, in the runs that timed both."""
    return config(run) if "cache_speedup" in run["decoding"] else []


def cache_speedup(run: dict) -> float:
    return run["decoding"]["cache_speedup"]


def _runs(runs: list[dict]) -> list[tuple[str, dict]]:
    """``(label, result)`` per run, by configuration as in :data:`TARGETS`, then newest first."""
    order = list(TARGETS)
    runs = sorted(runs, key=lambda r: r["date"], reverse=True)
    runs.sort(key=lambda r: (order.index(r["name"]) if r["name"] in order else len(order), r["name"]))
    return [(f"`{r['config']}` ({r['direction']}, {r['machine']['threads']} "
             f"thread{'s' if r['machine']['threads'] > 1 else ''})", r) for r in runs]


def markdown_table(runs: list[dict]) -> str:
    """Test BLEU of each run, by configuration."""
    rows = [[label, f"**{r['bleu']:.2f}**", f"{r['bleu_lowercase']:.2f}", f"{r['chrf']:.2f}",
             f"{r['train_minutes']:.1f}", num(r["updates"]), measured(r), TARGETS.get(r["name"], "")]
            for label, r in _runs(runs)]
    return markdown(["run", "BLEU", "lowercased", "chrF", "training min", "updates", "measured", "target"], rows,
                    "lrrrrrll")


def markdown_decoding(runs: list[dict]) -> str:
    """Decoding speed of test_2016_flickr with and without the key/value cache, where it was measured."""
    rows = []
    for label, r in _runs(runs):
        d = r["decoding"]
        if "cache_speedup" in d:
            rows.append([label, f"{d['beam']}", f"{d['cached_sent_per_s']:.1f}", f"{d['uncached_sent_per_s']:.1f}",
                         f"**{d['cache_speedup']:.2f}x**", "yes" if d["uncached_identical"] else "**no**",
                         measured(r), ">= 3x"])
    return markdown(["run", "beam", "sentences/s, cache", "without", "speed-up", "same output", "measured",
                     "target"], rows, "lrrrrlll")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "multi30k-de-en.yaml"))
    p.add_argument("--run-dir", help="default: runs/<config name>")
    p.add_argument("--name", help="result name (default: the config name)")
    p.add_argument("--skip-train", action="store_true", help="decode and score an already trained run")
    p.add_argument("--resume", action="store_true", help="continue an interrupted training run")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--lenpen", type=float, default=LENPEN)
    p.add_argument("--no-cache-compare", action="store_true", help="skip decoding without the cache")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. train.max_minutes=30")
    args = p.parse_args()
    if not DATA.exists():
        sys.exit(f"{DATA} is missing: this benchmark needs ../shared/data/multi30k beside the repository")

    name = args.name or Path(args.config).stem
    run_dir = Path(args.run_dir or ROOT / "runs" / name)
    resumed = args.resume and (run_dir / "config.yaml").exists()  # a resumed run keeps its own config
    cfg = load_config(RunConfig, run_dir / "config.yaml" if resumed else args.config, args.overrides)
    src_lang, tgt_lang = Path(cfg.data.train).name.split(".")[1], Path(cfg.data.train_tgt or "").name.split(".")[1]
    if not args.skip_train:
        Trainer(cfg, run_dir, resume=args.resume).run()

    run = load_run(run_dir)
    pairs = read_parallel(DATA / f"test_2016_flickr.{src_lang}.gz", DATA / f"test_2016_flickr.{tgt_lang}.gz")
    sources, refs = [s for s, _ in pairs], [t for _, t in pairs]
    hyps, seconds = timed_translate(run.model, run.tok, sources, args.beam, args.lenpen)
    scores = translation_scores(hyps, refs)
    greedy, greedy_seconds = timed_translate(run.model, run.tok, sources, 1, 0.0)
    decoding = {"beam": args.beam, "lenpen": args.lenpen, "sentences": len(sources),
                "cached_seconds": round(seconds, 1), "cached_sent_per_s": round(len(sources) / seconds, 1),
                "greedy_bleu": round(translation_scores(greedy, refs).bleu, 2),
                "greedy_sent_per_s": round(len(sources) / greedy_seconds, 1)}
    if isinstance(run.model, Transformer) and not args.no_cache_compare:
        uncached_hyps, uncached_seconds = timed_translate(Uncached(run.model), run.tok, sources, args.beam, args.lenpen)
        decoding.update(uncached_seconds=round(uncached_seconds, 1),
                        uncached_sent_per_s=round(len(sources) / uncached_seconds, 1),
                        cache_speedup=round(uncached_seconds / seconds, 2),
                        uncached_identical=uncached_hyps == hyps)

    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    metrics = [json.loads(line) for line in lines if line.strip()]
    result = {
        **stamp(), "name": name, "config": str(Path(args.config).relative_to(ROOT) if Path(args.config).is_absolute()
                                    else args.config),
        "direction": f"{src_lang}->{tgt_lang}", "test": "test_2016_flickr", "weights": run.weights_path.name,
        "bleu": round(scores.bleu, 2), "bleu_lowercase": round(scores.bleu_lowercase, 2), "chrf": round(scores.chrf, 2),
        "signature": scores.signature,
        "train_minutes": metrics[-1].get("minutes") if metrics else None,
        "updates": metrics[-1]["step"] if metrics else None,
        "valid_curve": [{k: m[k] for k in ("step", "minutes", "valid_bleu", "valid_loss") if k in m} for m in metrics],
        "decoding": decoding,
        "machine": {"torch": torch.__version__, "threads": torch.get_num_threads()}, "cpu": cpu_info(),
        "command": " ".join(["python", "benchmarks/multi30k.py", *sys.argv[1:]]),
    }
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    append_run(out / f"{name}.json", result)
    (out / f"{name}.test-hyp.txt").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    print(f"\n{name} ({src_lang}->{tgt_lang}) test_2016_flickr, beam {args.beam}:\n{scores}")
    print(f"validation BLEU (greedy, first {cfg.train.valid_bleu_sentences} dev sentences) against training minutes:")
    for m in result["valid_curve"]:
        print(f"  {m.get('minutes', 0):6.1f} min  step {m['step']:6d}  BLEU {m.get('valid_bleu', float('nan')):.2f}")
    print("decoding:", json.dumps(decoding))


if __name__ == "__main__":
    main()
