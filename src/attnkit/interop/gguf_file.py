"""A GGUF file (llama.cpp's format) as the import reads it.

:class:`GGUFFile` wraps ``gguf.GGUFReader`` (metadata by key, tensors by name, dequantized), every problem a one-line
error naming the file and the key or tensor; :func:`is_gguf` tells a GGUF from a directory.
:mod:`attnkit.interop.gguf` maps its model, :mod:`attnkit.interop.gguf_tokenizer` its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from ..common.errors import UserError

__all__ = ["MAGIC", "GGUFFile", "is_gguf"]

#: The first four bytes of every GGUF file.
MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """A file named ``*.gguf``, or one that starts with GGUF's magic bytes."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == MAGIC
    except OSError:  # missing, a directory, unreadable
        return False


class GGUFFile:
    """A GGUF file as ``gguf.GGUFReader`` reads it: metadata by key and tensors by name, dequantized, every
    problem a one-line :class:`UserError` naming the file and the key or tensor."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"{self.path}: not found (give a .gguf file or a Hugging Face model directory)")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the reader raises ValueError, IndexError, ... on a file that is not a whole GGUF
            reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            raise UserError(f"{self.path}: not a readable GGUF file ({reason})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.value("general.architecture", str)
        if self.value("split.count", int, 1) > 1:
            raise UserError(f"{self.path}: key 'split.count' is {self.value('split.count', int)}: this is one part of "
                            f"a split GGUF; merge the parts first (llama.cpp's `llama-gguf-split --merge`)")

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def value(self, key: str, kind: type, default: Any = ...) -> Any:
        """Metadata ``key``, checked to be a ``kind`` (int, float, str, bool or list); ``default`` when absent (and
        one is given)."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is ...:
                raise UserError(f"{self.path}: missing key '{key}'")
            return default
        value = field.contents()
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            shown = value if not isinstance(value, list) else f"a list of {len(value)}"
            raise UserError(f"{self.path}: key '{key}' is {shown!r}, expected {kind.__name__}")
        return value

    def arch_value(self, name: str, kind: type, default: Any = ...) -> Any:
        """``{general.architecture}.{name}``."""
        return self.value(f"{self.arch}.{name}", kind, default)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in torch's order (rows first; GGUF lists the row length first)."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape))

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Tensor ``name`` as float32, dequantized, checked to have ``shape``."""
        if name not in self.tensors:
            raise UserError(f"{self.path}: missing tensor '{name}'")
        if self.shape(name) != shape:
            raise UserError(f"{self.path}: tensor '{name}' has shape {self.shape(name)}, but the metadata implies "
                            f"{shape}")
        t = self.tensors[name]
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise UserError(f"{self.path}: tensor '{name}' has type {t.tensor_type.name}, which the gguf package "
                            f"cannot dequantize") from None
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # (rows, ..., cols), a copy
