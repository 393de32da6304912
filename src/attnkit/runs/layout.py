"""The run directory's layout: every file name in it, and finding its weights and checkpoints.

``attnkit train`` writes a run directory; every other command reads one. This module is the
one place that names its files::

    config.yaml              CONFIG_FILE      the resolved configuration
    tokenizer.json, *.model  TOKENIZER_FILE   the tokenizer: SentencePiece model(s), and for an imported
      (vocab.json, ...)                       model its vocabulary or WordPiece file (attnkit.data.tokenizer)
    classes.json             CLASSES_FILE     class names (classification)
    data/                    DATA_DIR         the prepared training data, memory-mapped (attnkit.data.prepare)
      manifest.json          MANIFEST_FILE    its sources, settings and counts, written last
    checkpoints/step-N/      CHECKPOINTS_DIR  MODEL_FILE + STATE_FILE (optimizer, schedule, data position, RNG)
    best.safetensors         BEST_FILE        best validation score so far
    averaged.safetensors     AVERAGED_FILE    mean of the last K checkpoints (written at the end of training)
    imported.safetensors     IMPORTED_FILE    the weights of a run made by `attnkit import` (no training here)
    metrics.jsonl            METRICS_FILE     one JSON object per validation
    precision.json           PRECISION_FILE   the precision training chose, and the timings behind it
    lora-base.json           LORA_BASE_FILE   an adapted run's base weights file (attnkit.runs.adapters)

:mod:`attnkit.runs.directory` writes it, :mod:`attnkit.runs.load` loads a trained model from it.
"""

from __future__ import annotations

from pathlib import Path

from ..common.errors import UserError
from ..data.prepare import MANIFEST_FILE
from ..data.tokenizer import TOKENIZER_FILE, tokenizer_files

__all__ = ["AVERAGED_FILE", "BEST_FILE", "CHECKPOINTS_DIR", "CLASSES_FILE", "CONFIG_FILE", "DATA_DIR", "IMPORTED_FILE",
           "LEGACY_STATE_FILE", "LORA_BASE_FILE", "MANIFEST_FILE", "METRICS_FILE", "MODEL_FILE", "PRECISION_FILE",
           "STATE_FILE", "TOKENIZER_FILE", "checkpoints", "find_run", "find_weights", "tokenizer_files"]

CONFIG_FILE = "config.yaml"
CLASSES_FILE = "classes.json"
DATA_DIR = "data"
CHECKPOINTS_DIR, MODEL_FILE, STATE_FILE = "checkpoints", "model.safetensors", "trainer.safetensors"
LEGACY_STATE_FILE = "trainer.pt"  # the training state of checkpoints written before it was safetensors
BEST_FILE, AVERAGED_FILE, IMPORTED_FILE = "best.safetensors", "averaged.safetensors", "imported.safetensors"
METRICS_FILE = "metrics.jsonl"
PRECISION_FILE = "precision.json"
LORA_BASE_FILE = "lora-base.json"
_STEP = "step-{:08d}"


def checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's complete checkpoint directories, oldest first (a half-written one has another name)."""
    folder = Path(run_dir) / CHECKPOINTS_DIR
    return sorted(folder.glob("step-*")) if folder.exists() else []


def checkpoint_name(step: int) -> str:
    """``step-00000040``: the name of the checkpoint of update ``step`` (zero-padded, so names sort by step)."""
    return _STEP.format(step)


def find_run(path: Path) -> Path:
    """The run directory that holds ``path`` (a file inside it, at any depth), found by its :data:`CONFIG_FILE`."""
    run_dir = path.parent
    while not (run_dir / CONFIG_FILE).exists() and run_dir != run_dir.parent:
        run_dir = run_dir.parent
    if not (run_dir / CONFIG_FILE).exists():
        raise UserError(f"{path}: no {CONFIG_FILE} found beside it or above it; point at a run directory")
    return run_dir


def find_weights(path: Path) -> tuple[Path, Path]:
    """``(run_dir, weights file)`` for a run directory or a ``.safetensors`` file inside one.

    A run directory resolves to :data:`AVERAGED_FILE`, else :data:`BEST_FILE`, else :data:`IMPORTED_FILE`,
    else the newest checkpoint.
    """
    if path.is_file():
        return find_run(path), path
    if not (path / CONFIG_FILE).exists():
        raise UserError(f"{path}: not a run directory (no {CONFIG_FILE}); train one with `attnkit train`")
    for name in (AVERAGED_FILE, BEST_FILE, IMPORTED_FILE):
        if (path / name).exists():
            return path, path / name
    steps = [c / MODEL_FILE for c in checkpoints(path) if (c / MODEL_FILE).exists()]
    if not steps:
        raise UserError(f"{path}: the run has no checkpoint yet")
    return path, steps[-1]
