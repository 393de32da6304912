"""``attnkit demo``: learn to read dates written many ways, and show where attention looks.

A small Transformer is trained on generated pairs such as ``"3. März 2021" -> "2021-03-03"``
(:mod:`attnkit.data.dates`; 18 formats in English, German, French, Spanish and Korean), scored
by exact match on dates never seen in training, and one cross-attention heatmap is saved:
the year digits attend to the year, the month digits to the month name, and so on.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from importlib.resources import as_file, files
from pathlib import Path

from .common.errors import UserError
from .common.files import atomic_write_text
from .common.measure import peak_rss_gb, process_seconds, stamp
from .config.loader import load_config
from .config.schema import RunConfig
from .data import dates
from .inference.translate import translate_texts
from .tasks import load_run
from .training.trainer import Trainer
from .viz.figures import attention_figure
from .viz.plot import save_figure

#: The demo's configuration, shipped inside the package (``configs/demo.yaml`` links to it).
DEMO_YAML = files("attnkit").joinpath("demo.yaml")
HELD_OUT = 1000
RUN_NAME = "attnkit-demo-run"
#: Written into the run directory before training: only a directory holding it is the demo's to delete.
MARKER = ".attnkit-demo"


@dataclass
class DemoResult:
    """What ``attnkit demo --json`` writes (with :func:`attnkit.common.measure.stamp`'s date and commit)."""

    exact_match: float  # % of ``held_out`` unseen dates rewritten exactly
    held_out: int
    updates: int
    train_minutes: float  # tokenizer, model and training loop
    minutes: float  # the whole command, interpreter start-up included
    peak_rss_gb: float
    overrides: list[str]


def demo_config(overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    with as_file(DEMO_YAML) as path:
        return load_config(RunConfig, path, overrides)


def _clear_run_dir(run_dir: Path) -> None:
    """Delete the demo's run from an earlier time; refuse anything the demo did not write."""
    if not run_dir.exists():
        return
    if not (run_dir / MARKER).exists():
        if run_dir.is_dir() and not any(run_dir.iterdir()):
            return
        raise UserError(f"{run_dir} exists but was not written by attnkit demo (no {MARKER} in it); "
                        f"move it away or choose another --out-dir")
    shutil.rmtree(run_dir)


def run_demo(out_dir: str | Path = ".", overrides: list[str] | tuple[str, ...] = (), *, examples: int = 8,
             held_out: int = HELD_OUT, json_path: str | Path | None = None, log=print) -> DemoResult:
    """Train, evaluate on ``held_out`` unseen dates, print translations, save a heatmap.

    :param json_path: also write the :class:`DemoResult` there, with the date and commit.
    """
    if held_out < 1:
        raise UserError(f"--held-out must be at least 1, got {held_out}")
    cfg = demo_config(overrides)
    out = Path(out_dir)
    run_dir = out / RUN_NAME
    _clear_run_dir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MARKER).write_text("written by attnkit demo, which deletes this directory when run again\n")
    t0 = time.perf_counter()
    trainer = Trainer(cfg, run_dir)
    trainer.run()
    train_minutes = (time.perf_counter() - t0) / 60

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
    log(f"training took {train_minutes:.1f} min; model and tokenizer in {run_dir}")
    log(f"exact match: {exact:.1f}%")
    result = DemoResult(exact_match=round(exact, 2), held_out=held_out, updates=trainer.step,
                        train_minutes=round(train_minutes, 4), minutes=round(process_seconds() / 60, 4),
                        peak_rss_gb=round(peak_rss_gb(), 2), overrides=list(overrides))
    if json_path is not None:
        record = {**stamp(), "command": "attnkit demo", **asdict(result)}
        atomic_write_text(json_path, json.dumps(record, indent=2) + "\n")
        log(f"figures written to {json_path}")
    return result
