"""The run directory as ``attnkit train`` writes it: resolved config, checkpoints (atomic, pruned, averaged),
metrics, best weights and the precision chosen. Its file names are :mod:`attnkit.runs.layout`'s.

Each checkpoint is written under a temporary name and renamed into place, so a crash (Ctrl-C,
kill -9) leaves either the whole checkpoint or none. Weights are safetensors; the trainer state
is loaded with ``weights_only=True``. In a distributed run only rank 0 writes.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from torch import Tensor

from ..common.errors import UserError
from ..common.files import atomic_write_text, fsync_dir
from ..config.loader import dump_config, load_config
from ..config.schema import RunConfig
from .checkpoint import average_weights, load_training_state, load_weights, save_training_state, save_weights
from .layout import (
    AVERAGED_FILE,
    BEST_FILE,
    CHECKPOINTS_DIR,
    CLASSES_FILE,
    CONFIG_FILE,
    LEGACY_STATE_FILE,
    METRICS_FILE,
    MODEL_FILE,
    PRECISION_FILE,
    STATE_FILE,
    TOKENIZER_FILE,
    checkpoint_name,
    checkpoints,
)


class RunDirectory:
    """One training run's directory; ``is_main`` is False on the ranks that must not write."""

    def __init__(self, path: str | Path, *, is_main: bool = True, log: Callable[[str], None] = print) -> None:
        self.path = Path(path)
        self.config_file = self.path / CONFIG_FILE
        self.checkpoint_dir = self.path / CHECKPOINTS_DIR
        self.is_main = is_main
        self.log = log

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return checkpoints(self.path)

    def claim(self, cfg: RunConfig, resume: bool) -> None:
        """Refuse to overwrite a run or to reuse another run's tokenizer; write the resolved config."""
        if self.checkpoints() and not resume:
            raise UserError(f"{self.path} already holds checkpoints; pass --resume to continue it, "
                            f"or choose another --run-dir")
        prepared = any((self.path / name).exists() for name in (TOKENIZER_FILE, CLASSES_FILE))
        if not self.checkpoints() and prepared and self.config_file.exists():  # stopped before a checkpoint
            old = load_config(RunConfig, self.config_file)
            if (old.task, old.data) != (cfg.task, cfg.data):  # its tokenizer / classes would be reused silently
                raise UserError(f"{self.path} holds the tokenizer of a run with other task/data settings; "
                                f"choose another --run-dir or delete that directory")
        self.path.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, self.config_file)

    def save_checkpoint(self, step: int, weights: dict[str, Tensor], trainer_state: dict, keep: int) -> Path:
        """Write ``checkpoints/step-N`` atomically (temp dir + rename), then keep only the newest ``keep``."""
        final = self.checkpoint_dir / checkpoint_name(step)
        if final.exists() or not self.is_main:
            return final
        for leftover in self.checkpoint_dir.glob(".tmp-step-*"):  # from a crash mid-write: never a checkpoint
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = self.checkpoint_dir / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
        tmp.mkdir(parents=True)
        save_weights(tmp / MODEL_FILE, weights, {"step": str(step)})
        save_training_state(tmp / STATE_FILE, trainer_state)
        os.replace(tmp, final)
        fsync_dir(self.checkpoint_dir)  # the rename is durable before older checkpoints go
        for old in self.checkpoints()[: -max(keep, 1)]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    @staticmethod
    def load_checkpoint(path: Path) -> tuple[dict[str, Tensor], dict]:
        """``(weights, trainer state)`` of one checkpoint directory."""
        weights, _ = load_weights(path / MODEL_FILE)
        state = path / STATE_FILE
        return weights, load_training_state(state if state.exists() else path / LEGACY_STATE_FILE)

    def log_metrics(self, metrics: dict) -> None:
        with open(self.path / METRICS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")

    def write_precision(self, record: dict) -> None:
        """Record the precision the run computes in and why (:meth:`attnkit.engine.precision.Choice.to_json`)."""
        if self.is_main:
            atomic_write_text(self.path / PRECISION_FILE, json.dumps(record, indent=1) + "\n")

    def read_precision(self) -> dict | None:
        """The recorded precision, or None where there is none (or none readable)."""
        try:
            record = json.loads((self.path / PRECISION_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def truncate_metrics(self, step: int) -> None:
        """Drop metric lines logged after ``step`` (a resumed run logs them again)."""
        path = self.path / METRICS_FILE
        if self.is_main and path.exists():
            kept = []
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line).get("step", 0) <= step:
                        kept.append(line)
                except ValueError:  # a line torn by a crash mid-append
                    continue
            atomic_write_text(path, "".join(line + "\n" for line in kept))

    def save_best(self, weights: dict[str, Tensor], step: int) -> None:
        save_weights(self.path / BEST_FILE, weights, {"step": str(step)})

    def average_last(self, k: int) -> None:
        """Average the newest ``k`` checkpoints into ``averaged.safetensors`` (nothing for ``k`` < 2)."""
        steps = self.checkpoints()[-k:] if k > 1 else []
        if len(steps) > 1:
            averaged = average_weights([s / MODEL_FILE for s in steps])
            save_weights(self.path / AVERAGED_FILE, averaged, {"averaged": ",".join(s.name for s in steps)})
            self.log(f"averaged {len(steps)} checkpoints into {AVERAGED_FILE}")
