"""IMDB sentiment (the seeds' data set) and MLM pretraining: held-out accuracy, minutes, updates.

    python benchmarks/imdb.py configs/seed-imdb.yaml                 # train, then score the held-out reviews
    python benchmarks/imdb.py configs/imdb-pretrain.yaml configs/imdb-finetune.yaml
    python benchmarks/imdb.py configs/seed-imdb.yaml --record-only   # score a run trained before (runs/<name>)
    python benchmarks/imdb.py configs/imdb.yaml --trial "what differs"  # also append it to imdb-trials.json

Each config trains into ``runs/<config name>`` (the path ``model.init_from`` of a fine-tuning
config points at) with the threads its config gives (recorded with the result): these are accuracy
runs on a shared machine, not speed measurements. A classifier is then scored with its best checkpoint
on the validation rows its config holds out of the training file (10% of the IMDB reviews, by
movie; the IMDB test set is scored independently by others), and its predictions go to
``benchmarks/results/<name>.valid-pred.txt``; a pretraining run records its best validation MLM
accuracy. Results are merged into ``benchmarks/results/imdb.json`` (one entry per config, with
date and commit); ``markdown_table`` renders them for the README.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from attnkit.common.measure import stamp  # noqa: E402
from attnkit.config.loader import load_config  # noqa: E402
from attnkit.config.schema import RunConfig  # noqa: E402
from attnkit.inference.classify import evaluate_classifier  # noqa: E402
from attnkit.tasks import load_run  # noqa: E402
from attnkit.tasks.classification import read_validation  # noqa: E402
from tables import markdown, num  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
#: What each config is for and the issue's target on the held-out test set (accuracy %, minutes).
TARGETS: dict[str, tuple[str, float | None, float]] = {
    "seed-imdb": ("the seeds' model (1 layer, d_model 32), from scratch", 85.0, 5),
    "imdb": ("the best from scratch", 89.0, 20),
    "imdb-pretrain": ("MLM on the IMDB text: training reviews and the 50k unlabelled ones", None, 60),
    "imdb-finetune": ("fine-tuned from imdb-pretrain", 91.5, 60),
    "imdb-lm": ("a causal language model of the IMDB text: training reviews and the 50k unlabelled ones", None, 60),
    "imdb-lm-finetune": ("fine-tuned from imdb-lm as a decoder-only classifier", 91.5, 60),
    "imdb-lm-ngrams": ("imdb-lm-finetune with an n-gram expert beside its head (model.ngram_buckets)", 91.5, 60),
    "sst2-pretrain": ("MLM on IMDB + SST-2 training text", None, 0),
    "sst2-finetune": ("fine-tuned from sst2-pretrain, on SST-2", 85.0, 15),
    "sst2-lm-finetune": ("fine-tuned from imdb-lm as a decoder-only classifier, on SST-2", 85.0, 15),
    "sst2-lm": ("imdb-lm fine-tuned as a language model on SST-2's sentences (ULMFiT's second stage)", None, 5),
    "sst2-ulmfit": ("fine-tuned from sst2-lm as a decoder-only classifier, on SST-2 (ULMFiT's third stage)", 85.0, 15),
}
#: Configs that start from a model pretrained outside attnkit on other text (imported with ``attnkit import``):
#: scored on the same held-out reviews, but kept out of :data:`TARGETS`' IMDB-only tables (:func:`markdown_outside`).
OUTSIDE: dict[str, str] = {
    "imdb-minilm": "sentence-transformers/all-MiniLM-L6-v2 (6 x 384, pretrained on outside text), fine-tuned",
}
#: experiments, not supported recipes (``experiments/configs/``): described, in no table but the trials
EXPERIMENTS: dict[str, str] = {
    "imdb-electra-pretrain": "replaced-token detection on IMDB + the 50k unlabelled reviews",
    "imdb-electra-finetune": "fine-tuned from imdb-electra-pretrain",
}


def describe(name: str) -> str:
    """What the config ``name`` is for, from :data:`TARGETS`, :data:`OUTSIDE` or :data:`EXPERIMENTS`."""
    return TARGETS[name][0] if name in TARGETS else OUTSIDE.get(name, EXPERIMENTS.get(name, ""))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]


def measure(config: str, record_only: bool, overrides: list[str]) -> dict:
    """Train ``config`` (unless ``record_only``) into ``runs/<name>`` and score it."""
    from attnkit.training.trainer import Trainer

    name = Path(config).stem
    run_dir = ROOT / "runs" / name
    minutes_total = cpu_minutes_total = None
    if not record_only:
        cfg = load_config(RunConfig, config, overrides)
        if run_dir.exists():
            shutil.rmtree(run_dir)
        start, cpu_start = time.perf_counter(), time.process_time()
        Trainer(cfg, run_dir).run()
        minutes_total = round((time.perf_counter() - start) / 60, 2)  # tokenizer + data + training + validations
        cpu_minutes_total = round((time.process_time() - cpu_start) / 60, 2)  # the CPU it had of them, on a shared host
    cfg = load_config(RunConfig, run_dir / "config.yaml")
    metrics = read_metrics(run_dir)
    path = Path(config).resolve()
    shown = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(config)  # experiments/configs/...
    result = {"config": shown, "what": describe(name),
              "task": cfg.task, "train_minutes": metrics[-1]["minutes"], "minutes_total": minutes_total,
              "updates": metrics[-1]["step"], "threads": cfg.train.threads, "seed": cfg.train.seed,
              "max_minutes": cfg.train.max_minutes, "run_dir": f"runs/{name}", **stamp()}
    if cpu_minutes_total is not None:
        result["cpu_minutes_total"] = cpu_minutes_total
    if cfg.model.init_from:
        result["init_from"] = cfg.model.init_from
        source = ROOT / cfg.model.init_from
        if (source / "metrics.jsonl").exists():  # the pretraining run it started from, as it was then
            last = read_metrics(source)[-1]
            result["pretraining"] = {"train_minutes": last["minutes"], "updates": last["step"]}
    if cfg.task == "pretrain":
        best = max(metrics, key=lambda m: m["score"])
        result.update(valid_mlm_accuracy=best["valid_mlm_acc"], valid_mlm_loss=best["valid_loss"],
                      best_step=best["step"])
        if "valid_rtd_acc" in best:  # ELECTRA: the discriminator's score; the MLM figures are its generator's
            result.update(valid_rtd_accuracy=best["valid_rtd_acc"], valid_rtd_loss=best["valid_rtd_loss"])
        return result
    if cfg.task == "lm":
        best = max(metrics, key=lambda m: m["score"])
        result.update(valid_loss=best["valid_loss"], valid_ppl=best["valid_ppl"], best_step=best["step"])
        return result
    valid = read_validation(cfg, log=lambda msg: None)
    run = load_run(run_dir / "best.safetensors")
    scores, predictions = evaluate_classifier(run, valid)
    pred_path = RESULTS / f"{name}.valid-pred.txt"
    pred_path.write_text("".join(p + "\n" for p in predictions), encoding="utf-8")
    result.update(valid_accuracy=round(scores.accuracy, 2), valid_macro_f1=round(scores.macro_f1, 2),
                  confusion=scores.confusion, classes=scores.classes, valid_rows=len(valid),
                  best_step=max(metrics, key=lambda m: m["score"])["step"],
                  parameters=sum(p.numel() for p in run.model.parameters()),
                  predictions=str(pred_path.relative_to(ROOT)))
    if cfg.model.ngram_buckets:
        result.update(expert_accuracies(run, valid))
    return result


def expert_accuracies(run, valid) -> dict:
    """A classifier with an n-gram expert (``model.ngram_buckets``): the held-out accuracy of its head alone and of
    the n-gram expert alone, each reading the reviews as the pair does."""
    model, expert = run.model, run.model.ngrams
    try:
        model.ngrams = None  # the head alone
        head = evaluate_classifier(run, valid)[0].accuracy
        model.experts = lambda tokens: [expert(tokens)]  # the n-gram expert alone, without running the Transformer
        ngrams = evaluate_classifier(run, valid)[0].accuracy
    finally:
        model.ngrams = expert
        vars(model).pop("experts", None)  # the class's method again
    return {"head_alone_accuracy": round(head, 2), "ngram_expert_alone_accuracy": round(ngrams, 2)}


def held_out_text(r: dict) -> str:
    """A result's held-out score: replaced-token detection accuracy (ELECTRA) or masked-subword accuracy for a
    pretraining run, perplexity for a language model, else classification accuracy."""
    if r["task"] == "lm":
        return f"perplexity {r['valid_ppl']:.1f}"
    if r["task"] != "pretrain":
        return f"{r['valid_accuracy']:.2f}"
    return f"RTD {r['valid_rtd_accuracy']:.1f}" if "valid_rtd_accuracy" in r else f"MLM {r['valid_mlm_accuracy']:.1f}"


def markdown_table(results: dict) -> str:
    """The README table: one row per config, in the order of :data:`TARGETS`."""
    rows = []
    entries = results["results"]
    for name, (what, target, _) in TARGETS.items():
        r = entries.get(f"configs/{name}.yaml")
        if r is None:
            continue
        rows.append([f"`{r['config']}`", what, held_out_text(r), "" if target is None else f"{target:.1f}",
                     f"{r['train_minutes']:.1f}", num(r["updates"]), r["threads"],
                     f"{r['date'][:10]}, `{r['commit']}`"])
    return markdown(["config", "what", "held-out accuracy", "target (test)", "train minutes", "updates", "threads",
                     "measured"], rows, "llrrrrrl")


def markdown_outside(results: dict) -> str:
    """docs/sentiment.md and results.md: the :data:`OUTSIDE` configs, apart from the IMDB-only table."""
    rows = []
    for name, what in OUTSIDE.items():
        r = results["results"].get(f"configs/{name}.yaml")
        if r is not None:
            cpu = r.get("cpu_minutes_total")
            rows.append([f"`{r['config']}`", what, f"`{r.get('init_from', '')}`", held_out_text(r), num(r["updates"]),
                         f"{r['train_minutes']:.1f}", "" if cpu is None else f"{cpu:.1f}", r["threads"],
                         f"{r['date'][:10]}, `{r['commit']}`"])
    return markdown(["config", "model", "init_from", "held-out accuracy", "updates", "train minutes",
                     "CPU minutes (all)", "threads", "measured"], rows, "lllrrrrrl")


def config_init_from(config: str) -> str | None:
    """The ``model.init_from`` a committed config names (None for a missing file or key)."""
    import yaml

    path = ROOT / config
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else None
    return ((raw or {}).get("model") or {}).get("init_from")


def markdown_brief(results: dict) -> str:
    """The README's table: the IMDB classifiers of :func:`markdown_table`, without its descriptions (docs/results.md
    has them); a fine-tuned one's minutes and updates are those of the pretraining run it started from + its own."""
    rows = []
    for name, (_, target, _) in TARGETS.items():
        r = results["results"].get(f"configs/{name}.yaml")
        if r is None or target is None or not name.startswith(("imdb", "seed-imdb")):
            continue
        minutes, updates = f"{r['train_minutes']:.1f}", num(r["updates"])
        init_from = r.get("init_from") or config_init_from(r["config"])  # older results did not record it
        # the pretraining run it started from; older results did not record it: then the reported one
        source = r.get("pretraining") or results["results"].get(f"configs/{Path(init_from or '').name}.yaml")
        if source is not None:
            minutes = f"{source['train_minutes']:.1f} + {minutes}"
            updates = f"{num(source['updates'])} + {updates}"
        rows.append([f"`{r['config']}`", held_out_text(r), f"{target:.1f}", minutes, updates, r["threads"] or "",
                     f"{r['date'][:10]}, `{r['commit']}`"])
    return markdown(["config", "held-out", "target (test)", "minutes", "updates", "threads", "measured"], rows,
                    "lrrrrrl")


def markdown_trials(trials: dict) -> str:
    """Every run of every config in ``imdb-trials.json`` (``--trials``), the reported one marked, with its settings.

    The reported run of a config is its last one, unless that says ``"reported": false`` (a run stopped early)."""
    rows = []
    for config, runs in trials["runs"].items():
        reported = max((i for i, r in enumerate(runs) if r.get("reported", True)), default=None)
        for i, r in enumerate(runs):
            rows.append([f"`{config}`", held_out_text(r) + (" (reported)" if i == reported else ""),
                         f"{r['train_minutes']:.1f}", num(r["updates"]), r["threads"], r.get("settings", ""),
                         f"{r['date'][:10]}, `{r['commit']}`"])
    return markdown(["config", "held-out accuracy", "train minutes", "updates", "threads", "settings", "measured"],
                    rows, "lrrrrll")


#: The runs of the committed recipe that measure its spread over seeds: their settings begin so.
VARIANCE_RUNS = "the committed recipe at 1 thread"


def seed_table(trials: dict, pretrain: str, finetune: str, keep: Callable[[dict], bool],
               experts: bool = False) -> str:
    """Every kept run of ``finetune`` in ``imdb-trials.json`` with its seed and the updates of its pretraining run
    (the ``pretrain`` run with the same settings, else the one its ``pretraining`` record names, else the reported
    one), then mean and spread;
    ``experts``: also each expert's accuracy alone (a classifier with ``model.ngram_buckets``). Runs recorded with
    their budgets (``max_minutes`` of both stages) get one table per pair of budgets, with the minutes in all."""
    runs = trials["runs"]
    sources = runs.get(f"configs/{pretrain}.yaml", [])
    by_settings = {r["settings"]: r for r in sources}
    reported = [r for r in sources if r.get("reported", True)]
    groups: dict[tuple, tuple[list, list]] = {}
    for r in runs.get(f"configs/{finetune}.yaml", []):
        if not keep(r):
            continue
        pre = r.get("pretraining")  # the run it started from, where recorded: found by its updates and minutes
        same = [s for s in sources if pre and (s["updates"], s["train_minutes"]) == (pre["updates"],
                                                                                   pre["train_minutes"])]
        p = (by_settings.get(r["settings"]) or (same[-1] if same else None)
             or (reported[-1] if reported and r.get("seed", 1) == 1 else None))
        budgets = (p.get("max_minutes") if p else None, r.get("max_minutes"))
        rows, accuracies = groups.setdefault(budgets, ([], []))
        accuracies.append(r["valid_accuracy"])
        alone = ([f"{r['head_alone_accuracy']:.2f}", f"{r['ngram_expert_alone_accuracy']:.2f}"]
                 if experts else [])
        in_all = (f"{p['minutes_total'] + r['minutes_total']:.1f}"
                  if p and p.get("minutes_total") and r.get("minutes_total") else "")
        rows.append([r.get("seed", 1), f"{r['valid_accuracy']:.2f}", *alone, "" if p is None else num(p["updates"]),
                     num(r["updates"]), in_all, r["threads"], f"{r['date'][:10]}, `{r['commit']}`"])
    if not groups:
        return "(no runs yet)"
    out = []
    for budgets, (rows, accuracies) in groups.items():
        mean = statistics.mean(accuracies)
        sd = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        table = markdown(["seed", "held-out accuracy", *(["head alone", "n-gram expert alone"] if experts else []),
                          "pretraining updates", "fine-tuning updates", "minutes in all", "threads", "measured"], rows,
                         "rr" + ("rr" if experts else "") + "rrrrl")
        head = (f"Budgets {budgets[0]:g} + {budgets[1]:g} minutes:\n\n" if None not in budgets and len(groups) > 1
                else "")
        out.append(f"{head}{table}\n\n{len(accuracies)} seeds: mean **{mean:.2f}**, sample standard deviation "
                   f"{sd:.2f}, range {min(accuracies):.2f} to {max(accuracies):.2f}.")
    return "\n\n".join(out)


def markdown_variance(trials: dict) -> str:
    """docs/sentiment.md: the MLM recipe over seeds (item 3 of issue 38): the pairs whose settings begin with
    :data:`VARIANCE_RUNS`, each at 1 thread on its own core."""
    return seed_table(trials, "imdb-pretrain", "imdb-finetune",
                      lambda r: r.get("settings", "").startswith(VARIANCE_RUNS))


def markdown_ngram_seeds(trials: dict) -> str:
    """docs/sentiment.md: the language-model route with an n-gram expert over seeds, each expert alone too (the
    committed budgets only: a run with another ``train.max_minutes`` is in the table of every run)."""
    return seed_table(trials, "imdb-lm", "imdb-lm-ngrams", lambda r: "max_minutes=" not in r.get("settings", ""),
                      experts=True)


def append_trial(result: dict, settings: str, reported: bool = True) -> None:
    """Append ``result`` with its ``settings`` to ``results/imdb-trials.json`` (every run of each config)."""
    path = RESULTS / "imdb-trials.json"
    trials = json.loads(path.read_text()) if path.exists() else {"note": "every run of a config, the one in "
                                                                          "imdb.json last", "runs": {}}
    entry = {**result, "settings": settings, **({} if reported else {"reported": False})}
    trials["runs"].setdefault(result["config"], []).append(entry)
    trials.update(date=result["date"], commit=result["commit"])
    path.write_text(json.dumps(trials, indent=2) + "\n", encoding="utf-8")


def record_probe(run_dir: Path, settings: str, out: Path, commit: str | None) -> dict:
    """Append a short pretraining probe (any run directory, e.g. one trained with overrides) to ``out``:
    its settings, threads and every validation of its ``metrics.jsonl``; dated when that file was last
    written, at ``commit`` (the checkout it ran from; default: this one)."""
    cfg = load_config(RunConfig, run_dir / "config.yaml")
    t, tr = cfg.model.transformer, cfg.train
    probe = {"run_dir": str(run_dir), "settings": settings, "lr": tr.lr, "warmup": tr.warmup,
             "dropout": t.dropout, "norm_first": t.norm_first, "window": cfg.data.max_len,
             "vocab_size": cfg.data.tokenizer.vocab_size, "threads": tr.threads, "max_minutes": tr.max_minutes,
             "curve": read_metrics(run_dir), **stamp()}
    probe["date"] = datetime.fromtimestamp((run_dir / "metrics.jsonl").stat().st_mtime, timezone.utc).isoformat(
        timespec="seconds")
    if commit:
        probe["commit"] = commit
        probe.pop("uncommitted_changes", None)
    probes = json.loads(out.read_text()) if out.exists() else {"note": PROBES_NOTE, "probes": []}
    probes["probes"].append(probe)
    probes.update(date=probe["date"], commit=probe["commit"])
    out.write_text(json.dumps(probes, indent=2) + "\n", encoding="utf-8")
    return probe


PROBES_NOTE = ("short MLM pretraining runs of configs/imdb-pretrain.yaml with overrides, to choose its learning "
               "rate and dropout; compared at the same update, since their budgets and thread counts differ")


def markdown_probes(results: dict) -> str:
    """benchmarks/README.md: each probe's settings and its validation MLM loss / accuracy at every common step."""
    probes = results["probes"]
    steps = sorted(set.intersection(*({m["step"] for m in p["curve"]} for p in probes)))
    rows = [[p["settings"], f"{p['lr']:g}", f"{p['dropout']:g}", "pre" if p["norm_first"] else "post", p["window"],
             p["threads"], *(f"{m['valid_loss']:.2f} / {m['valid_mlm_acc']:.1f}%" for s in steps
                             for m in p["curve"] if m["step"] == s),
             f"{p['curve'][-1]['valid_loss']:.2f} / {p['curve'][-1]['valid_mlm_acc']:.1f}% "
             f"({num(p['curve'][-1]['step'])} updates, {p['curve'][-1]['minutes']:.1f} min)",
             f"{p['date'][:10]}, `{p['commit']}`"] for p in probes]
    return markdown(["probe", "lr", "dropout", "norm", "window", "threads", *(f"step {num(s)}" for s in steps),
                     "last validation", "measured"], rows, "lrrrrr" + "r" * len(steps) + "rl")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="*", help="config files, and KEY=VALUE overrides for all of them")
    p.add_argument("--trials", action="store_true",
                   help="print every recorded run of each config (results/imdb-trials.json), with its settings")
    p.add_argument("--record-only", action="store_true", help="score runs/<name> as it is, without training")
    p.add_argument("--out", default=str(RESULTS / "imdb.json"))
    p.add_argument("--record-probe", metavar="RUN_DIR", help="append the pretraining run RUN_DIR (trained by hand, "
                   "e.g. with overrides) to results/mlm-probes.json; the positional argument describes it")
    p.add_argument("--probe-commit", help="the commit RUN_DIR was trained at (default: this checkout's)")
    p.add_argument("--trial", metavar="SETTINGS", help="also append each result to results/imdb-trials.json with "
                   "SETTINGS (what this run did differently, and what ran beside it)")
    p.add_argument("--not-reported", action="store_true",
                   help="with --trial: a run that does not stand for its config (stopped early); imdb.json "
                        "is left as it was")
    args = p.parse_args()
    if args.trials:
        print(markdown_trials(json.loads((RESULTS / "imdb-trials.json").read_text(encoding="utf-8"))))
        return
    if not args.configs:
        p.error("give a config to train (or --trials)")
    if args.record_probe:
        print(json.dumps(record_probe(Path(args.record_probe), " ".join(args.configs), RESULTS / "mlm-probes.json",
                                      args.probe_commit),
                         indent=2))
        return
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {"results": {}}
    overrides = [c for c in args.configs if "=" in c]
    for config in [c for c in args.configs if "=" not in c]:
        r = measure(config, args.record_only, overrides)
        if out.exists():  # read again: another run may have written it while this one trained
            results = json.loads(out.read_text())
        if args.trial:
            append_trial(r, args.trial, reported=not args.not_reported)
            if args.not_reported:
                continue
        results["results"][r["config"]] = r
        results.update(date=r["date"], commit=r["commit"])  # the latest measurement in the file
        results["note"] = ("accuracy runs, not speed measurements: each entry records its threads, and the one-thread "
                           "runs shared the 2-core machine with other sessions. Held-out = 10% of the training reviews "
                           "(by movie) the config validates on.")
        out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(json.dumps(r, indent=2), flush=True)
    print(markdown_table(results))


if __name__ == "__main__":
    main()
