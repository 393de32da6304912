"""Atomic, safe persistence of weights, training state and resolved configs.

Two rules hold everywhere in this module:

1. **Atomic writes** (:mod:`attnkit.common.files`): a crash or ^C mid-write leaves either the old
   file or the new one, never half of one.
2. **No pickle.** Weights are safetensors (a JSON header plus raw bytes); so is training state, its
   tensors under flat names and the structure around them as JSON in the header. A training state
   written by attnkit before that (``torch.save``) is still read, only through
   ``torch.load(..., weights_only=True)``, which rebuilds tensors and plain Python values and refuses
   arbitrary objects.

A bad or mismatched file is the user's to fix, so it raises :class:`UserError` naming it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..common.errors import UserError
from ..common.files import atomic_write

ALIASES_KEY = "attnkit.aliases"
"""Metadata key holding ``{"alias": "canonical"}`` for tensors that share storage (tied weights)."""

_MAX_LISTED = 5  # how many offending keys an error message lists before "..."


# --------------------------------------------------------------------------- weights


def save_weights(
    path: str | Path, state_dict: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Save a state dict as safetensors, atomically.

    Tensors sharing storage with an identical view (tied weights, e.g. an embedding tied to
    the output projection) are stored once; the other keys are recorded as aliases in the
    metadata under :data:`ALIASES_KEY` and restored by :func:`load_weights`. Other views of a
    shared storage are copied, so each saved tensor owns its bytes.

    :param metadata: string-to-string notes kept in the header (e.g. the config hash).
    """
    metadata = dict(metadata or {})
    if ALIASES_KEY in metadata:
        raise ValueError(f"metadata key {ALIASES_KEY!r} is reserved for tied-weight aliases")
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple, str] = {}  # (data_ptr, dtype, shape, stride) -> canonical key
    storages: set[int] = set()
    for key, tensor in state_dict.items():
        tensor = tensor.detach()
        if tensor.numel() == 0:  # empty tensors may all report data_ptr 0
            tensors[key] = tensor.contiguous()
            continue
        view = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if view in views:
            aliases[key] = views[view]
            continue
        views[view] = key
        storage = tensor.untyped_storage().data_ptr()
        shared = storage in storages
        storages.add(storage)
        tensors[key] = tensor.clone(memory_format=torch.contiguous_format) if shared else tensor.contiguous()
    if aliases:
        metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def load_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Load a safetensors checkpoint written by :func:`save_weights` onto the CPU.

    :return: ``(state_dict, metadata)``; aliased keys are the *same* tensor object as their
        canonical key, so ties survive ``load_state_dict``. The alias entry is removed from
        the returned metadata.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such checkpoint file; check the path (or train a model first)")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            state = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:  # safetensors raises several types for corrupt headers and bodies
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"{path}: is not a safetensors checkpoint (corrupt or foreign file): {reason}") from None
    try:
        aliases = json.loads(metadata.pop(ALIASES_KEY, "{}"))
        for alias, canonical in aliases.items():
            state[alias] = state[canonical]
    except (ValueError, KeyError, AttributeError, TypeError):
        raise UserError(f"{path}: corrupt '{ALIASES_KEY}' entry in the checkpoint metadata") from None
    return state, metadata


def _listed(keys: list[str]) -> str:
    """``'a', 'b', ... (+3 more)`` for an error message."""
    shown = ", ".join(repr(k) for k in keys[:_MAX_LISTED])
    return shown + (f", ... (+{len(keys) - _MAX_LISTED} more)" if len(keys) > _MAX_LISTED else "")


def check_compatible(
    model_state: Mapping[str, torch.Tensor], loaded: Mapping[str, torch.Tensor], path: str | Path
) -> None:
    """Raise :class:`UserError` unless ``loaded`` has exactly the keys and shapes of ``model_state``.

    The message summarises missing keys, unexpected keys and shape mismatches (first few of
    each), which is what a checkpoint from another model or config looks like.
    """
    missing = [k for k in model_state if k not in loaded]
    unexpected = [k for k in loaded if k not in model_state]
    mismatched = [
        f"{k!r} checkpoint {tuple(loaded[k].shape)} vs model {tuple(model_state[k].shape)}"
        for k in model_state
        if k in loaded and loaded[k].shape != model_state[k].shape
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s) {_listed(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s) {_listed(unexpected)}")
    if mismatched:
        more = f", ... (+{len(mismatched) - _MAX_LISTED} more)" if len(mismatched) > _MAX_LISTED else ""
        problems.append(f"{len(mismatched)} shape mismatch(es) {', '.join(mismatched[:_MAX_LISTED])}{more}")
    if problems:
        raise UserError(
            f"{path}: checkpoint does not fit this model ({'; '.join(problems)}); "
            "was it trained with a different model config?"
        )


def average_weights(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean of several checkpoints of the same model (checkpoint averaging).

    Floating-point tensors are averaged (accumulated in float64, cast back); other tensors
    (step counters, integer buffers) are copied from the last checkpoint. Tied weights stay tied.
    """
    if not paths:
        raise UserError("no checkpoints given to average; pass at least one weights file")
    states = [load_weights(p)[0] for p in paths]
    first, last = states[0], states[-1]
    for path, state in zip(paths[1:], states[1:], strict=True):
        if state.keys() != first.keys():
            raise UserError(
                f"{path}: has different keys from {paths[0]}; only checkpoints of one model can be averaged"
            )
        for key, tensor in state.items():
            if tensor.shape != first[key].shape or tensor.dtype != first[key].dtype:
                raise UserError(
                    f"{path}: tensor {key!r} is {tensor.dtype} {tuple(tensor.shape)} but "
                    f"{first[key].dtype} {tuple(first[key].shape)} in {paths[0]}; "
                    "only checkpoints of one model can be averaged"
                )
    averaged: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}  # id(tensor in last) -> result, so aliases stay shared
    for key, tensor in last.items():
        if id(tensor) in done:
            averaged[key] = done[id(tensor)]
            continue
        if tensor.is_floating_point():
            total = sum(state[key].to(torch.float64) for state in states)
            result = (total / len(states)).to(tensor.dtype)
        else:
            result = tensor.clone()
        averaged[key] = done[id(tensor)] = result
    return averaged


# --------------------------------------------------------------------------- training state

_PLAIN = (type(None), bool, int, float, str, bytes, torch.Tensor, torch.Size)


def _check_plain(value: Any, where: str) -> None:
    """Raise ``TypeError`` if ``value`` holds anything ``weights_only`` loading would refuse."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"training state key {where}[{key!r}] must be str or int")
            _check_plain(item, f"{where}[{key!r}]")
    elif not isinstance(value, _PLAIN):
        raise TypeError(
            f"training state {where} is a {type(value).__name__}; only tensors and plain Python "
            "values (int, float, str, bool, None, list, tuple, dict) can be saved"
        )


STATE_KEY = "attnkit.training_state"
"""Metadata key of a training-state file: the state as JSON, each tensor replaced by ``{"$tensor": name}``."""


def _to_json(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` as JSON, its tensors moved into ``tensors`` under names ``"0"``, ``"1"``, ...: tuples, dicts (whose
    keys may be ints), sizes and bytes tagged, so that :func:`_from_json` rebuilds them as they were."""
    if isinstance(value, torch.Tensor):
        name = str(len(tensors))
        tensors[name] = value.detach().cpu().contiguous().clone()  # its own storage: safetensors refuses shared ones
        return {"$tensor": name}
    if isinstance(value, torch.Size):
        return {"$size": list(value)}
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if isinstance(value, tuple):
        return {"$tuple": [_to_json(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_to_json(v, tensors) for v in value]
    if isinstance(value, dict):
        return {"$dict": [[k, _to_json(v, tensors)] for k, v in value.items()]}
    return value  # None, bool, int, float, str


def _from_json(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """What :func:`_to_json` made of a value, rebuilt."""
    if isinstance(value, list):
        return [_from_json(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    [(tag, inner)] = value.items()
    if tag == "$tensor":
        return tensors[inner]
    if tag == "$size":
        return torch.Size(inner)
    if tag == "$bytes":
        return bytes.fromhex(inner)
    if tag == "$tuple":
        return tuple(_from_json(v, tensors) for v in inner)
    if tag == "$dict":
        return {k: _from_json(v, tensors) for k, v in inner}
    raise ValueError(f"unknown tag {tag!r}")


def save_training_state(path: str | Path, state: dict[str, Any]) -> None:
    """Save optimizer/scheduler state, counters and RNG states as safetensors, atomically: the tensors as the file's
    tensors, the rest as JSON in its header (:data:`STATE_KEY`).

    Everything must be a tensor or a plain Python value; anything else raises ``TypeError`` now rather than at
    resume time.
    """
    _check_plain(state, "state")
    tensors: dict[str, torch.Tensor] = {}
    tree = json.dumps(_to_json(state, tensors))
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={STATE_KEY: tree}))


def load_training_state(path: str | Path) -> dict[str, Any]:
    """Load a training state written by :func:`save_training_state`; one that attnkit wrote with ``torch.save``
    before is read with ``weights_only=True``."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such training-state file; check the run directory to resume from")
    with open(path, "rb") as f:
        legacy = f.read(4) == b"PK\x03\x04"  # torch.save's zip archive
    try:
        state = torch.load(path, map_location="cpu", weights_only=True) if legacy else _read_state(path)
    except Exception as err:
        reason = _load_failure_reason(err)
        raise UserError(
            f"{path}: cannot load training state (corrupt file, or it holds objects other than tensors "
            f"and plain values, which attnkit never unpickles): {reason}"
        ) from None
    if not isinstance(state, dict):
        raise UserError(f"{path}: is not an attnkit training state (expected a dict, got {type(state).__name__})")
    return state


def _read_state(path: Path) -> Any:
    """The state in a safetensors file :func:`save_training_state` wrote (ValueError where there is none)."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        tree = (f.metadata() or {}).get(STATE_KEY)
        if tree is None:
            raise ValueError(f"no {STATE_KEY} in its header")
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iteration)
    return _from_json(json.loads(tree), tensors)


def _load_failure_reason(err: Exception) -> str:
    """The informative part of a ``torch.load`` error (its advice to drop ``weights_only`` is not)."""
    text = str(err)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
        text = text.split(" was not an allowed global")[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:200] if lines else type(err).__name__


def capture_rng_state(cuda_device: torch.device | None = None) -> dict[str, Any]:
    """The Python ``random``, torch CPU (and CUDA) generator states, as values ``weights_only`` accepts.

    :param cuda_device: take only this GPU's state (a distributed rank's own), not every GPU's.
    """
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss_next], "torch": torch.get_rng_state()}
    if cuda_device is not None:
        state["cuda"] = [torch.cuda.get_rng_state(cuda_device)]
    elif torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any], cuda_device: torch.device | None = None) -> None:
    """Restore what :func:`capture_rng_state` captured (with the same ``cuda_device``), so the same numbers follow."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and cuda_device is not None:
        torch.cuda.set_rng_state(state["cuda"][0], cuda_device)
    elif "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
