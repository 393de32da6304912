"""Reading a local Hugging Face model directory, and writing the attnkit run made from it.

A Hugging Face model directory holds ``config.json`` (the architecture), the weights
(``model.safetensors``, shards listed in ``model.safetensors.index.json``, or a pickled
``pytorch_model.bin``) and the tokenizer's files. Nothing is downloaded: the user points at a
directory they have. Every problem is a one-line :class:`~attnkit.common.errors.UserError` naming
the file and, where there is one, the key.

A pickled ``pytorch_model.bin`` is read only with ``torch.load(weights_only=True)``, which builds
tensors and refuses any other object; a file that needs more is refused with the command that
converts it to safetensors.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..common.errors import UserError
from ..config.loader import dump_config
from ..config.schema import RunConfig
from ..runs.checkpoint import save_weights
from ..runs.layout import CLASSES_FILE, CONFIG_FILE, IMPORTED_FILE

CONFIG = "config.json"
SAFETENSORS, SAFETENSORS_INDEX, PICKLED = "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"
CONVERT_HINT = ("convert it to safetensors in Python: `MODEL.from_pretrained(DIR).save_pretrained(DIR, "
                "safe_serialization=True)`")


def read_json(path: Path) -> Any:
    """A JSON file's value, or a one-line error naming the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}:{e.colno}: invalid JSON ({e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read ({type(e).__name__})") from None


class HFDirectory:
    """A local Hugging Face model directory: its ``config.json`` and files, read with clear errors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise UserError(f"{self.path}: not a directory; give a local Hugging Face model directory "
                            f"(config.json, model.safetensors, tokenizer files), or a GGUF file")
        config = read_json(self.path / CONFIG)
        if not isinstance(config, dict):
            raise UserError(f"{self.path / CONFIG}: expected a JSON object")
        self.config: dict[str, Any] = config

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    def file(self, name: str, what: str) -> Path:
        """``DIR/name``, or an error saying it is missing and what it is for."""
        path = self.path / name
        if not path.is_file():
            raise UserError(f"{path}: missing ({what})")
        return path

    def json(self, name: str, default: Any = None) -> Any:
        """An optional JSON file's value (``default`` when absent)."""
        path = self.path / name
        return read_json(path) if path.exists() else default

    def key(self, key: str, kind: type | tuple[type, ...] = int, default: Any = None) -> Any:
        """``config.json``'s ``key``, checked to be a ``kind`` (``default`` when absent and one is given)."""
        if key not in self.config or self.config[key] is None:
            if default is not None:
                return default
            raise UserError(f"{self.path / CONFIG}: missing key '{key}'")
        value = self.config[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise UserError(f"{self.path / CONFIG}: key '{key}' is {value!r}, expected {_kind_name(kind)}")
        return value

    def same(self, *keys: str) -> int:
        """The one value several keys share (attnkit's encoder and decoder have one width, one head count)."""
        values = [self.key(k) for k in keys]
        if len(set(values)) > 1:
            listed = ", ".join(f"'{k}' {v}" for k, v in zip(keys, values, strict=True))
            raise UserError(f"{self.path / CONFIG}: {listed} differ; attnkit's encoder and decoder share one value")
        return values[0]

    def choice(self, key: str, allowed: dict[str, Any], default: str | None = None) -> Any:
        """``allowed[config[key]]``, or an error listing what attnkit can represent."""
        value = self.key(key, str, default)
        if value not in allowed:
            raise UserError(f"{self.path / CONFIG}: key '{key}' is {value!r}, which attnkit cannot represent "
                            f"(it has {', '.join(sorted(allowed))})")
        return allowed[value]

    def refuse(self, key: str, wanted: Any, why: str) -> None:
        """An error when ``config[key]`` is set to something other than ``wanted`` (absent is fine)."""
        value = self.config.get(key, wanted)
        if value is not None and value != wanted:
            raise UserError(f"{self.path / CONFIG}: key '{key}' is {value!r}; attnkit {why}")

    def weights(self) -> dict[str, torch.Tensor]:
        """Every tensor of the checkpoint, on the CPU, by its Hugging Face name."""
        if (self.path / SAFETENSORS).is_file():
            return _safetensors(self.path / SAFETENSORS)
        if (self.path / SAFETENSORS_INDEX).is_file():
            index = read_json(self.path / SAFETENSORS_INDEX)
            shards = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(shards, dict):
                raise UserError(f"{self.path / SAFETENSORS_INDEX}: missing key 'weight_map'")
            state: dict[str, torch.Tensor] = {}
            for name in sorted(set(shards.values())):
                state.update(_safetensors(self.file(str(name), f"a shard named in {SAFETENSORS_INDEX}")))
            return state
        if (self.path / PICKLED).is_file():
            return _pickled(self.path / PICKLED)
        raise UserError(f"{self.path}: no weights ({SAFETENSORS}, {SAFETENSORS_INDEX} or {PICKLED})")


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "true or false",
                        list: "a list", dict: "an object"}.get(k, k.__name__) for k in kinds)


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0][:120]})") from None


def _pickled(path: Path) -> dict[str, torch.Tensor]:
    """A ``pytorch_model.bin``, unpickled only as tensors (``weights_only=True``)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # weights_only refuses any non-tensor object; corrupt files raise many kinds
        reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise UserError(f"{path}: cannot be read safely as tensors ({reason}); {CONVERT_HINT}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path}: expected a dictionary of tensors; {CONVERT_HINT}")
    return state


def tensor(state: dict[str, torch.Tensor], path: Path, *names: str) -> torch.Tensor:
    """The first of ``names`` the checkpoint has (tied weights are stored under one of their names)."""
    for name in names:
        if name in state:
            return state[name].float()
    raise UserError(f"{path}: the weights lack '{names[0]}'; is this the model config.json describes?")


def check_shape(t: torch.Tensor, shape: Iterable[int], name: str, path: Path) -> torch.Tensor:
    """``t`` when it has ``shape``, else an error naming the tensor and both shapes."""
    shape = tuple(shape)
    if tuple(t.shape) != shape:
        raise UserError(f"{path}: '{name}' has shape {tuple(t.shape)}, but config.json implies {shape}")
    return t


def write_directory(out: str | Path, write: Callable[[Path], object], *, marker: str, force: bool = False) -> Path:
    """Write ``out`` as a whole: ``write(directory)`` fills a hidden sibling, which is renamed into place at the
    end, so an error leaves no half-written ``out``. ``--force`` replaces only a directory holding ``marker``."""
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"{out} already exists; choose a new directory or pass --force to replace it")
    if out.exists() and not (out / marker).exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and holds no {marker}; --force replaces only an earlier one of these")
    tmp = out.with_name(f".{out.name}.tmp-write")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_run(out: str | Path, cfg: RunConfig, state: dict[str, torch.Tensor], source: Path,
              write_tokenizer: Callable[[Path], object], classes: list[str] | None = None,
              force: bool = False) -> Path:
    """Write an imported run into ``out`` as a whole (:func:`write_directory`): ``config.yaml``, the tokenizer
    (``write_tokenizer(directory)``), ``classes.json`` for a classifier and the weights as ``imported.safetensors``.
    """
    def write(directory: Path) -> None:
        write_tokenizer(directory)
        if classes is not None:
            (directory / CLASSES_FILE).write_text(json.dumps(classes) + "\n", encoding="utf-8")
        save_weights(directory / IMPORTED_FILE, state, {"imported_from": str(source.resolve())})
        dump_config(cfg, directory / CONFIG_FILE)

    return write_directory(out, write, marker=IMPORTED_FILE, force=force)
