"""Section 3 (seeds 000, 004): one head vs several, and what different heads attend to.

Seeds 000/004: multi-head attention splits d_model into h heads of d_k = d_model / h that attend
in parallel, each free to look at a different relation; the paper (Table 3, row A) finds 1 head
0.9 BLEU worse than 8, and too many heads worse again.

1. ``--train`` (default on): Transformer small (configs/multi30k-de-en.yaml, d_model 256) with
   ``n_heads`` 1, 4 and 8 (d_k 256, 64, 32) at equal d_model and parameter count, the same
   ``--minutes`` each; test BLEU (beam ``--beam``) and training speed.
2. Always: on a trained run (``--figure-run``, default the 60-min benchmark model, 4 heads), the
   per-head attention of one sentence (encoder self-attention of layer 1, cross-attention of the
   last layer), and a profile of every encoder head over dev sentences: where its largest
   weight falls (previous piece, itself, next piece, elsewhere) and its mean entropy.

    python experiments/heads.py --skip-training     # 2. only: no training
    python experiments/heads.py                     # 1. + 2.: 3 x 15 min training, then decoding

Writes docs/figures/heads.json, heads-profile.png, heads-encoder-self.png, heads-cross.png and,
with training, heads.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import (
    BENCHMARK_TRANSFORMER,
    ROOT,
    TRANSFORMER_CONFIG,
    Recorder,
    caption,
    markdown,
    num,
    parser,
    score_run,
    start,
    test_pairs,
    train_for,
    transformer_on_dev,
)
from matplotlib.figure import Figure
from torch import Tensor

from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig
from attnkit.data.tokenizer import PAD_ID
from attnkit.tasks import attention_maps
from attnkit.transformer import Transformer
from attnkit.viz.figures import attention_figures

HEADS = (1, 4, 8)
RELATIONS = ("previous", "self", "next", "</s>", "elsewhere")
LEGEND = {"previous": "largest weight on the previous piece", "self": "largest weight on itself",
          "next": "largest weight on the next piece", "</s>": "largest weight on </s>",
          "elsewhere": "largest weight elsewhere"}


def relation_counts(weights: Tensor, real: Tensor) -> Tensor:
    """``(H, 5)``: real query tokens whose largest weight is on each of :data:`RELATIONS` (first match wins).

    :param weights: one layer's encoder self-attention ``(B, H, S, S)``; ``real``: ``(B, S)`` True at real tokens.
    """
    top = weights.argmax(dim=-1)  # (B, H, S)
    offset = top - torch.arange(weights.size(-1))  # key - query position
    end = (real.sum(dim=1) - 1)[:, None, None]  # (B, 1, 1) position of </s>
    kinds = torch.full_like(offset, len(RELATIONS) - 1)
    for kind, where in reversed(list(enumerate((offset == -1, offset == 0, offset == 1, top == end)))):
        kinds[where] = kind
    one_hot = torch.nn.functional.one_hot(kinds, len(RELATIONS)) * real[:, None, :, None]  # (B, H, S, 5)
    return one_hot.sum(dim=(0, 2))  # (H, 5)


def head_profile(model: Transformer, batches: list[Tensor]) -> list[dict]:
    """Per encoder layer and head: the share of tokens per relation (:data:`RELATIONS`) and the mean entropy (nats)."""
    counts: dict[int, Tensor] = {}
    entropy: dict[int, Tensor] = {}
    for src in batches:
        real = src != PAD_ID  # (B, S)
        _, _, layers = model.encoder(src, need_weights=True)  # per layer (B, H, S, S)
        for i, w in enumerate(layers):
            counts[i] = counts.get(i, 0) + relation_counts(w, real)
            h = -(w * w.clamp_min(1e-30).log()).sum(-1)  # (B, H, S) nats
            entropy[i] = entropy.get(i, 0) + (h * real[:, None]).sum(dim=(0, 2))
    n_tokens = sum(int((src != PAD_ID).sum()) for src in batches)
    rows = []
    for i in counts:
        share = counts[i].float() / n_tokens  # (H, 4)
        for head in range(share.size(0)):
            rows.append({"layer": i + 1, "head": head, "entropy_nats": round(float(entropy[i][head]) / n_tokens, 3),
                         **{r: round(float(share[head, j]), 4) for j, r in enumerate(RELATIONS)}})
    return rows


def profile_figure(rows: list[dict], n_sentences: int) -> Figure:
    fig = Figure(figsize=(10, 4.8), layout="constrained")
    ax = fig.subplots()
    labels = [f"L{r['layer']} h{r['head']}" for r in rows]
    bottom = [0.0] * len(rows)
    for relation in RELATIONS:
        values = [r[relation] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=LEGEND[relation])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(title=f"What each encoder self-attention head attends to most ({n_sentences} Multi30k dev sentences)",
           xlabel="encoder layer L, head h", ylabel="share of source tokens (0..1)", ylim=(0, 1))
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def training_figure(models: list[dict], minutes: float) -> Figure:
    fig = Figure(figsize=(10, 4.4), layout="constrained")
    ax_bleu, ax_speed = fig.subplots(1, 2)
    labels = [f"{m['n_heads']} head{'s' if m['n_heads'] > 1 else ''}\n(d_k {m['d_k']})" for m in models]
    ax_bleu.bar(labels, [m["bleu"] for m in models], color="tab:blue")
    ax_bleu.set(title="test BLEU (test_2016_flickr)", ylabel="BLEU", xlabel="heads at d_model 256")
    ax_speed.bar(labels, [m["updates_per_minute"] for m in models], color="tab:orange")
    ax_speed.set(title="training speed", ylabel="updates per minute (4,096-token batches)",
                 xlabel="heads at d_model 256")
    for ax, key in ((ax_bleu, "bleu"), (ax_speed, "updates_per_minute")):
        for x, m in enumerate(models):
            ax.text(x, m[key], f"{m[key]:.1f}", ha="center", va="bottom")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Transformer small, Multi30k de->en, {minutes:g} min of training each")
    return fig


def train_and_score(args: argparse.Namespace, rec: Recorder) -> list[dict]:
    pairs = test_pairs(args.sentences)
    models = []
    for h in HEADS:
        run = train_for(f"{h} heads", TRANSFORMER_CONFIG, Path(args.runs) / f"exp-heads-{h}", args.minutes,
                        [f"model.transformer.n_heads={h}", *args.set])
        _, score = score_run(run.run_dir, pairs, args.beam)
        d_model = load_config(RunConfig, run.run_dir / "config.yaml").model.transformer.d_model
        models.append({"n_heads": h, "d_k": d_model // h, "run_dir": str(run.run_dir), "train_minutes": run.minutes,
                       "updates": run.updates, "updates_per_minute": round(run.updates / max(run.minutes, 1e-9), 1),
                       "parameters": run.parameters, "bleu": score,
                       "final_valid_bleu": run.curve[-1].get("valid_bleu")})
        print(f"{h} heads: BLEU {score:.2f}, {run.updates} updates in {run.minutes:.1f} min")
    rec.figure(training_figure(models, args.minutes))
    return models


RELATIONS = ("previous", "self", "next", "</s>", "elsewhere")


def markdown_profile(results: dict) -> str:
    """docs/experiments.md 3: where each encoder self-attention head puts its largest weight."""
    rows = [[f"{r['layer']}.{r['head']}", *[f"{r[k]:.2f}" for k in RELATIONS], f"{r['entropy_nats']:.2f}"]
            for r in results["encoder_head_profile"]]
    header = ["layer.head", "previous", "itself", "next", "`</s>`", "elsewhere", "entropy (nats)"]
    return markdown(header, rows, "l" + "r" * 6) + "\n\n" + caption(results)


def markdown_table(results: dict) -> str:
    """docs/experiments.md 3: 1, 4 and 8 heads trained for the same minutes."""
    rows = [[f"{m['n_heads']} ({m['d_k']})", num(m["updates"]), f"{m['updates_per_minute']:.1f}",
             f"{m['final_valid_bleu']:.2f}", f"{m['bleu']:.2f}", f"{m['parameters'] / 1e6:.2f}M"]
            for m in results["models"]]
    header = ["heads (d_k)", f"updates in {results['minutes_budget']:g} min", "updates / min", "dev BLEU, end",
              f"test BLEU (beam {results['beam']})", "parameters"]
    return markdown(header, rows, "lrrrrr") + "\n\n" + caption(results)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--skip-training", action="store_true", help="only the figures of --figure-run")
    p.add_argument("--minutes", type=float, default=15.0, help="training budget per model (wall clock)")
    p.add_argument("--runs", default=str(ROOT / "runs"), help="where trained run directories go")
    p.add_argument("--sentences", type=int, default=0, help="first N test sentences (0 = all 1,000)")
    p.add_argument("--beam", type=int, default=4, help="beam size (1 = greedy)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every model")
    p.add_argument("--figure-run", default=str(BENCHMARK_TRANSFORMER), help="trained Transformer for the figures")
    p.add_argument("--dev-sentences", type=int, default=500, help="dev sentences for the head profile")
    p.add_argument("--example", type=int, default=3, help="dev sentence (0-based) drawn per head")
    args = p.parse_args()
    rec = start("heads", args)
    dev = transformer_on_dev(args.figure_run, args.dev_sentences)
    run, sources = dev.run, dev.sources
    with torch.inference_mode():
        profile = head_profile(run.model, dev.batches)
    rec.figure(profile_figure(profile, len(sources)), "-profile")
    figures = dict(attention_figures(attention_maps(run, sources[args.example]), [0, -1]))
    last = run.model.cfg.decoder_layers - 1
    rec.figure(figures["encoder-self-layer0-heads"], "-encoder-self")
    rec.figure(figures[f"cross-layer{last}-heads"], "-cross")
    rec.results = {"figure_run": args.figure_run, "weights": run.weights_path.name, "dev_sentences": len(sources),
                   "example_sentence": sources[args.example], "encoder_head_profile": profile}
    if not args.skip_training:
        rec.results |= {"minutes_budget": args.minutes, "test_sentences": args.sentences or 1000, "beam": args.beam,
                        "overrides": args.set, "models": train_and_score(args, rec)}
    rec.write()


if __name__ == "__main__":
    main()
