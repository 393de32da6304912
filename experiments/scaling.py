"""Section 2 (seed 003): why scaled dot-product attention divides by sqrt(d_k).

(a) For q, k with independent components of mean 0 and variance 1, ``var(q.k) = d_k``: measured
    on random vectors for d_k in {16, 64, 256, 1024} against that theory.
(b) Softmax over T keys with and without the scale: the largest weight, the entropy, the share
    of saturated queries (largest weight > 0.99) and the norm of the gradient that reaches the
    logits through the softmax (``d loss / d e`` for a random unit-variance upstream gradient).
(c) ``--train``: the same small Transformer (configs/multi30k-de-en.yaml) trained with
    ``model.transformer.attention_score`` scaled_dot and dot, the same ``--minutes`` each:
    dev BLEU / loss curves.

    python experiments/scaling.py                      # (a) + (b): random vectors, no training
    python experiments/scaling.py --train              # (c): 2 x 15 min of training

Writes docs/figures/scaling.{json,png} ((a)+(b)) and docs/figures/scaling-training.{json,png} ((c)).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from common import ROOT, TRANSFORMER_CONFIG, Recorder, TrainedRun, caption, markdown, num, parser, start, train_for
from matplotlib.figure import Figure

from attnkit import dot_score, scaled_dot_score, soft_attention

DIMS = (16, 64, 256, 1024)
SCORES = {"dot": dot_score, "scaled_dot": scaled_dot_score}


def dot_product_variance(d_k: int, n: int, generator: torch.Generator) -> float:
    """Sample variance of ``q.k`` over ``n`` pairs of N(0, I_{d_k}) vectors (theory: ``d_k``)."""
    q = torch.randn(n, d_k, generator=generator, dtype=torch.float64)
    k = torch.randn(n, d_k, generator=generator, dtype=torch.float64)
    return float((q * k).sum(-1).var())


def softmax_statistics(d_k: int, score: str, queries: int, keys: int, generator: torch.Generator) -> dict:
    """Saturation and gradient of ``softmax(score(q, k))`` over ``keys`` random unit-variance keys."""
    q = torch.randn(queries, 1, d_k, generator=generator)  # (N, 1, d_k): one query per row
    k = torch.randn(queries, keys, d_k, generator=generator)  # (N, T, d_k)
    e = SCORES[score](q, k).detach().requires_grad_(True)  # (N, 1, T) logits
    weights = soft_attention(e)  # (N, 1, T)
    upstream = torch.randn(weights.shape, generator=generator)  # a random unit-variance dL/d(weights)
    (grad,) = torch.autograd.grad((weights * upstream).sum(), e)  # (N, 1, T) dL/de through the softmax
    w = weights.detach().squeeze(1)  # (N, T)
    largest = w.max(-1).values
    entropy = -(w * w.clamp_min(1e-30).log()).sum(-1)
    return {
        "logit_std": round(float(e.detach().std()), 3),
        "mean_max_weight": round(float(largest.mean()), 4),
        "saturated_share": round(float((largest > 0.99).float().mean()), 4),
        "mean_entropy_nats": round(float(entropy.mean()), 4),
        "mean_logit_grad_norm": float(f"{float(grad.squeeze(1).norm(dim=-1).mean()):.4g}"),
    }


def statistics_figure(variance: dict, softmax: dict, keys: int) -> Figure:
    fig = Figure(figsize=(15, 4.4), layout="constrained")
    ax_var, ax_max, ax_grad = fig.subplots(1, 3)
    dims = list(DIMS)
    ax_var.loglog(dims, dims, "k--", label="theory: var = d_k")
    ax_var.loglog(dims, [variance[d]["dot"] for d in dims], "o-", label="measured q.k")
    ax_var.loglog(dims, [variance[d]["scaled_dot"] for d in dims], "s-", label="measured q.k / sqrt(d_k)")
    ax_var.set(title="(a) variance of the dot product", xlabel="d_k (dimensions, log scale)",
               ylabel="variance of the logit (log scale)")
    for score, marker in (("dot", "o-"), ("scaled_dot", "s-")):
        label = "q.k" if score == "dot" else "q.k / sqrt(d_k)"
        ax_max.semilogx(dims, [softmax[d][score]["mean_max_weight"] for d in dims], marker, label=label)
        ax_grad.loglog(dims, [softmax[d][score]["mean_logit_grad_norm"] for d in dims], marker, label=label)
    ax_max.axhline(1 / keys, color="gray", linestyle=":", label=f"uniform (1/{keys})")
    ax_max.set(title=f"(b) softmax saturation ({keys} keys)", xlabel="d_k (dimensions, log scale)",
               ylabel="mean largest attention weight", ylim=(0, 1.05))
    ax_grad.set(title="(b) gradient reaching the logits", xlabel="d_k (dimensions, log scale)",
                ylabel="mean ||d loss / d logits|| (log scale)")
    for ax in (ax_var, ax_max, ax_grad):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("Why scale by 1/sqrt(d_k): random unit-variance queries and keys")
    return fig


def run_statistics(args: argparse.Namespace, rec: Recorder) -> None:
    g = torch.Generator().manual_seed(args.seed)
    variance = {}
    for d in DIMS:
        raw = dot_product_variance(d, args.pairs, g)
        variance[d] = {"theory": d, "dot": round(raw, 2), "scaled_dot": round(raw / d, 4)}
        print(f"d_k {d:5d}: var(q.k) {raw:9.2f} (theory {d}); var(q.k / sqrt(d_k)) {raw / d:.4f} (theory 1)")
    softmax = {d: {s: softmax_statistics(d, s, args.queries, args.keys, g) for s in SCORES} for d in DIMS}
    for d in DIMS:
        for s, st in softmax[d].items():
            print(f"d_k {d:5d} {s:10s}: {st}")
    rec.results = {"pairs": args.pairs, "queries": args.queries, "keys": args.keys, "seed": args.seed,
                   "max_entropy_nats": round(math.log(args.keys), 4), "variance": variance, "softmax": softmax}
    rec.figure(statistics_figure(variance, softmax, args.keys))
    rec.write()


# --------------------------------------------------------------------------------------
# (c) training with and without the scale
# --------------------------------------------------------------------------------------


def curves_figure(runs: list[TrainedRun], minutes: float) -> Figure:
    fig = Figure(figsize=(11, 4.4), layout="constrained")
    ax_bleu, ax_loss = fig.subplots(1, 2)
    for run in runs:
        t = [r["minutes"] for r in run.curve]
        ax_bleu.plot(t, [r.get("valid_bleu", float("nan")) for r in run.curve], "o-", label=run.name)
        ax_loss.plot(t, [r["valid_loss"] for r in run.curve], "o-", label=run.name)
    ax_bleu.set(title="dev BLEU (greedy, first dev sentences)", xlabel="training time (minutes, 2 CPU cores)",
                ylabel="BLEU")
    ax_loss.set(title="dev loss", xlabel="training time (minutes, 2 CPU cores)", ylabel="cross-entropy (nats/token)")
    for ax in (ax_bleu, ax_loss):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"Transformer small on Multi30k de->en, {minutes:g} min each: with and without 1/sqrt(d_k)")
    return fig


def run_training(args: argparse.Namespace, rec: Recorder) -> None:
    runs = []
    for score in ("scaled_dot", "dot"):
        run_dir = Path(args.runs) / f"exp-scaling-{score}"
        runs.append(train_for(f"attention_score={score}", TRANSFORMER_CONFIG, run_dir, args.minutes,
                              [f"model.transformer.attention_score={score}", *args.set], args.valid_every))
    rec.results = {
        "minutes_budget": args.minutes, "config": str(TRANSFORMER_CONFIG.relative_to(ROOT)), "overrides": args.set,
        "runs": [{"name": r.name, "run_dir": str(r.run_dir), "train_minutes": r.minutes, "updates": r.updates,
                  "parameters": r.parameters, "final_valid_bleu": r.curve[-1].get("valid_bleu"),
                  "final_valid_loss": r.curve[-1]["valid_loss"], "curve": r.curve} for r in runs],
    }
    rec.figure(curves_figure(runs, args.minutes))
    rec.write()


def markdown_table(results: dict) -> str:
    """docs/experiments.md 2(a)+(b): variance of q.k and softmax statistics per d_k, unscaled and scaled."""
    rows = []
    for d_k, var in results["variance"].items():
        dot, scaled = results["softmax"][d_k]["dot"], results["softmax"][d_k]["scaled_dot"]
        rows.append([d_k, f"{var['dot']:.2f}", var["theory"], f"{var['scaled_dot']:.4f}",
                     f"{dot['logit_std']:.1f}", f"{dot['mean_max_weight']:.3f}", f"{scaled['mean_max_weight']:.3f}",
                     f"{100 * dot['saturated_share']:.1f}%",
                     f"{dot['mean_entropy_nats']:.2f} / {scaled['mean_entropy_nats']:.2f}",
                     f"{dot['mean_logit_grad_norm']:.3f} / {scaled['mean_logit_grad_norm']:.3f}"])
    header = ["d_k", "var(q.k) measured", "theory", "var(q.k/sqrt(d_k))", "logit std, unscaled",
              "largest weight, unscaled", "largest weight, scaled", "saturated (> 0.99), unscaled",
              f"entropy unscaled / scaled (nats; max ln {results['keys']} = {results['max_entropy_nats']:.2f})",
              "gradient norm at the logits, unscaled / scaled"]
    return markdown(header, rows, "r" * len(header)) + "\n\n" + caption(results)


def markdown_training(results: dict) -> str:
    """docs/experiments.md 2(c): the same Transformer trained with and without the 1/sqrt(d_k) scale."""
    formula = {"scaled_dot": "softmax(QK^T / sqrt(d_k))", "dot": "softmax(QK^T)"}
    rows = []
    for run in results["runs"]:
        score = run["name"].split("=")[1]
        rows.append([f"`{score}`: {formula.get(score, '')}", num(run["updates"]), f"{run['train_minutes']:.1f}",
                     f"{run['final_valid_loss']:.2f}", f"{run['final_valid_bleu']:.2f}"])
    header = ["attention score", "updates", "minutes", "dev loss", "dev BLEU (greedy, first dev sentences)"]
    return markdown(header, rows, "lrrrr") + "\n\n" + caption(results)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--pairs", type=int, default=200_000, help="(a) random (q, k) pairs per d_k")
    p.add_argument("--queries", type=int, default=4096, help="(b) random queries per d_k")
    p.add_argument("--keys", type=int, default=32, help="(b) keys per query (~ a Multi30k sentence in subwords)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", action="store_true", help="(c) train with and without the scale instead of (a)+(b)")
    p.add_argument("--minutes", type=float, default=15.0, help="(c) training budget per model")
    p.add_argument("--valid-every", type=int, default=150, help="(c) updates between dev validations")
    p.add_argument("--runs", default=str(ROOT / "runs"), help="(c) where the run directories go")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="(c) extra config overrides")
    args = p.parse_args()
    if args.train:
        run_training(args, start("scaling-training", args))
    else:
        run_statistics(args, start("scaling", args, needs_data=False))


if __name__ == "__main__":
    main()
