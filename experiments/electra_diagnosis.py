"""Why ELECTRA's discriminator stays at the prior on IMDB: the same updates with three sources of replacements.

    flock /tmp/attnkit-bench.lock python experiments/electra_diagnosis.py --run runs/imdb-electra-pretrain

The IMDB ELECTRA runs (``recipe-probes``) ended with the discriminator calling every subword original
(replaced-token accuracy 85.0%, the share of originals) and the generator below the unigram plateau.
This drives :class:`attnkit.mlm.ReplacedTokenDetection` directly, on the prepared windows and the
tokenizer of a pretraining run directory (``--run``: any IMDB pretraining run, MLM or ELECTRA; its
``data/`` and tokenizer are read, its weights are not), from a fresh initialisation, with Adam and the
run's learning rate warmed up over the first 100 updates, ``--updates`` updates of 32 windows each,
in three variants:

``generator``
    the objective as implemented: the generator (a quarter of the width, sharing the embeddings) samples.
``separate``
    the same, but the generator has its own embedding table: nothing of it reaches the discriminator.
``uniform``
    no generator: every selected subword is replaced by one drawn uniformly from the vocabulary.

Every 25 updates it records the generator's MLM loss (on that batch), the discriminator's BCE and the
gap between its mean logit on replaced and on original positions (0: it tells them apart no better
than by chance). Writes ``benchmarks/results/electra-diagnosis.json``; :func:`markdown_table` renders it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # nbsvm, tables: the benchmarks' helpers
sys.path.insert(0, str(ROOT / "src"))

from attnkit.attention import padding_mask  # noqa: E402
from attnkit.common.measure import stamp  # noqa: E402
from attnkit.config.loader import load_config  # noqa: E402
from attnkit.config.schema import RunConfig  # noqa: E402
from attnkit.data.arrays import TokenArrays  # noqa: E402
from attnkit.data.tokenizer import Tokenizer  # noqa: E402
from attnkit.mlm import ReplacedTokenDetection, mask_tokens, replaced_labels  # noqa: E402
from attnkit.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID  # noqa: E402
from nbsvm import cpu_model  # noqa: E402
from tables import markdown  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "electra-diagnosis.json"
VARIANTS = ("generator", "separate", "uniform")


class Variant(ReplacedTokenDetection):
    """:class:`ReplacedTokenDetection` with its replacements from one of :data:`VARIANTS`."""

    def __init__(self, variant: str, cfg, vocab_size: int, **kwargs) -> None:
        super().__init__(cfg, vocab_size, **kwargs)
        self.variant, self.vocab_size = variant, vocab_size
        if variant == "separate":
            self.own_embedding = torch.nn.Parameter(self.encoder.embed.weight.detach().clone())

    def generator_logits(self, tokens: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        if self.variant == "uniform":  # equal logits: sample_replacements draws uniformly (banned ids aside)
            return torch.zeros(int(selected.sum()), self.vocab_size, requires_grad=True)
        if self.variant == "generator":
            return super().generator_logits(tokens, selected)
        enc = self.encoder
        mask = padding_mask(tokens, enc.pad_id).unsqueeze(1)  # (B, 1, 1, T)
        embedded = F.embedding(tokens, self.own_embedding) * enc.embed.scale + enc.positions(tokens.size(1))
        return self.generator(embedded, mask, selected, self.own_embedding)


def windows(run: Path) -> TokenArrays:
    """The run's prepared pretraining windows, memory-mapped."""
    data = run / "data"
    return TokenArrays(np.load(data / "text.ids.npy", mmap_mode="r"), np.load(data / "text.offsets.npy"),
                       np.load(data / "text.lengths.npy"))


def train(variant: str, cfg: RunConfig, tok: Tokenizer, x_all: TokenArrays, updates: int, seed: int) -> list[dict]:
    torch.manual_seed(seed)
    specials = (UNK_ID, BOS_ID, EOS_ID, tok.mask_id)
    model = Variant(variant, cfg.model.transformer, tok.src_vocab_size, never_sample=specials)
    lr = cfg.train.lr
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=tuple(cfg.train.betas), eps=cfg.train.eps)
    rng = np.random.default_rng(seed)
    curve, start = [], time.perf_counter()
    for update in range(1, updates + 1):
        x = x_all.pad(rng.integers(0, len(x_all), 32), PAD_ID)  # (B, T)
        inputs, selected = mask_tokens(x, mask_id=tok.mask_id, special_ids=(UNK_ID, BOS_ID, EOS_ID),
                                       vocab_size=tok.src_vocab_size, select=cfg.mlm.select, mask=1.0, random=0.0)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, update / 100)
        model.train()
        out = model(inputs, selected)
        mlm = F.cross_entropy(out.generator_logits.float(), x[selected])
        replaced, real = replaced_labels(out.corrupted, x)
        logits = out.replaced_logits.float()[real]  # (M,)
        bce = F.binary_cross_entropy_with_logits(logits, replaced[real].float())
        opt.zero_grad()
        (mlm + cfg.mlm.electra_weight * bce).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_norm)
        opt.step()
        if update % 25 == 0:
            y = replaced[real]
            gap = (logits[y].mean() - logits[~y].mean()).item()
            generator_loss = None if variant == "uniform" else round(mlm.item(), 3)
            curve.append({"update": update, "generator_mlm_loss": generator_loss,
                          "rtd_bce": round(bce.item(), 4), "logit_gap": round(gap, 3),
                          "seconds": round(time.perf_counter() - start, 1)})
            print(variant, json.dumps(curve[-1]), flush=True)
    return curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, type=Path,
                   help="an IMDB pretraining run directory (its data/ and tokenizer)")
    p.add_argument("--updates", type=int, default=150)
    p.add_argument("--lr", type=float, help="instead of the run's train.lr")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--out", type=Path, default=RESULTS,
                   help=f"the JSON to write (default {RESULTS.relative_to(ROOT)}; every electra-diagnosis*.json "
                   "in results/ is a table)")
    args = p.parse_args()
    if not (args.run / "data" / "text.ids.npy").exists():
        sys.exit(f"{args.run}: no prepared pretraining windows (data/text.ids.npy); train an IMDB pretraining "
                 "config into it first")
    torch.set_num_threads(args.threads)
    cfg = load_config(RunConfig, args.run / "config.yaml", [f"train.lr={args.lr}"] if args.lr else [])
    tok, x_all = Tokenizer.load(args.run), windows(args.run)
    curves = {variant: train(variant, cfg, tok, x_all, args.updates, args.seed) for variant in args.variants}
    results = {**stamp(), "cpu": cpu_model(), "threads": args.threads, "run": args.run.name,
               "lr": cfg.train.lr,
               "updates": args.updates, "batch_windows": 32, "electra_weight": cfg.mlm.electra_weight,
               "command": " ".join(["python", "experiments/electra_diagnosis.py", *sys.argv[1:]]), "curves": curves}
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(markdown_table(results))


HEADERS = {"generator": "generator (MLM loss / BCE / gap)",
           "separate": "separate embeddings (MLM loss / BCE / gap)",
           "uniform": "uniform replacements (BCE / gap)"}


def markdown_runs(runs: dict[str, dict]) -> str:
    """Every run (``results/electra-diagnosis*.json``), the shortest first."""
    ordered = sorted(runs.values(), key=lambda r: (r["updates"], r["date"]))
    return "\n\n".join(markdown_table(r) for r in ordered)


def markdown_table(results: dict) -> str:
    """A row per recorded update (past 150, every 100th): each variant's generator loss, discriminator BCE and
    logit gap."""
    curves = results["curves"]
    variants = [v for v in VARIANTS if v in curves]
    rows = []
    for i, point in enumerate(curves[variants[0]]):
        if point["update"] > 150 and point["update"] % 100:
            continue
        row = [point["update"]]
        for variant in variants:
            c = curves[variant][i]
            mlm = "" if c["generator_mlm_loss"] is None else f"{c['generator_mlm_loss']:.2f} / "
            row.append(f"{mlm}{c['rtd_bce']:.3f} / {c['logit_gap']:+.2f}")
        rows.append(row)
    table = markdown(["update", *(HEADERS[v] for v in variants)], rows, "r" + "l" * len(variants))
    return (f"{table}\n\n{results['updates']:,} updates from a fresh initialisation on the windows of "
            f"`{results['run']}`, batches of "
            f"{results['batch_windows']} windows, lr {results['lr']:g} (warmed up over 100 updates), lambda "
            f"{results['electra_weight']:g}, {results['threads']} threads; BCE of the prior (15% replaced): 0.423. "
            f"{results['cpu']}; measured {results['date'][:10]} at `{results['commit']}`.")


if __name__ == "__main__":
    main()
