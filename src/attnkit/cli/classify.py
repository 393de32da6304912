"""One prediction per input line: label<TAB>probability<TAB>text."""

from __future__ import annotations

import argparse

from ..inference.classify import classify_texts
from ..tasks import load_run, require
from .options import add_engine_options, add_reading_argument, engine_of, read_input, write_output

HELP = "classify text with a trained classifier"


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("classify", help=HELP, description=__doc__)
    p.add_argument("model", help="run directory or a .safetensors checkpoint inside one")
    p.add_argument("-i", "--input", help="input file (default: stdin)")
    p.add_argument("--with-attention", action="store_true",
                   help="also print the 5 pieces the prediction drew on most: the pooled representation's token "
                        "importance in every window --read gives, weighted as the windows' logits are averaged")
    add_reading_argument(p)
    add_engine_options(p, "the same as eager here (only a language model's generation has compiled steps)")


def run(args: argparse.Namespace) -> None:
    run = require(load_run(args.model, engine=engine_of(args)), "classify", args.model)
    write_output(None, classify_texts(run, read_input(args.input), with_attention=args.with_attention,
                                           reading=args.read))
