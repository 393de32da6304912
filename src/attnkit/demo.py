"""``attnkit demo``: learn to read dates written many ways, and show where attention looks.

A small Transformer is trained on generated pairs such as ``"3. März 2021" -> "2021-03-03"``
(:mod:`attnkit.dates`; 18 formats in English, German, French, Spanish and Korean), scored
by exact match on dates never seen in training, and one cross-attention heatmap is saved:
the year digits attend to the year, the month digits to the month name, and so on.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from . import dates
from .attention_maps import attention_figure
from .config import load_config
from .errors import UserError
from .plot import save_figure
from .runconfig import RunConfig
from .tasks import CONFIG_FILE, load_run, translate_texts
from .train import Trainer

# The demo's configuration (configs/demo.yaml is the same, commented; a test keeps them equal).
DEMO_CONFIG: dict = {
    "task": "translate",
    "data": {"generate": "dates", "generate_train": 40000, "generate_valid": 300, "max_len": 64,
             "tokenizer": {"vocab_size": 300, "model_type": "char", "joint": True}},
    "model": {"arch": "transformer",
              "transformer": {"d_model": 128, "n_heads": 4, "d_ff": 256, "encoder_layers": 2,
                              "decoder_layers": 2, "dropout": 0.0, "norm_first": True, "max_len": 128}},
    "train": {"max_tokens": 2500, "max_updates": 3000, "lr": 3e-3, "schedule": "linear", "warmup": 200,
              "label_smoothing": 0.0, "precision": "fp32", "valid_every": 250, "valid_bleu_sentences": 300,
              "keep_checkpoints": 3, "average_last": 1, "max_minutes": 2.3},
    "decode_beam": 1,
}
HELD_OUT = 1000


def demo_config(overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    return load_config(RunConfig, DEMO_CONFIG, overrides)


def run_demo(out_dir: str | Path = ".", overrides: list[str] | tuple[str, ...] = (), *, examples: int = 8,
             held_out: int = HELD_OUT, log=print) -> float:
    """Train, evaluate on ``held_out`` unseen dates, print translations, save a heatmap; returns exact match in %."""
    if held_out < 1:
        raise UserError(f"--held-out must be at least 1, got {held_out}")
    cfg = demo_config(overrides)
    out = Path(out_dir)
    run_dir = out / "attnkit-demo-run"
    if run_dir.exists():
        if not (run_dir / CONFIG_FILE).exists():
            raise UserError(f"{run_dir} exists and is not an attnkit run; move it away or choose another -o")
        shutil.rmtree(run_dir)  # the demo's own run from an earlier time
    t0 = time.perf_counter()
    Trainer(cfg, run_dir).run()
    minutes = (time.perf_counter() - t0) / 60

    run = load_run(run_dir)
    test = dates.generate_pairs(held_out, seed=cfg.train.seed + 1, split="test")
    hyps = [h[0] for h in translate_texts(run.model, run.tok, [s for s, _ in test], beam=cfg.decode_beam)]
    correct = [h == t for h, (_, t) in zip(hyps, test, strict=True)]
    exact = 100.0 * sum(correct) / len(test)

    log("\nheld-out dates (never seen in training):")
    for (src, ref), hyp, ok in list(zip(test, hyps, correct, strict=True))[:examples]:
        log(f"  {src:<34} -> {hyp:<12} {'ok' if ok else 'expected ' + ref}")
    figure_path = save_figure(attention_figure(run, "Sonntag, 3. März 2024"), out / "attnkit-demo-attention.png")
    log(f"\ncross-attention heatmap: {figure_path}")
    log(f"training took {minutes:.1f} min; model and tokenizer in {run_dir}")
    log(f"exact match: {exact:.1f}%")
    return exact
