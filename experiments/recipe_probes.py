"""IMDB pretraining recipes judged by a fixed short fine-tune, not by their own held-out score (issue 25, item 5).

    flock /tmp/attnkit-bench.lock python experiments/recipe_probes.py "MLM, the committed recipe" \\
        configs/imdb-pretrain.yaml --pretrain-minutes 10 --finetune-minutes 5
    flock /tmp/attnkit-bench.lock python experiments/recipe_probes.py "ELECTRA at lr 2e-3" \\
        configs/imdb-electra-pretrain.yaml train.lr=2e-3 --pretrain-minutes 10 --finetune-minutes 5

Masked accuracy and replaced-token accuracy measure different things and move with the masking rate,
so recipes are compared where they are used: each pretraining config (with its ``KEY=VALUE``
overrides) trains for ``--pretrain-minutes`` into ``runs/probe-pretrain``, then ``--finetune``
(default ``configs/imdb-finetune.yaml``, unchanged but for ``model.init_from``,
``train.max_minutes`` and any ``--finetune-set KEY=VALUE``) trains from it for ``--finetune-minutes``
into ``runs/probe-finetune``, and its best checkpoint is scored on the held-out reviews read whole.
Each probe is appended to ``benchmarks/results/recipe-probes.json``; :func:`markdown_table` renders every probe.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # nbsvm, tables: the benchmarks' helpers
sys.path.insert(0, str(ROOT / "src"))

from attnkit.common.measure import stamp  # noqa: E402
from attnkit.config.loader import load_config  # noqa: E402
from attnkit.config.schema import RunConfig  # noqa: E402
from attnkit.inference.classify import evaluate_classifier  # noqa: E402
from attnkit.tasks import load_run  # noqa: E402
from attnkit.tasks.classification import read_validation  # noqa: E402
from nbsvm import cpu_model  # noqa: E402
from tables import markdown  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "recipe-probes.json"


def train(config: str, overrides: list[str], run_dir: Path) -> tuple[dict, float]:
    """Train ``config`` with ``overrides`` into a fresh ``run_dir``; (its last metrics line, minutes in all)."""
    from attnkit.training.trainer import Trainer

    if run_dir.exists():
        shutil.rmtree(run_dir)
    start = time.perf_counter()
    Trainer(load_config(RunConfig, config, overrides), run_dir).run()
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines], (time.perf_counter() - start) / 60


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="what this probe tries, for the table")
    p.add_argument("pretrain", help="the pretraining config")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of the pretraining config")
    p.add_argument("--finetune", default="configs/imdb-finetune.yaml", help="the fine-tuning config")
    p.add_argument("--finetune-set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override of the fine-tuning config (repeatable): a larger encoder's sizes, which "
                        "model.init_from needs to match")
    p.add_argument("--pretrain-minutes", type=float, default=10.0)
    p.add_argument("--finetune-minutes", type=float, default=5.0)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    pre_dir, fine_dir = ROOT / "runs" / "probe-pretrain", ROOT / "runs" / "probe-finetune"
    pre, pre_total = train(args.pretrain, [*args.overrides, f"train.max_minutes={args.pretrain_minutes}"], pre_dir)
    fine, fine_total = train(args.finetune, [*args.finetune_set, f"model.init_from={pre_dir}",
                                             f"train.max_minutes={args.finetune_minutes}"], fine_dir)
    cfg = load_config(RunConfig, fine_dir / "config.yaml")
    scores, _ = evaluate_classifier(load_run(fine_dir / "best.safetensors"), read_validation(cfg, log=lambda m: None))
    best_pre = max(pre, key=lambda m: m["score"])
    probe = {
        "recipe": args.recipe, "pretrain": args.pretrain, "overrides": args.overrides,
        "pretrain_minutes": round(pre[-1]["minutes"], 2), "pretrain_updates": pre[-1]["step"],
        "pretrain_score": {k: v for k, v in best_pre.items() if k.startswith("valid_")},
        "finetune": args.finetune, "finetune_overrides": args.finetune_set,
        "finetune_minutes": round(fine[-1]["minutes"], 2),
        "finetune_updates": fine[-1]["step"], "minutes_total": round(pre_total + fine_total, 2),
        "valid_accuracy": round(scores.accuracy, 2), "valid_rows": sum(sum(row) for row in scores.confusion),
        "threads": cfg.train.threads, "cpu": cpu_model(), **stamp(),
        "command": " ".join(["python", "experiments/recipe_probes.py", *sys.argv[1:]]),
    }
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {"probes": []}
    results["probes"].append(probe)
    results.update(date=probe["date"], commit=probe["commit"])
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(probe, indent=2))
    print(markdown_table(results))


def _pretrain_score(s: dict) -> str:
    """The pretraining run's own best score: replaced-token accuracy (ELECTRA) or masked accuracy."""
    return f"RTD {s['valid_rtd_acc']:.1f}" if "valid_rtd_acc" in s else f"MLM {s['valid_mlm_acc']:.1f}"


def markdown_table(results: dict) -> str:
    """One row per probe, in the order they ran."""
    rows = [[r["recipe"], f"{r['pretrain_minutes']:.1f}", f"{r['pretrain_updates']:,}",
             _pretrain_score(r["pretrain_score"]), " ".join(f"`{o}`" for o in r.get("finetune_overrides") or []),
             f"{r['finetune_minutes']:.1f}", f"{r['finetune_updates']:,}",
             f"**{r['valid_accuracy']:.2f}**", f"{r['minutes_total']:.1f}", r["threads"],
             f"{r['date'][:10]}, `{r['commit']}`"] for r in results["probes"]]
    return markdown(["recipe", "pretrain minutes", "updates", "its own held-out score", "fine-tune overrides",
                     "fine-tune minutes", "updates", "held-out accuracy (whole reviews)", "minutes in all", "threads",
                     "measured"], rows, "lrrrlrrrrrl")


if __name__ == "__main__":
    main()
