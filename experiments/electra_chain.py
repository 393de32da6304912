"""Does ELECTRA's discriminator learn? The committed recipe on a corpus whose answer is known.

    python experiments/electra_chain.py                       # lr 5e-3, 1e-3 and 5e-4, 3 seeds: a few minutes

Issue 38: on IMDB the discriminator of ``experiments/configs/imdb-electra-pretrain.yaml`` ended every run
calling each subword original (its accuracy equal to the share of originals, the prior). Real text cannot say
why: the generator also sat on the unigram plateau there. This corpus takes the text out of the question.
Each row is a chain through a fixed random permutation of ``WORDS`` words, ``x_{t+1} = perm(x_t)``, so
any visible neighbour gives a masked word away and a replaced word contradicts its neighbours.

:func:`train_on_chain` trains :class:`attnkit.mlm.ReplacedTokenDetection` with the committed config's
model (``model.transformer``), objective (``mlm``) and optimiser (Adam with ``train.betas``, ``eps``,
``clip_norm``), at the learning rate given, warmed up linearly, and measures on held-out chains:

* ``gen_acc``: the generator's accuracy at the masked positions (the unigram baseline is ``1 / WORDS``);
* ``rtd_acc``: the discriminator's accuracy over every position, against ``prior``, the share of
  originals in the corrupted input (what calling everything original scores).

``--variants LR`` also trains the model with one change at a time (:data:`VARIANTS`: GELU, post-norm,
learned positions with unscaled embeddings) at that rate, to tell the rate from the architecture.

Writes ``benchmarks/results/electra-chain.json``; :func:`markdown_table` renders it (``electra-chain`` in
docs/sentiment.md). ``tests/test_electra.py`` runs :func:`train_on_chain` with the committed learning rate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # nbsvm, tables: the benchmarks' helpers
sys.path.insert(0, str(ROOT / "src"))

from attnkit.common.measure import stamp  # noqa: E402
from attnkit.config.loader import load_config  # noqa: E402
from attnkit.config.schema import RunConfig  # noqa: E402
from attnkit.mlm import ReplacedTokenDetection, ReplacedTokenDetectionLoss, mask_tokens, replaced_labels  # noqa: E402
from nbsvm import cpu_model  # noqa: E402
from tables import markdown as table  # noqa: E402
from tables import measured  # noqa: E402

CONFIG = ROOT / "experiments" / "configs" / "imdb-electra-pretrain.yaml"
OUT = ROOT / "benchmarks" / "results" / "electra-chain.json"
WORDS, FIRST_WORD, MASK_ID, SPECIALS = 60, 5, 4, (1, 2, 3)  # ids 0-4: <pad>, <unk>, <s>, </s>, <mask>
LENGTH, BATCH = 32, 16  # (rows, words) of a training batch


def chain_corpus(rows: int, generator: torch.Generator) -> torch.Tensor:
    """``rows`` chains ``(rows, LENGTH)`` of word ids, each from a random first word, ``x_{t+1} = perm(x_t)``."""
    perm = torch.randperm(WORDS, generator=torch.Generator().manual_seed(1))  # the same language for every call
    out = torch.empty(rows, LENGTH, dtype=torch.long)
    word = torch.randint(0, WORDS, (rows,), generator=generator)  # (rows,)
    for t in range(LENGTH):
        out[:, t] = word + FIRST_WORD
        word = perm[word]
    return out


def corrupt(tokens: torch.Tensor, select: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """ELECTRA's input: ``select`` of the words -> ``<mask>`` (as the pretraining task corrupts)."""
    return mask_tokens(tokens, mask_id=MASK_ID, special_ids=SPECIALS, vocab_size=FIRST_WORD + WORDS, select=select,
                       mask=1.0, random=0.0, generator=generator)


#: changes to the committed model tried at the committed-before rate 5e-3 (``--variants``): is it the rate?
VARIANTS = {"GELU": {"activation": "gelu"}, "post-norm": {"norm_first": False},
            "learned positions, unscaled embeddings": {"positions": "learned", "scale_embeddings": False}}


def train_on_chain(cfg: RunConfig, lr: float, *, warmup: int = 100, updates: int = 300, every: int = 100,
                   seed: int = 0) -> list[dict]:
    """``cfg``'s ELECTRA at ``lr`` for ``updates`` updates; the held-out measures every ``every`` updates."""
    torch.manual_seed(seed)
    model = ReplacedTokenDetection(replace(cfg.model.transformer, max_len=LENGTH), FIRST_WORD + WORDS,
                                   generator_width=cfg.mlm.generator_width, never_sample=(*SPECIALS, MASK_ID))
    objective = ReplacedTokenDetectionLoss(model, cfg.mlm.electra_weight)
    tc = cfg.train
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=tc.betas, eps=tc.eps)
    data = torch.Generator().manual_seed(seed + 2)
    valid = chain_corpus(128, torch.Generator().manual_seed(99))  # (128, LENGTH)
    valid_in, valid_sel = corrupt(valid, cfg.mlm.select, torch.Generator().manual_seed(5))

    def measure(update: int) -> dict:
        model.eval()
        with torch.no_grad():
            out = model(valid_in, valid_sel, torch.Generator().manual_seed(7))
            replaced, real = replaced_labels(out.corrupted, valid)
            said = out.replaced_logits[real] > 0  # (M,) the discriminator: replaced
            truth = replaced[real]
            row = {"update": update,
                   "gen_acc": 100 * (out.generator_logits.argmax(-1) == valid[valid_sel]).float().mean().item(),
                   "rtd_acc": 100 * (said == truth).float().mean().item(),
                   "prior": 100 * (1 - truth.float().mean().item())}
        model.train()
        return {k: round(v, 2) for k, v in row.items()}

    curve = []
    for update in range(1, updates + 1):
        tokens = chain_corpus(BATCH, data)  # (BATCH, LENGTH)
        inputs, selected = corrupt(tokens, cfg.mlm.select, data)
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, update / warmup)
        loss = objective(inputs, selected, tokens[selected]) / selected.sum()  # the trainer's mean per selected
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_norm)
        optimizer.step()
        if update % every == 0:
            curve.append(measure(update))
    return curve


def markdown_table(results: dict) -> str:
    """One row per learning rate and seed: the last measures, and how far the discriminator is above the prior."""
    rows = []
    for run in results["runs"]:
        last = run["curve"][-1]
        committed = " (committed)" if run["lr"] == results["committed_lr"] else ""
        rows.append([run.get("variant", "committed"), f"{run['lr']:g}{committed}", run["seed"], last["update"],
                     f"{last['gen_acc']:.1f}",
                     f"{last['rtd_acc']:.1f}", f"{last['prior']:.1f}", f"{last['rtd_acc'] - last['prior']:+.1f}"])
    header = ["model", "learning rate", "seed", "updates", f"generator accuracy (unigram {100 / WORDS:.1f})",
              "discriminator accuracy", "prior", "above the prior"]
    return (table(header, rows, "llrrrrrr") + "\n\n"
            f"`{results['command']}` ({measured(results)}, {results['cpu']}, {results['threads']} thread): the "
            f"model, objective and optimiser of `experiments/configs/imdb-electra-pretrain.yaml` at each learning "
            f"rate, warmed up over {results['warmup']} updates, batches of {BATCH} chains of {LENGTH} words; "
            f"accuracies in %.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lrs", type=float, nargs="+", default=[5e-3, 1e-3, 5e-4])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--updates", type=int, default=300)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--variants", type=float, default=5e-3, metavar="LR",
                   help="also train each of VARIANTS (seed 0) at this rate (0: none)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(RunConfig, CONFIG)
    runs = []
    for lr in args.lrs:
        for seed in args.seeds:
            start = time.perf_counter()
            curve = train_on_chain(cfg, lr, warmup=args.warmup, updates=args.updates, seed=seed)
            runs.append({"lr": lr, "seed": seed, "variant": "committed",
                         "seconds": round(time.perf_counter() - start, 1), "curve": curve})
            print(json.dumps(runs[-1]["curve"][-1] | {"lr": lr, "seed": seed}), flush=True)
    for name, change in VARIANTS.items() if args.variants else ():
        model = replace(cfg.model, transformer=replace(cfg.model.transformer, **change))
        curve = train_on_chain(replace(cfg, model=model), args.variants, warmup=args.warmup, updates=args.updates)
        runs.append({"lr": args.variants, "seed": 0, "variant": name, "curve": curve})
        print(json.dumps(curve[-1] | {"lr": args.variants, "variant": name}), flush=True)
    results = {**stamp(), "cpu": cpu_model(), "threads": 1, "committed_lr": cfg.train.lr,
               "warmup": args.warmup, "command": "python experiments/electra_chain.py" + (
                   " " + " ".join(argv) if argv else ""), "runs": runs}
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
