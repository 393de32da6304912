"""Section 1 (seeds 000, 002; Bahdanau et al. 2015, Fig. 2): the fixed-size context is a bottleneck.

Seeds 000/002: an RNN encoder-decoder without attention squeezes the source into one vector, so
its translations get worse as sentences get longer; attention removes the bottleneck. Bahdanau
et al. (Fig. 2) show BLEU against sentence length: the no-attention model falls off, the
attention model does not (as much).

Three models, the same training budget each (``--minutes``, default 15, on Multi30k de->en):

- ``rnn-noattn``: GRU encoder-decoder, attention none (configs/multi30k-de-en-rnn-noattn.yaml);
- ``rnn-attention``: the same with Bahdanau attention (configs/multi30k-de-en-rnn-bahdanau.yaml);
- ``transformer``: Transformer small (configs/multi30k-de-en.yaml).

Each is decoded on test_2016_flickr (beam ``--beam``), and BLEU is computed per bucket of source
length in words. ``--run-dir NAME=PATH`` uses an existing run instead of training one (its own
training time is then reported, which may differ from the budget: say so when comparing).

    python experiments/bottleneck.py                                   # 3 x 15 min training, then decoding
    python experiments/bottleneck.py --run-dir transformer=runs/multi30k-de-en \\
        --run-dir rnn-attention=runs/multi30k-de-en-rnn-bahdanau          # reuse the 60-min benchmark runs

Writes docs/figures/bottleneck.{json,png}.
"""

from __future__ import annotations

from pathlib import Path

from common import (
    RNN_ATTENTION_CONFIG,
    RNN_NO_ATTENTION_CONFIG,
    ROOT,
    TRANSFORMER_CONFIG,
    bleu,
    caption,
    describe_run,
    markdown,
    num,
    parser,
    require_run,
    score_run,
    start,
    test_pairs,
    train_for,
)
from matplotlib.figure import Figure

MODELS = {
    "rnn-noattn": ("RNN, no attention", RNN_NO_ATTENTION_CONFIG),
    "rnn-attention": ("RNN + Bahdanau attention", RNN_ATTENTION_CONFIG),
    "transformer": ("Transformer small", TRANSFORMER_CONFIG),
}
#: Source-length buckets in words (whitespace tokens), inclusive; the test set's median is 10, its maximum 30.
BUCKETS = ((1, 7), (8, 10), (11, 13), (14, 16), (17, 99))


def bucket_label(lo: int, hi: int) -> str:
    return f"{lo}-{hi}" if hi < 99 else f"{lo}+"


def bleu_by_length(hyps: list[str], pairs: list[tuple[str, str]]) -> list[dict]:
    """Corpus BLEU of the sentences in each source-length bucket (empty buckets left out)."""
    rows = []
    for lo, hi in BUCKETS:
        idx = [i for i, (s, _) in enumerate(pairs) if lo <= len(s.split()) <= hi]
        if idx:
            rows.append({"bucket": bucket_label(lo, hi), "sentences": len(idx),
                         "bleu": bleu([hyps[i] for i in idx], [pairs[i][1] for i in idx])})
    return rows


def figure(models: list[dict]) -> Figure:
    fig = Figure(figsize=(8.5, 4.8), layout="constrained")
    ax = fig.subplots()
    for m in models:
        rows = m["by_length"]
        ax.plot(range(len(rows)), [r["bleu"] for r in rows], "o-",
                label=f"{m['label']} ({m['train_minutes']:.0f} min, all: {m['bleu']:.1f})")
    rows = models[0]["by_length"]
    ax.set_xticks(range(len(rows)), [f"{r['bucket']}\n({r['sentences']} sent.)" for r in rows])
    spent = {round(m["train_minutes"]) for m in models}  # reused runs bring their own training time
    budget = f"{spent.pop()} min of training per model" if len(spent) == 1 else "training time in the legend"
    ax.set(title=f"BLEU by source length, Multi30k test_2016_flickr ({budget})",
           xlabel="source sentence length (German words)", ylabel="BLEU")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def markdown_table(results: dict) -> str:
    """docs/experiments.md section 1: BLEU per source-length bucket (each model's best in bold), then how far
    below its best bucket each model falls."""
    buckets = results["models"][0]["by_length"]
    header = ["source words (sentences)", *[f"{b['bucket']} ({b['sentences']})" for b in buckets], "all"]
    rows, drops = [], []
    for m in results["models"]:
        best = max(b["bleu"] for b in m["by_length"])
        cells = [f"**{b['bleu']:.2f}**" if b["bleu"] == best else f"{b['bleu']:.2f}" for b in m["by_length"]]
        label = f"{m['label']} ({m['parameters'] / 1e6:.1f}M parameters, {num(m['updates'])} updates)"
        rows.append([label, *cells, f"{m['bleu']:.2f}"])
        drops.append([f"{m['label']}: below its best bucket",
                      *[f"{100 * (1 - b['bleu'] / best):.0f}%" if best > 0 else "" for b in m["by_length"]], ""])
    return markdown(header, rows + drops, "l" + "r" * (len(buckets) + 1)) + "\n\n" + caption(results)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=15.0, help="training budget per model (wall clock)")
    p.add_argument("--run-dir", action="append", default=[], metavar="NAME=PATH",
                   help=f"use this finished run for model NAME ({', '.join(MODELS)}) instead of training")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--runs", default=str(ROOT / "runs"), help="where trained run directories go")
    p.add_argument("--sentences", type=int, default=0, help="first N test sentences (0 = all 1,000)")
    p.add_argument("--beam", type=int, default=4, help="beam size (1 = greedy)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every model")
    args = p.parse_args()
    malformed = [item for item in args.run_dir if "=" not in item]
    if malformed:
        p.error(f"--run-dir {malformed[0]!r}: expected NAME=PATH, e.g. transformer=runs/multi30k-de-en")
    given = dict(item.split("=", 1) for item in args.run_dir)
    unknown = set(given) - set(MODELS)
    if unknown:
        p.error(f"--run-dir names {sorted(unknown)}; choose among {', '.join(MODELS)}")
    rec = start("bottleneck", args)
    pairs = test_pairs(args.sentences)
    models = []
    for key in args.models:
        label, config = MODELS[key]
        if key in given:
            run = describe_run(label, require_run(Path(given[key])))
        else:
            run = train_for(label, config, Path(args.runs) / f"exp-bottleneck-{key}", args.minutes, args.set)
        hyps, score = score_run(run.run_dir, pairs, args.beam)
        models.append({"model": key, "label": label, "run_dir": str(run.run_dir), "reused": key in given,
                       "train_minutes": run.minutes, "updates": run.updates, "parameters": run.parameters,
                       "bleu": score, "by_length": bleu_by_length(hyps, pairs)})
        print(f"{label}: BLEU {score:.2f}; by length " +
              ", ".join(f"{r['bucket']}: {r['bleu']:.1f}" for r in models[-1]["by_length"]))
    rec.results = {"test": "test_2016_flickr", "sentences": len(pairs), "beam": args.beam,
                   "minutes_budget": args.minutes, "overrides": args.set, "buckets": "source words, inclusive",
                   "models": models}
    rec.figure(figure(models))
    rec.write()


if __name__ == "__main__":
    main()
