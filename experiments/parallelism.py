"""Section 4 (seed 004: "the Transformer in one word is parallelisation"; Vaswani et al. Table 1).

Table 1 of the paper, per layer, for sequence length n and width d:

==========================  =====================  ===================  ===================
layer type                  complexity per layer   sequential ops       max path length
==========================  =====================  ===================  ===================
self-attention              O(n^2 d)               O(1)                 O(1)
recurrent                   O(n d^2)               O(n)                 O(n)
convolutional (kernel k)    O(k n d^2)             O(1)                 O(log_k n)
==========================  =====================  ===================  ===================

Measured here, on the machine's cores:

1. Training throughput of the RNN with Bahdanau attention and the Transformer at a comparable
   parameter count (Transformer small 7.6M; the RNN config with ``hidden_size`` 256: 8.1M), each
   trained by attnkit's Trainer on the same first epoch of batches (at most ``--minutes``,
   default 5): target tokens/s, time per epoch (epoch target tokens / tokens/s) and the time steps
   each update must run one after another (RNN: source length + target length; Transformer: none,
   every position of a layer at once; decoding is sequential in the output length for both).
2. One layer, forward + backward, float32, batch 32, d 256, for n = 8 .. 256: a GRU layer (torch's,
   as in the RNN's encoder) against attnkit's multi-head self-attention (Table 1's two rows).

Timing needs the machine to itself: run it when nothing else is training.

    python experiments/parallelism.py                 # one epoch per model + layer timing

Writes docs/figures/parallelism.{json,png}.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import (
    RNN_ATTENTION_CONFIG,
    TRANSFORMER_CONFIG,
    caption,
    markdown,
    num,
    parser,
    start,
)
from matplotlib.figure import Figure
from torch import nn

from attnkit import MultiHeadAttention
from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig
from attnkit.training.trainer import Trainer

MODELS = {
    "rnn-attention": ("RNN + Bahdanau attention (GRU, hidden 256)", RNN_ATTENTION_CONFIG,
                      ["model.rnn.hidden_size=256"]),
    "transformer": ("Transformer small (d_model 256, 3+3 layers)", TRANSFORMER_CONFIG, []),
}
LENGTHS = (8, 16, 32, 64, 128, 256)
TABLE_1 = [
    {"layer": "self-attention", "complexity": "O(n^2 d)", "sequential": "O(1)", "max_path": "O(1)"},
    {"layer": "recurrent", "complexity": "O(n d^2)", "sequential": "O(n)", "max_path": "O(n)"},
    {"layer": "convolutional", "complexity": "O(k n d^2)", "sequential": "O(1)", "max_path": "O(log_k n)"},
]


def training_throughput(config: Path, overrides: list[str], seconds: float, run_dir: Path) -> dict:
    """Train with attnkit's Trainer for ``seconds`` (after 2 untimed warm-up updates); tokens/s and sequential steps."""
    cfg = load_config(RunConfig, config, [*overrides, "train.progress=false"])
    trainer = Trainer(cfg, run_dir, log=lambda msg: None)
    task, arch = trainer.task, cfg.model.arch
    batches = task.batches(0)
    trainer.model.train()
    for b in batches[:2]:
        trainer.train_step([b])
    targets, updates, steps = 0, 0, []
    src_lens, tgt_lens = task.lengths(task.src, task.tgt)  # as the model reads them: x </s>, <s> y
    start = time.perf_counter()
    for b in batches[2:]:
        targets += trainer.train_step([b])[1]
        trainer.step += 1  # the schedule's warm-up advances as in a real run
        updates += 1
        S, T = int(src_lens[b].max()), int(tgt_lens[b].max())
        steps.append(S + T if arch == "rnn" else 0)  # RNN: encoder over S, decoder over T, one step at a time
        if time.perf_counter() - start >= seconds:
            break
    elapsed = time.perf_counter() - start
    epoch_targets = int(tgt_lens.sum())
    tok_s = targets / elapsed
    return {"parameters": sum(p.numel() for p in trainer.model.parameters()), "updates": updates,
            "seconds": round(elapsed, 1), "target_tokens_per_second": round(tok_s, 1),
            "epoch_target_tokens": epoch_targets, "epoch_minutes": round(epoch_targets / tok_s / 60, 2),
            "sequential_steps_per_update": round(statistics.mean(steps), 1), "bf16": trainer.bf16,
            "threads": torch.get_num_threads()}


def time_layer(layer: nn.Module, x: torch.Tensor, repeats: int) -> float:
    """Median milliseconds of one forward + backward pass of ``layer`` on ``x`` ``(B, n, d)``."""
    times = []
    for _ in range(repeats + 1):  # the first pass warms up and is dropped
        start = time.perf_counter()
        out = layer(x)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def layer_timing(d: int, heads: int, batch: int, repeats: int, lengths: tuple[int, ...] = LENGTHS) -> list[dict]:
    torch.manual_seed(0)
    gru = nn.GRU(d, d, batch_first=True)
    attention = MultiHeadAttention(d, heads)  # Table 1's self-attention layer: Q, K, V, W^O projections + attention
    rows = []
    for n in lengths:
        x = torch.randn(batch, n, d)
        rows.append({"n": n, "gru_ms": round(time_layer(gru, x, repeats), 2),
                     "self_attention_ms": round(time_layer(attention, x, repeats), 2),
                     "flops_ratio_n2d_over_nd2": round(n / d, 3)})
        print(f"n {n:4d}: GRU {rows[-1]['gru_ms']:8.2f} ms, self-attention {rows[-1]['self_attention_ms']:8.2f} ms")
    return rows


def figure(models: dict, layers: list[dict], d: int, batch: int) -> Figure:
    fig = Figure(figsize=(12, 4.6), layout="constrained")
    ax_tok, ax_layer = fig.subplots(1, 2)
    names = list(models)
    # the details in brackets on a line of their own, so neighbouring labels do not overlap
    labels = [models[k]["label"].replace(" (", "\n(") + f"\n{models[k]['parameters'] / 1e6:.1f}M parameters"
              for k in names]
    values = [models[k]["target_tokens_per_second"] for k in names]
    ax_tok.bar(labels, values, color=["tab:orange", "tab:blue"][: len(names)])
    for x, k in enumerate(names):
        m = models[k]
        ax_tok.text(x, values[x], f"{values[x]:.0f} tok/s\nepoch {m['epoch_minutes']:.1f} min\n"
                    f"{m['sequential_steps_per_update']:.0f} sequential steps/update", ha="center", va="bottom")
    ax_tok.set(title="training throughput, Multi30k de->en", ylabel="target tokens per second",
               ylim=(0, max(values) * 1.35))
    ns = [r["n"] for r in layers]
    ax_layer.loglog(ns, [r["gru_ms"] for r in layers], "o-", color="tab:orange", label="GRU layer (recurrent)")
    ax_layer.loglog(ns, [r["self_attention_ms"] for r in layers], "s-", color="tab:blue",
                    label="multi-head self-attention layer")
    ax_layer.set(title=f"one layer, forward + backward (batch {batch}, d {d})",
                 xlabel="sequence length n (tokens, log scale)", ylabel="time (ms, log scale)")
    ax_layer.grid(True, which="both", alpha=0.3)
    ax_layer.legend()
    fig.suptitle("Parallelism: recurrent vs self-attention on the CPU")
    return fig


def markdown_table(results: dict) -> str:
    """docs/experiments.md 4: training throughput of the RNN and the Transformer on the same batches."""
    rows = [[m["label"], f"{m['parameters'] / 1e6:.2f}M", num(m["target_tokens_per_second"]),
             f"{m['epoch_minutes']:.2f} min", f"{m['sequential_steps_per_update']:g}"]
            for m in results["models"].values()]
    header = ["model", "parameters", "target tok/s", "epoch", "steps in sequence per update"]
    return markdown(header, rows, "lrrrr") + "\n\n" + caption(results)


def markdown_layers(results: dict) -> str:
    """docs/experiments.md 4: one GRU layer against one self-attention layer, forward + backward, per length."""
    timing = results["layer_timing"]
    rows = timing["rows"]
    table = [["GRU layer, ms", *[f"{r['gru_ms']:.2f}" for r in rows]],
             ["self-attention layer, ms", *[f"{r['self_attention_ms']:.2f}" for r in rows]],
             ["GRU / self-attention", *[f"{r['gru_ms'] / r['self_attention_ms']:.1f}x" for r in rows]],
             ["Table 1's arithmetic ratio n^2 d / (n d^2) = n / d", *[f"{r['n'] / timing['d']:.2g}" for r in rows]]]
    header = ["n (tokens)", *[str(r["n"]) for r in rows]]
    return markdown(header, table, "l" + "r" * len(rows)) + "\n\n" + caption(results)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=5.0,
                   help="training time per model for the throughput (at most one epoch)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="sequence lengths of the layer timing")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every model")
    p.add_argument("--d", type=int, default=256, help="layer width for the layer timing")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="timed passes per length (median)")
    args = p.parse_args()
    rec = start("parallelism", args)
    models = {}
    for key in args.models:
        label, config, overrides = MODELS[key]
        with tempfile.TemporaryDirectory(prefix=f"attnkit-parallelism-{key}-") as tmp:
            models[key] = {"label": label, "config": config.name, "overrides": [*overrides, *args.set],
                           **training_throughput(config, [*overrides, *args.set], 60 * args.minutes, Path(tmp))}
        print(f"{label}: {models[key]}")
    layers = layer_timing(args.d, args.heads, args.batch, args.repeats, tuple(args.lengths))
    rec.results = {"minutes_per_model": args.minutes, "models": models, "table_1": TABLE_1,
                   "layer_timing": {"d": args.d, "heads": args.heads, "batch": args.batch, "rows": layers}}
    rec.figure(figure(models, layers, args.d, args.batch))
    rec.write()


if __name__ == "__main__":
    main()
