"""Section 6 (seed 003): self-attention without W^Q, W^K, W^V puts most of a word's attention on itself.

Seed 003: with Q = K = V = the raw embeddings, a word's dot product with itself dominates its
dot products with the others, so self-attention mostly returns the word itself; the learned
projections W^Q, W^K, W^V are what let a word look at other words.

Measured on the trained Transformer (runs/multi30k-de-en) over Multi30k dev sentences: the
attention weight each source token puts on itself (the diagonal of the self-attention matrix),
averaged over real tokens (``</s>`` included), for

- ``raw, scaled``: ``softmax(X X^T / sqrt(d_model)) X`` with X = the encoder's input (scaled token
  embedding + sinusoidal positions), through :func:`attnkit.attend`;
- ``raw, unscaled``: the same without the scale (``score="dot"``);
- ``raw, embeddings only``: X = the token embeddings without positions, scaled;
- ``learned (layer 1)``: the trained encoder's first self-attention layer, which reads the very
  same X through W^Q, W^K, W^V; mean over its heads and per head;
- ``uniform``: 1 / sentence length, what a word would get with no preference.

    python experiments/no_projection.py

Writes docs/figures/no_projection.json (with the run time),
no_projection.png and no_projection-example.png.
"""

from __future__ import annotations

import torch
from common import BENCHMARK_TRANSFORMER, caption, markdown, parser, start, transformer_on_dev
from matplotlib.figure import Figure
from torch import Tensor

from attnkit import attend
from attnkit.data.tokenizer import PAD_ID
from attnkit.transformer import Transformer
from attnkit.viz.plot import attention_grid

SETTINGS = ("raw, scaled", "raw, unscaled", "raw, embeddings only", "learned (layer 1, mean of heads)")


def self_attention_maps(model: Transformer, src: Tensor) -> dict[str, Tensor]:
    """Self-attention weights ``(B, S, S)`` per setting (module docstring) and ``"head h"`` ``(B, S, S)`` per head."""
    enc = model.encoder
    embedded = enc.embed(src)  # (B, S, d_model), x sqrt(d_model)
    x = embedded + enc.positions(src.size(1))  # the first encoder layer's input (post-norm: read as it is)
    mask = (src != PAD_ID)[:, None, :]  # (B, 1, S) True at real keys
    _, _, learned = enc(src, need_weights=True)  # per layer (B, H, S, S)
    maps = {
        "raw, scaled": attend(x, x, x, mask, score="scaled_dot")[1],
        "raw, unscaled": attend(x, x, x, mask, score="dot")[1],
        "raw, embeddings only": attend(embedded, embedded, embedded, mask, score="scaled_dot")[1],
        "learned (layer 1, mean of heads)": learned[0].mean(dim=1),
    }
    maps |= {f"learned head {h}": learned[0][:, h] for h in range(learned[0].size(1))}
    return maps


def on_self(weights: Tensor, real: Tensor) -> tuple[Tensor, Tensor]:
    """Per real token: the weight it puts on itself, and whether itself is its largest weight."""
    diagonal = weights.diagonal(dim1=-2, dim2=-1)  # (B, S)
    is_argmax = weights.argmax(dim=-1) == torch.arange(weights.size(-1))  # (B, S)
    return diagonal[real], is_argmax[real]


def measure(model: Transformer, batches: list[Tensor]) -> dict[str, dict[str, float]]:
    mass: dict[str, list[Tensor]] = {}
    top: dict[str, list[Tensor]] = {}
    for src in batches:
        real = src != PAD_ID  # (B, S)
        for name, w in self_attention_maps(model, src).items():
            diagonal, is_argmax = on_self(w, real)
            mass.setdefault(name, []).append(diagonal)
            top.setdefault(name, []).append(is_argmax.float())
        uniform = (1.0 / real.sum(dim=1, keepdim=True).float()).expand_as(real)[real]
        mass.setdefault("uniform (1 / length)", []).append(uniform)
    return {name: {"mean_weight_on_self": round(float(torch.cat(v).mean()), 4),
                   **({"self_is_argmax_share": round(float(torch.cat(top[name]).mean()), 4)} if name in top else {})}
            for name, v in mass.items()}


def bars_figure(results: dict[str, dict[str, float]], n_sentences: int) -> Figure:
    names = list(results)
    fig = Figure(figsize=(10, 5.2), layout="constrained")
    ax = fig.subplots()
    values = [results[n]["mean_weight_on_self"] for n in names]
    colors = ["tab:red" if n.startswith("raw") else "tab:gray" if n.startswith("uniform") else "tab:blue"
              for n in names]
    ax.barh(names, values, color=colors)
    for y, v in enumerate(values):
        ax.text(v + 0.01, y, f"{v:.2f}", va="center")
    ax.invert_yaxis()
    ax.set(xlim=(0, 1.1), xlabel="mean attention weight a token puts on itself (0..1)",
           title=f"Self-attention on the encoder input, {n_sentences} Multi30k dev sentences:\n"
                 f"raw Q = K = V (red) vs learned W^Q, W^K, W^V (blue)")
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def example_figure(model: Transformer, src: Tensor, pieces: list[str], sentence: str) -> Figure:
    maps = self_attention_maps(model, src)
    stacked = torch.stack([maps["raw, scaled"][0], maps["learned (layer 1, mean of heads)"][0]])  # (2, S, S)
    fig = attention_grid(stacked, pieces, pieces, title=f"Encoder self-attention: {sentence}",
                         axis_names=("key (source piece)", "query (source piece)"))
    for ax, name in zip(fig.axes, ("raw Q = K = V = X (scaled)", "learned layer 1 (mean of heads)"), strict=False):
        ax.set_title(name)  # the grid titles panels "head h"; these panels are two settings
    return fig


#: How docs/experiments.md names each setting of ``results``.
LABELS = {"raw, scaled": "raw, `softmax(X X^T / sqrt(d)) X`", "raw, unscaled": "raw, unscaled `softmax(X X^T) X`",
          "raw, embeddings only": "raw, embeddings only (no positions), scaled",
          "learned (layer 1, mean of heads)": "**learned W^Q, W^K, W^V, layer 1, mean of heads**",
          "uniform (1 / length)": "uniform (1 / sentence length)"}


def markdown_table(results: dict) -> str:
    """docs/experiments.md 6: the weight each piece puts on itself, raw X against the learned projections."""
    rows = []
    for name, r in results["results"].items():
        share = r.get("self_is_argmax_share")
        rows.append([LABELS.get(name, name), f"{r['mean_weight_on_self']:.3f}",
                     "" if share is None else f"{100 * share:.2f}%"])
    header = ["self-attention on X", "mean weight on itself", "share where itself is the largest weight"]
    return markdown(header, rows, "lrr") + "\n\n" + caption(results)


def main() -> None:
    p = parser(__doc__, threads=1)
    p.add_argument("--run", default=str(BENCHMARK_TRANSFORMER), help="trained Transformer run directory")
    p.add_argument("--sentences", type=int, default=0, help="first N dev sentences (0 = all 1,014)")
    p.add_argument("--example", type=int, default=3, help="dev sentence (0-based) drawn in the example figure")
    args = p.parse_args()
    rec = start("no_projection", args)
    dev = transformer_on_dev(args.run, args.sentences)
    run, sources, ids, batches = dev.run, dev.sources, dev.ids, dev.batches
    with torch.inference_mode():
        results = measure(run.model, batches)
        example = torch.tensor([ids[args.example]])
        rec.figure(example_figure(run.model, example, run.tok.src_pieces_from_ids(ids[args.example]),
                                  sources[args.example]), "-example")
    for name, r in results.items():
        print(f"{name:36s} {r}")
    rec.results = {"run": args.run, "weights": run.weights_path.name, "dev_sentences": len(sources),
                   "tokens": sum(len(s) for s in ids), "d_model": run.model.cfg.d_model,
                   "n_heads": run.model.cfg.n_heads, "results": results}
    rec.figure(bars_figure(results, len(sources)))
    rec.write()


if __name__ == "__main__":
    main()
