"""Train a translation or classification model, or pretrain an encoder on unlabelled text (task: pretrain;
fine-tune it with model.init_from), or a language model (task: lm; from another run with model.init_from, every
weight or LoRA adapters beside its frozen weights with model.lora, on text or on conversations). The run directory
receives the resolved config, the tokenizer, the prepared data, checkpoints and metrics.jsonl.
"""

from __future__ import annotations

import argparse

from ..config.loader import load_config
from ..config.schema import RunConfig
from ..runs.layout import CONFIG_FILE
from ..tasks import spec
from ..tasks.init_from import check_init_from
from ..training.trainer import Trainer
from .options import add_config_arguments, config_run_dir

HELP = "train a model from a YAML config"


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help=HELP, description=__doc__)
    add_config_arguments(p, "train.lr=5e-4", "output directory")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --run-dir (exactly where it stopped)")


def run(args: argparse.Namespace) -> None:
    run_dir = config_run_dir(args)
    if args.resume and (run_dir / CONFIG_FILE).exists():
        cfg = load_config(RunConfig, run_dir / CONFIG_FILE, args.overrides)  # the run's own config
    else:
        cfg = load_config(RunConfig, args.config, args.overrides)
    spec(cfg.task).check(cfg)  # what the task cannot train, and
    if cfg.model.init_from:  # a missing or mismatched pretraining run: errors before the run directory is touched
        check_init_from(cfg, run_dir)
    trainer = Trainer(cfg, run_dir, resume=args.resume)
    metrics = trainer.run()
    if trainer.workers.is_main:  # under torchrun, one of several processes (see attnkit.training.distributed)
        print(" ".join(f"{k} {v}" for k, v in metrics.items()))
