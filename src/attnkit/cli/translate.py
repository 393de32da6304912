"""Translate one sentence per line (stdin by default) with beam search. A line longer than the model reads is cut
to it (with a warning); a blank line gives an empty one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..common.errors import UserError
from ..export import open_translator
from ..search import LENPEN, MAX_LEN_A, MAX_LEN_B
from ..tasks import require
from .options import FINITE, NON_NEGATIVE, POSITIVE_INT, add_engine_options, engine_of, read_input, write_output

HELP = "translate text with a trained model"


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("translate", help=HELP, description=__doc__)
    p.add_argument("model", help="run directory, a .safetensors checkpoint inside one, or a directory written "
                                 "by `attnkit export`")
    p.add_argument("-i", "--input", help="input file (default: stdin)")
    p.add_argument("-o", "--output", help="output file (default: stdout)")
    p.add_argument("--beam", type=POSITIVE_INT, default=None,
                   help="beam size; 1 = greedy (default: the run's decode_beam)")
    p.add_argument("--lenpen", type=FINITE, default=None,
                   help=f"GNMT length penalty alpha (default: the run's decode_lenpen, {LENPEN} unless configured)")
    p.add_argument("--n-best", type=POSITIVE_INT, default=1,
                   help="hypotheses per sentence, tab-separated (default: 1)")
    p.add_argument("--max-len-a", type=NON_NEGATIVE, default=MAX_LEN_A,
                   help="max output length = a * source length + b")
    p.add_argument("--max-len-b", type=FINITE, default=MAX_LEN_B,
                   help=f"(default: a={MAX_LEN_A:g}, b={MAX_LEN_B:g}, as in the paper)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=64, help="sentences per batch (default: 64)")
    p.add_argument("--attention-dir", metavar="DIR",
                   help="also save a cross-attention heatmap per input line (greedy decoding) as "
                        "DIR/attention-0001.png, ...")
    add_engine_options(p, "the same as eager here (only a language model's generation has compiled steps)")


def run(args: argparse.Namespace) -> None:
    translator = open_translator(args.model, engine=engine_of(args))
    run = translator.run
    if run is None and args.attention_dir:
        raise UserError(f"{args.model}: an exported model gives no attention weights; use --attention-dir "
                        f"with the run directory it was exported from")
    if run is not None:
        require(run, "translate", args.model)
    beam = translator.beam if args.beam is None else args.beam
    if not 1 <= args.n_best <= beam:
        raise UserError(f"--n-best {args.n_best} must be between 1 and --beam {beam}")
    lenpen = translator.lenpen if args.lenpen is None else args.lenpen
    lengths = {k: v for k, v in (("max_len_a", args.max_len_a), ("max_len_b", args.max_len_b)) if v is not None}
    texts = read_input(args.input)
    hyps = translator.translate(texts, beam=beam, lenpen=lenpen, n_best=args.n_best, batch_size=args.batch_size,
                                **lengths)
    write_output(args.output, ["\t".join(h) for h in hyps])
    if args.attention_dir:
        from ..viz.figures import attention_figure  # matplotlib: loaded only when drawing
        from ..viz.plot import save_figure

        for i, text in enumerate(texts, start=1):
            save_figure(attention_figure(run, text), Path(args.attention_dir) / f"attention-{i:04d}.png")
