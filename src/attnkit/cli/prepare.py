"""Stream the training corpus, train the tokenizer on a sample, encode it in several processes and store the ids
memory-mapped in RUN_DIR/data with a manifest. `attnkit train` reuses it while the inputs are unchanged (and
prepares it itself when it is missing).
"""

from __future__ import annotations

import argparse

from ..common.errors import UserError
from ..common.log import to_stderr
from ..config.loader import load_config
from ..config.schema import RunConfig
from ..runs.layout import DATA_DIR, checkpoints
from ..tasks import prepare
from .options import add_config_arguments, config_run_dir

HELP = "tokenize a config's training data once, for any number of runs"


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help=HELP, description=__doc__)
    add_config_arguments(p, "data.max_len=100", "the run directory to prepare")
    p.add_argument("--workers", type=int, default=None,
                   help="encoding processes (default: one per CPU, none for inputs under a few MB)")


def run(args: argparse.Namespace) -> None:
    run_dir = config_run_dir(args)
    cfg = load_config(RunConfig, args.config, args.overrides)
    if args.workers is not None and args.workers < 0:
        raise UserError(f"--workers must be 0 (encode in this process) or more, got {args.workers}")
    trained = bool(checkpoints(run_dir))  # its checkpoints refer to the prepared data
    data = prepare(cfg, run_dir, to_stderr, resume=trained, workers=args.workers)
    size = sum(f.stat().st_size for f in (run_dir / DATA_DIR).iterdir())
    tokens = sum(side["tokens"] for side in data.manifest["sides"].values())
    print(f"{run_dir / DATA_DIR}: {len(data)} examples, {tokens} tokens, {size / 1e6:.1f} MB")
