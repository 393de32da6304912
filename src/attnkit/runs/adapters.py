"""An adapted run (``model.lora``, :mod:`attnkit.lora`) and the base run it adapts: which weights file the adapters
were trained on, checked whenever they are loaded.

An adapted run's checkpoints hold its adapters only; its base's weights stay where they are, in the run
``model.init_from`` names. When training starts, :func:`record_base` writes which file that is into the run
directory (``lora-base.json``: its absolute path, size, modification time and sha256). Loading the run
(:func:`checked_base`) finds the same file by that path and checks it is unchanged: the size and time as
recorded, else (a copy, a touch) the same sha256. A base that has been moved, deleted or overwritten is a
one-line error naming it, never a model that silently computes something else.

The base may itself be an adapted run: its own base is then checked and merged first (:mod:`attnkit.runs.load`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..common.errors import UserError
from ..common.files import atomic_write_text
from ..data.prepare import file_digest
from .layout import LORA_BASE_FILE, checkpoints

__all__ = ["checked_base", "record_base"]


def _identity(weights: Path) -> dict:
    """What :func:`record_base` keeps of a weights file: absolute path, size, modification time, sha256."""
    stat = weights.stat()
    return {"weights": str(weights.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sha256": file_digest(weights)["sha256"]}


def _read(run_dir: Path) -> dict | None:
    path = run_dir / LORA_BASE_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(record, dict) and all(k in record for k in ("weights", "bytes", "mtime_ns", "sha256")):
            return record
    except (OSError, ValueError):
        pass
    raise UserError(f"{path}: unreadable record of the base model; train the adapters again in a new --run-dir")


def _unchanged(record: dict, weights: Path) -> bool:
    """Whether ``weights`` is the recorded file: same size and time, else (a copy, a touch) the same content."""
    stat = weights.stat()
    if stat.st_size != record["bytes"]:
        return False
    return stat.st_mtime_ns == record["mtime_ns"] or file_digest(weights)["sha256"] == record["sha256"]


def record_base(run_dir: Path, weights: Path) -> None:
    """Record that ``run_dir``'s adapters adapt the weights file ``weights`` (module doc), or check the record of a
    run with checkpoints (``--resume``) against it.

    :raises UserError: the run's checkpoints were trained on another base file, or on this one before it changed.
    """
    record = _read(run_dir)
    if record is not None and Path(record["weights"]) == weights.resolve() and _unchanged(record, weights):
        return
    if record is not None and checkpoints(run_dir):
        what = "has changed since the adapters were trained on it" if Path(record["weights"]) == weights.resolve() \
            else f"trained the adapters, and model.init_from now gives {weights}"
        raise UserError(f"{run_dir}: its base model {record['weights']} {what}; resume with the base they were "
                        f"trained on, or train the adapters again in a new --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / LORA_BASE_FILE, json.dumps(_identity(weights), indent=1) + "\n")


def checked_base(run_dir: Path) -> Path:
    """The weights file ``run_dir``'s adapters were trained on, after checking it is still that file.

    :raises UserError: no record, or the file is gone or changed (one line naming it and what to do).
    """
    record = _read(run_dir)
    if record is None:
        raise UserError(f"{run_dir}: an adapted run (model.lora) without {LORA_BASE_FILE}: it never started "
                        f"training; train it first")
    weights = Path(record["weights"])
    if not weights.is_file():
        raise UserError(f"{run_dir}: its base model {weights} (model.init_from) is gone; the adapters need it: put "
                        f"the base run back where it was, or train the adapters again")
    if not _unchanged(record, weights):
        raise UserError(f"{run_dir}: its base model {weights} has changed since the adapters were trained (sha256 "
                        f"differs); the adapters fit only the weights they were trained on: restore them, or train "
                        f"the adapters again")
    return weights
