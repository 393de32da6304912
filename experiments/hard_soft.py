"""Section 5 (seed 001): a model trained with soft attention, read with hard attention and other temperatures.

Seed 001: soft attention takes ``a = softmax(beta * X^T x)`` (``||a||_1 = 1``), hard attention the
one value with the highest score (``||a||_0 = 1``); beta is the inverse temperature. Here the
trained models are decoded with every attention (for the Transformer: encoder self, decoder self
and cross-attention in every layer and head; for the RNN: its one alignment) switched by
:func:`attnkit.attention.attention_override` to

- soft with beta x {0.25, 0.5, 1, 2, 4} on top of the trained scale (beta x 1 = the model as trained),
- hard: one-hot argmax, the limit beta -> infinity.

Test BLEU (sacreBLEU, greedy decoding) on the first ``--sentences`` sentences of
test_2016_flickr, plus how peaked the soft cross-attention/alignment is as trained.

    python experiments/hard_soft.py                     # Transformer (+ RNN when its run is finished)

Writes docs/figures/hard_soft.{json,png}, with the run time.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from common import (
    BENCHMARK_RNN_ATTENTION,
    BENCHMARK_TRANSFORMER,
    bleu,
    caption,
    markdown,
    parser,
    require_run,
    start,
    test_pairs,
    translate,
)
from matplotlib.figure import Figure

from attnkit.attention import attention_override
from attnkit.runs.load import LoadedRun
from attnkit.tasks import attention_maps, load_run

BETAS = (0.25, 0.5, 1.0, 2.0, 4.0)


def peakedness(run: LoadedRun, pairs: list[tuple[str, str]]) -> dict:
    """Mean largest weight of the trained (soft) cross-attention / alignment per output token, forced on the reference.

    For the Transformer: the last layer, every head; a largest weight near 1 means hard attention
    would change little.
    """
    largest = []
    for src, ref in pairs:
        maps = attention_maps(run, src, ref)
        largest.append(maps.cross[-1].max(dim=-1).values.flatten())  # (H * T,)
    values = torch.cat(largest)
    return {"mean_max_weight": round(float(values.mean()), 4),
            "share_above_0.9": round(float((values > 0.9).float().mean()), 4)}


def evaluate(name: str, run_dir: Path, pairs: list[tuple[str, str]], beam: int, peak_sentences: int) -> dict:
    run = load_run(run_dir)
    sources, refs = [s for s, _ in pairs], [t for _, t in pairs]
    rows = []
    settings: list[tuple[str, float, str]] = [("softmax", b, f"soft, beta x {b:g}") for b in BETAS]
    settings.append(("hard", math.inf, "hard (argmax)"))
    for normalizer, beta, label in settings:
        with attention_override(run.model, normalizer=normalizer, beta=None if normalizer == "hard" else beta):
            score = bleu(translate(run, sources, beam), refs)
        rows.append({"setting": label, "normalizer": normalizer, "beta": "inf" if math.isinf(beta) else beta,
                     "bleu": score})
        print(f"{name:12s} {label:18s} BLEU {score:6.2f}")
    return {"name": name, "run_dir": str(run_dir), "weights": run.weights_path.name, "results": rows,
            "trained_attention": peakedness(run, pairs[:peak_sentences])}


def figure(models: list[dict], n: int) -> Figure:
    fig = Figure(figsize=(7.5, 4.6), layout="constrained")
    ax = fig.subplots()
    xs = [*BETAS, 16.0]  # hard attention drawn at the right end, labelled "hard"
    for m in models:
        ax.semilogx(xs, [r["bleu"] for r in m["results"]], "o-", base=2, label=m["name"])
    ax.set_xticks(xs, [f"{b:g}" for b in BETAS] + ["hard\n(beta -> inf)"])
    ax.minorticks_off()
    ax.axvline(1.0, color="gray", linestyle=":", label="as trained (beta x 1)")
    ax.set(title=f"Soft-trained models decoded with other attention\n(Multi30k test_2016_flickr, {n} sentences)",
           xlabel="inverse temperature beta, multiplying the trained logits (log scale)",
           ylabel="BLEU (greedy decoding)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def markdown_table(results: dict) -> str:
    """docs/experiments.md 5: test BLEU of each model with every attention at another temperature, or hard."""
    models = results["models"]
    settings = [r["setting"] for r in models[0]["results"]]
    rows = []
    for i, setting in enumerate(settings):
        trained = setting == "soft, beta x 1"
        cells = [f"{m['results'][i]['bleu']:.2f}" for m in models]
        label = setting + (" (as trained)" if trained else "")
        rows.append([f"**{label}**", *[f"**{c}**" for c in cells]] if trained else [label, *cells])
    rows.append(["*as trained: mean largest weight per output token (and head), share above 0.9*",
                 *[f"*{m['trained_attention']['mean_max_weight']:.2f}, "
                   f"{100 * m['trained_attention']['share_above_0.9']:.0f}%*" for m in models]])
    header = ["attention at inference", *[f"{m['name']}, test BLEU" for m in models]]
    return markdown(header, rows, "l" + "r" * len(models)) + "\n\n" + caption(results)


def main() -> None:
    p = parser(__doc__, threads=1)
    p.add_argument("--transformer", default=str(BENCHMARK_TRANSFORMER), help="trained Transformer run directory")
    p.add_argument("--rnn", default=str(BENCHMARK_RNN_ATTENTION),
                   help="trained RNN-with-attention run directory (skipped until its training has finished)")
    p.add_argument("--sentences", type=int, default=0, help="first N test sentences (0 = all 1,000)")
    p.add_argument("--peak-sentences", type=int, default=100, help="sentences for the peakedness statistic")
    p.add_argument("--beam", type=int, default=1, help="beam size (1 = greedy)")
    args = p.parse_args()
    rec = start("hard_soft", args)
    pairs = test_pairs(args.sentences)
    models = [evaluate("Transformer", require_run(Path(args.transformer)), pairs, args.beam, args.peak_sentences)]
    rnn_dir = Path(args.rnn)
    if (rnn_dir / "averaged.safetensors").exists():  # written when training ends
        models.append(evaluate("RNN + Bahdanau", rnn_dir, pairs, args.beam, args.peak_sentences))
    else:
        print(f"{rnn_dir}: training not finished (no averaged.safetensors); RNN skipped")
    rec.results = {"test": "test_2016_flickr", "sentences": len(pairs), "beam": args.beam, "models": models}
    rec.figure(figure(models, len(pairs)))
    rec.write()


if __name__ == "__main__":
    main()
