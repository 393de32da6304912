"""Train short, test long (Press et al. 2021): how each way of giving positions scores text longer than it saw.

    python experiments/length_extrapolation.py                   # 5 models x --updates, then scoring
    python experiments/length_extrapolation.py --updates 300 --threads 1

The same character-level language model (``configs/shakespeare-char.yaml``'s data: tiny Shakespeare, nanoGPT's
split; a smaller model, :data:`MODEL`, so that five of them train in about half an hour on two cores) is trained
at ``data.block_size`` 128 once per ``positions`` setting (sinusoidal, learned, rope, alibi, none),
each for the same number of updates (not minutes: a shared machine would give them different budgets), with
the same seed. Then each scores the whole validation split with :func:`attnkit.inference.language_model.
score_stream` at contexts 128, 256, 512 and 1024: every character predicted from at most that many before it.
A model whose positions are a table (learned: 128 rows, as trained) cannot see further than its table and
scores only at 128; the sinusoidal table is a formula, so its model gets 1024 rows it never trained on.

Writes ``docs/figures/length-extrapolation.json`` and ``length-extrapolation.png`` (loss against context).
"""

from __future__ import annotations

import sys
from pathlib import Path

from common import CONFIGS, ROOT, Recorder, caption, markdown, parser, start, train_for  # noqa: F401

from attnkit.inference.language_model import document_stream, score_stream, scored_characters
from attnkit.tasks import load_run
from attnkit.tasks.language_model import lm_documents

CONFIG = CONFIGS / "shakespeare-char.yaml"
KINDS = ("sinusoidal", "learned", "rope", "alibi", "none")
CONTEXTS = (128, 256, 512, 1024)
TRAIN_BLOCK = 128
#: The model every kind of positions trains: 4 layers, 128 wide, 4 heads (the 32-wide heads RoPE rotates in pairs),
#: embeddings scaled by sqrt(d_model) to unit variance (the paper's), as the unit sinusoids added to them need.
MODEL = ["model.transformer.d_model=128", "model.transformer.n_heads=4", "model.transformer.d_ff=512",
         "model.transformer.decoder_layers=4", "model.transformer.dropout=0.0",
         "model.transformer.scale_embeddings=true"]


def overrides(kind: str, updates: int) -> list[str]:
    """The config at block 128 with ``kind`` positions, for ``updates`` updates, no time limit."""
    table = TRAIN_BLOCK if kind == "learned" else max(CONTEXTS)  # sinusoidal: rows past 128 never trained
    return [*MODEL, f"model.transformer.positions={kind}", f"model.transformer.max_len={table}",
            f"data.block_size={TRAIN_BLOCK}", "train.max_minutes=0", f"train.max_updates={updates}",
            f"train.valid_every={updates}", "train.keep_checkpoints=1"]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--updates", type=int, default=600, help="updates per model (default 600)")
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "length-extrapolation", help="where the runs go")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides for every model (after the experiment's own)")
    args = p.parse_args(argv)
    if not (ROOT.parent / "shared" / "data" / "shakespeare" / "input.txt").exists():
        sys.exit("../shared/data/shakespeare/input.txt is missing: this experiment needs the shared data")
    recorder = start("length-extrapolation", args, needs_data=False)
    rows = []
    for kind in KINDS:
        trained = train_for(kind, CONFIG, args.runs / kind, 0, [*overrides(kind, args.updates), *args.set])
        run = load_run(args.runs / kind)
        ids = document_stream(run.tok, list(lm_documents(run.cfg, held_out=True)))
        characters = scored_characters(run.tok, ids)
        losses = {}
        for context in CONTEXTS:
            limit = run.model.context
            if limit is not None and context > limit:
                losses[str(context)] = None
                continue
            losses[str(context)] = score_stream(run.model, ids, context, 8192, characters).loss
            print(f"{kind}: context {context}: loss {losses[str(context)]:.4f}", flush=True)
        rows.append({"positions": kind, "updates": trained.updates, "minutes": trained.minutes,
                     "parameters": trained.parameters, "loss": losses})
    recorder.results = {"config": str(CONFIG.relative_to(ROOT)), "train_block": TRAIN_BLOCK, "contexts": CONTEXTS,
                        "rows": rows}
    recorder.figure(plot(rows))
    recorder.write()
    print(markdown_table(recorder.results | {"command": "(this run)", "date": "", "commit": "", "run_seconds": 0,
                                             "torch_threads": 0}))
    return 0


def plot(rows: list[dict]):
    """Validation loss against the scoring context, one line per kind of positions."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for r in rows:
        points = [(int(c), loss) for c, loss in r["loss"].items() if loss is not None]
        ax.plot(*zip(*points, strict=True), marker="o", label=r["positions"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(CONTEXTS, [str(c) for c in CONTEXTS])
    ax.axvline(TRAIN_BLOCK, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("context when scoring (characters); trained at 128")
    ax.set_ylabel("validation loss (nats per character)")
    ax.set_title("Train short, test long: tiny Shakespeare")
    ax.legend()
    fig.tight_layout()
    return fig


def markdown_table(results: dict) -> str:
    """Loss at each scoring context, one row per kind of positions."""
    contexts = [str(c) for c in results["contexts"]]
    rows = [[f"`{r['positions']}`", f"{r['updates']:,}"]
            + [("—" if r["loss"][c] is None else f"{r['loss'][c]:.4f}") for c in contexts] for r in results["rows"]]
    table = markdown(["positions", "updates", *[f"loss at {c}" for c in contexts]], rows, "lr" + "r" * len(contexts))
    return table + "\n\n" + (caption(results) if results.get("date") else "")


if __name__ == "__main__":
    sys.exit(main())
