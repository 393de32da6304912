"""Run a trained model on one sentence and save its attention weights as PNG heatmaps: cross-attention,
encoder self-attention and decoder self-attention for Transformers, each as the mean over layers and heads,
and for the last layer (or the layers --layers names) the mean over heads and one panel per head; the
alignment for RNN models; self-attention and the pooled representation's token importance for
classifiers, and for a text longer than the classifier's window the windows it was read as and
how much each argued for and against the prediction. A language model continues the prompt (greedily)
and shows its causal self-attention over prompt and continuation, per layer and head, with what each
head does: its previous-token, attention-sink, local-window and induction scores (printed as a table and
drawn as head-scores.png). Axes show the tokenizer's subword pieces (▁ marks a word start).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..common.errors import UserError
from ..inference.attention_maps import NEW_TOKENS
from ..inference.head_scores import LOCAL_WINDOW
from ..tasks import attention_maps, load_run, spec
from ..viz.explorer import write_explorer
from .options import FINITE, POSITIVE_INT, add_engine_options, add_reading_argument, engine_of, number

HELP = "draw what attention learned: heatmaps and an interactive HTML explorer"
EPILOG = """\
files written to OUT_DIR (L = layer number from 0, for the last layer unless --layers names others;
for one-layer kinds -layerL is dropped and there is no -mean):
  cross-mean.png, cross-layerL.png, cross-layerL-heads.png
  encoder-self-mean.png, encoder-self-layerL.png, encoder-self-layerL-heads.png
  decoder-self-mean.png, decoder-self-layerL.png, decoder-self-layerL-heads.png
  alignment.png (RNN); pooling.png, windows.png (classifier; windows for a long text);
  head-scores.png (language model: what each head does, layer x head); attention.html (--html)
by default at most 3 PNGs per kind, however deep the model; the page (--html) holds every layer and head.

rows are queries, columns keys: cross-attention rows are the output pieces (what each decoder
position produced), decoder self-attention rows and columns the decoder inputs (<s> first); a
language model's rows and columns are the prompt's pieces, then the continuation's.

head scores (language model), each a mean over rows of one head's weights a[t, u], in [0, 1]:
  previous   a[t, t-1], on the token before
  sink       a[t, 0], on the first token (the "attention sink")
  local-W    the share on the last W tokens, t-W+1 .. t (--local-window)
  induction  on n random tokens given twice, a[t, t-n+1] on the second copy: on the token that
             followed the previous occurrence of the current one (Olsson et al. 2022)"""


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("attention", help=HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=__doc__, epilog=EPILOG)
    p.add_argument("model", help="run directory or a .safetensors checkpoint inside one")
    p.add_argument("--src", required=True,
                   help="the source sentence (translation), text (classification) or prompt (language model)")
    p.add_argument("--tgt", help="translation: force-decode this target instead of the model's own translation; "
                                 "language model: show this continuation instead of the model's own")
    p.add_argument("-o", "--out-dir", default="attention", help="where the PNGs (and HTML) go (default: attention)")
    p.add_argument("--html", action="store_true",
                   help="also write OUT_DIR/attention.html: one self-contained page (no network) to pick the "
                        "kind, layer and head and hover or click a token to see its attention")
    p.add_argument("--no-png", action="store_true", help="skip the PNG heatmaps (with --html: only the page)")
    p.add_argument("--layers", type=layer_list, default=[-1], metavar="L,L,...|all",
                   help="the layers drawn one by one as PNGs (mean over heads, and per head), from 0; negative "
                        "numbers count from the last (write --layers=-2,-1 when the list starts with one); all: "
                        "every layer (2 PNGs a layer). The mean over layers is always drawn (default: -1, the last)")
    p.add_argument("--beam", type=POSITIVE_INT, default=1,
                   help="beam size for the model's own translation (default: 1, greedy)")
    p.add_argument("--lenpen", type=FINITE, default=None,
                   help="length penalty alpha with --beam > 1 (default: the run's decode_lenpen)")
    p.add_argument("--max-new-tokens", type=number(int, 0), default=NEW_TOKENS,
                   help=f"language model: continue the prompt by at most this many tokens, greedily, as the "
                        f"model's positions allow (default: {NEW_TOKENS}; 0: the prompt only)")
    p.add_argument("--local-window", type=POSITIVE_INT, default=LOCAL_WINDOW,
                   help=f"language model: W of the local-window head score (default: {LOCAL_WINDOW})")
    add_reading_argument(p)
    add_engine_options(p, "the same as eager here (only a language model's generation has compiled steps)")


def layer_list(text: str) -> list[int] | None:
    """An argparse ``type`` for ``--layers``: comma-separated layer numbers (``0,3,-1``), or ``all`` (None)."""
    if text.strip() == "all":
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer numbers separated by commas (0,3,-1) or all, got {text!r}") \
            from None


def run(args: argparse.Namespace) -> None:
    from ..viz.figures import attention_figures  # matplotlib: loaded only when drawing
    from ..viz.plot import save_figure

    if args.no_png and not args.html:
        raise UserError("--no-png without --html would write nothing; drop --no-png or add --html")
    run = load_run(args.model, engine=engine_of(args))
    if spec(run.task).attention_maps is None:
        raise UserError(f"{args.model} is a {run.task} run, whose attention attnkit does not show; look at the "
                        f"attention of a model fine-tuned from it")
    lenpen = run.cfg.decode_lenpen if args.lenpen is None else args.lenpen
    maps = attention_maps(run, args.src, args.tgt, beam=args.beam, lenpen=lenpen, reading=args.read,
                          new_tokens=args.max_new_tokens, window=args.local_window)
    out = Path(args.out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{out}: cannot create the output directory ({e.strerror})") from None
    print(maps.heading())
    if maps.head_scores is not None:
        print(maps.head_scores.table())
    try:
        figures = iter(()) if args.no_png else attention_figures(maps, args.layers)
    except ValueError as e:  # a layer the model does not have
        raise UserError(f"--layers: {e}") from None
    for stem, fig in figures:  # one figure in memory at a time
        print(save_figure(fig, out / f"{stem}.png"))
        fig.clear()  # its axes and images go now, not at the next garbage collection
    if args.html:
        print(write_explorer(maps, out / "attention.html"))
