"""SST-2 sentiment with the encoder-only Transformer: from scratch, and fine-tuned after MLM pretraining.

    python benchmarks/sst2.py                                            # configs/sst2.yaml
    python benchmarks/sst2.py configs/sst2-pretrain.yaml configs/sst2-finetune.yaml
    python benchmarks/sst2.py configs/sst2-finetune.yaml --record-only   # score runs/sst2-finetune as it is

Each config trains into ``runs/<config name>`` with its ``train.threads`` (see ``benchmarks/imdb.py``,
which does the training and the held-out scoring): checkpoints are selected on the training rows the
config holds out (``data.valid_fraction``), never on dev. The best checkpoint of a classifier is
then evaluated once on ``dev.tsv``. Writes ``benchmarks/results/sst2.json`` (held-out and dev
accuracy, macro-F1, confusion matrix, minutes, updates, date, commit per config) and
``benchmarks/results/<config>.dev-pred.txt`` (one predicted label per dev line).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from attnkit.data.labelled import read_labelled  # noqa: E402
from attnkit.inference.classify import evaluate_classifier  # noqa: E402
from attnkit.tasks import load_run  # noqa: E402
from imdb import RESULTS, held_out_text, measure  # noqa: E402
from tables import markdown, num  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "sst2"
#: Dev accuracy targets: from scratch (the earlier classification issue), and after pretraining (issue 19).
TARGETS = {"sst2": 86.0, "sst2-finetune": 85.0, "sst2-lm-finetune": 85.0, "sst2-ulmfit": 85.0}


def markdown_table(results: dict[str, dict]) -> str:
    """README: every SST-2 result file (``{path: JSON}``): the current one (a dict of configs) and earlier
    ones (a list of configs, selected on a split the script made itself), newest first."""
    rows = []
    for data in sorted(results.values(), key=lambda d: d["date"], reverse=True):
        entries = data["results"]
        for r in entries.values() if isinstance(entries, dict) else entries:
            when = f"{r.get('date', data['date'])[:10]}, `{r.get('commit', data['commit'])}`"
            minutes, updates = f"{r['train_minutes']:.1f}", num(r["updates"])
            config = f"`{r['config']}`" if isinstance(entries, dict) else f"`{r['config']}` as of `{data['commit']}`"
            if r.get("overrides"):  # a trial with the config changed on the command line
                config += " with " + ", ".join(f"`{o}`" for o in r["overrides"])
            if r.get("task") in ("pretrain", "lm"):
                rows.append([config, held_out_text(r), "", "", minutes, updates, r["threads"], when])
                continue
            target = TARGETS.get(Path(r["config"]).stem)
            held_out = f"{r['valid_accuracy']:.2f}" if "valid_accuracy" in r else "(2,000 random rows)"
            rows.append([config, held_out, f"**{r['dev_accuracy']:.2f}**",
                         "" if target is None else f">= {target:g}", minutes, updates,
                         r.get("threads", data.get("threads")), when])
    return markdown(["config", "held-out accuracy", "dev accuracy", "target (dev)", "train minutes", "updates",
                     "threads", "measured"], rows, "lrrrrrrl")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="*", default=[str(ROOT / "configs" / "sst2.yaml")],
                   help="config files, and KEY=VALUE overrides for all of them")
    p.add_argument("--record-only", action="store_true", help="score runs/<name> as it is, without training")
    p.add_argument("--out", default=str(RESULTS / "sst2.json"))
    args = p.parse_args()
    if not DATA.exists():
        sys.exit(f"{DATA} is missing: this benchmark needs ../shared/data/sst2 beside the repository")
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {"results": {}}
    if not isinstance(results.get("results"), dict):  # the earlier format: kept in results/earlier/
        sys.exit(f"{out} holds results in the earlier format; move it to benchmarks/results/earlier/ first")
    overrides = [c for c in args.configs if "=" in c]
    dev = read_labelled(DATA / "dev.tsv")
    for config in [c for c in args.configs if "=" not in c]:
        r = measure(config, args.record_only, overrides)
        if overrides:  # a trial with the config changed on the command line: the table says so
            r["overrides"] = overrides
        # a trial with overrides (another seed, say) is kept beside the config's own result, not over it
        suffix = "".join(f"-{o.replace('/', '_')}" for o in overrides)
        if r["task"] == "classify":
            scores, predictions = evaluate_classifier(load_run(ROOT / r["run_dir"] / "best.safetensors"), dev)
            name = Path(config).stem + suffix
            (RESULTS / f"{name}.dev-pred.txt").write_text("".join(x + "\n" for x in predictions), encoding="utf-8")
            r.update(dev_accuracy=round(scores.accuracy, 2), dev_macro_f1=round(scores.macro_f1, 2),
                     dev_confusion=scores.confusion)
        results["results"][r["config"] + "".join(f" {o}" for o in overrides)] = r
        results.update(date=r["date"], commit=r["commit"])  # the latest measurement in the file
        results["dev"] = "sst2/dev.tsv (872 rows), evaluated once per config after selection on held-out training rows"
        out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(json.dumps(r, indent=2), flush=True)
    print(markdown_table({str(out): results}))


if __name__ == "__main__":
    main()
