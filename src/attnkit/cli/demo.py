"""Train a small Transformer to rewrite dates written in 18 formats and 5 languages as ISO 8601, report exact
match on held-out dates and save a cross-attention heatmap. No download needed.
"""

from __future__ import annotations

import argparse

from ..demo import HELD_OUT, run_demo
from .options import POSITIVE_INT

HELP = "train a small Transformer on generated dates and show its attention"


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help=HELP, description=__doc__)
    p.add_argument("-o", "--out-dir", default=".", help="where the run and the heatmap PNG go (default: .)")
    p.add_argument("--held-out", type=POSITIVE_INT, metavar="N",
                   help="how many held-out dates to score for exact match (default: 1000; fewer is quicker)")
    p.add_argument("--json", metavar="PATH",
                   help="also write exact match, minutes, updates, peak RSS, date and commit to PATH as JSON")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, e.g. train.max_updates=200 (see configs/demo.yaml)")


def run(args: argparse.Namespace) -> None:
    held_out = HELD_OUT if args.held_out is None else args.held_out
    run_demo(args.out_dir, args.overrides, held_out=held_out, json_path=args.json)
