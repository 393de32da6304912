"""SST-2 sentiment with the encoder-only Transformer, trained from scratch: accuracy and time.

    python benchmarks/sst2.py                                  # the tuned config and the seed's tiny model
    python benchmarks/sst2.py --configs configs/sst2.yaml      # one of them

For each config: hold out 2,000 random rows of ``../shared/data/sst2/train.tsv`` for
validation (checkpoint selection and early stopping never see the dev set), train on the rest
(wall-clock budget from the config's ``train.max_minutes``), and evaluate the best checkpoint
once on ``dev.tsv``. Writes
``benchmarks/results/sst2.json`` (accuracy, macro-F1, confusion matrix, minutes per config)
and ``benchmarks/results/<config>.dev-pred.txt`` (one predicted label per dev line).
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

from attnkit.classify import evaluate_classifier  # noqa: E402
from attnkit.config import load_config  # noqa: E402
from attnkit.data import read_labelled  # noqa: E402
from attnkit.measure import stamp  # noqa: E402
from attnkit.runconfig import RunConfig  # noqa: E402
from attnkit.tasks import load_run  # noqa: E402
from attnkit.train import Trainer  # noqa: E402
from tables import markdown, measured, num  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "sst2"
HELD_OUT = 2000


def split_train(out_dir: Path, seed: int = 1) -> tuple[Path, Path]:
    """Write train/valid TSVs (same header) with HELD_OUT random training rows in valid."""
    import random

    lines = (DATA / "train.tsv").read_text(encoding="utf-8").splitlines()
    header, rows = lines[0], lines[1:]
    held = set(random.Random(seed).sample(range(len(rows)), HELD_OUT))
    out_dir.mkdir(parents=True, exist_ok=True)
    train, valid = out_dir / "train.tsv", out_dir / "valid.tsv"
    train.write_text("\n".join([header] + [r for i, r in enumerate(rows) if i not in held]) + "\n", encoding="utf-8")
    valid.write_text("\n".join([header] + [r for i, r in enumerate(rows) if i in held]) + "\n", encoding="utf-8")
    return train, valid


def markdown_table(results: dict) -> str:
    """README: dev accuracy of each configuration in ``benchmarks/results/sst2.json``."""
    target = results["targets"]
    rows = [[f"`{r['config']}`", f"**{r['dev_accuracy']:.1f}**", f"{r['dev_macro_f1']:.1f}",
             f"{r['minutes_total']:.1f}", num(r["updates"]), f"{r['parameters'] / 1e6:.2f}M", r["precision"],
             measured(results),
             f">= {target['dev_accuracy']:g} in <= {target['minutes']:g} min"] for r in results["results"]]
    return markdown(["config", "dev accuracy %", "macro-F1", "minutes", "updates", "parameters", "precision",
                     "measured", "target"], rows, "lrrrrrlll")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=[str(ROOT / "configs" / "sst2.yaml"),
                                                     str(ROOT / "configs" / "seed-imdb.yaml")])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sst2.json"))
    args = p.parse_args()
    if not DATA.exists():
        sys.exit(f"{DATA} is missing: this benchmark needs ../shared/data/sst2 beside the repository")

    train_file, valid_file = split_train(ROOT / "runs" / "sst2-split")
    results = []
    for config in args.configs:
        name = Path(config).stem
        run_dir = ROOT / "runs" / f"bench-{name}"
        cfg = load_config(RunConfig, config, [f"data.train={train_file}", f"data.valid={valid_file}"])
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        start = time.perf_counter()
        trainer = Trainer(cfg, run_dir)
        trainer.run()
        minutes = (time.perf_counter() - start) / 60  # tokenizer + data + training + validations
        run = load_run(run_dir / "best.safetensors")
        dev = read_labelled(DATA / "dev.tsv")
        scores, predictions = evaluate_classifier(run, dev)
        pred_path = ROOT / "benchmarks" / "results" / f"{name}.dev-pred.txt"
        pred_path.parent.mkdir(parents=True, exist_ok=True)
        pred_path.write_text("".join(p_ + "\n" for p_ in predictions), encoding="utf-8")
        n_params = sum(p_.numel() for p_ in run.model.parameters())
        results.append({"config": f"configs/{name}.yaml", "dev_accuracy": round(scores.accuracy, 2),
                        "dev_macro_f1": round(scores.macro_f1, 2), "confusion": scores.confusion,
                        "classes": scores.classes, "minutes_total": round(minutes, 2),
                        "train_minutes": round(trainer.minutes(), 2), "updates": trainer.step,
                        "parameters": n_params, "precision": "bf16" if trainer.bf16 else "fp32"})
        print(f"\n{name}: {scores}\n  {minutes:.1f} min in all, {n_params / 1e6:.2f}M parameters", flush=True)

    print(f"\n{'config':<26} {'dev acc':>8} {'macro-F1':>9} {'minutes':>8} {'params':>9}")
    for r in results:
        print(f"{r['config']:<26} {r['dev_accuracy']:>8.2f} {r['dev_macro_f1']:>9.2f} {r['minutes_total']:>8.1f} "
              f"{r['parameters'] / 1e6:>8.2f}M")
    Path(args.out).write_text(json.dumps({
        **stamp(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "dev": "sst2/dev.tsv (872), evaluated once per config; selection on 2,000 held-out training rows",
        "results": results,
        "command": " ".join(["python", "benchmarks/sst2.py", *sys.argv[1:]]),
        "targets": {"dev_accuracy": 86.0, "minutes": 10}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
