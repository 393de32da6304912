"""Token sequences stored flat: in memory, or written once and memory-mapped.

:class:`TokenArrays` gathers padded batches from flat ids; :class:`NpyWriter` and :class:`SideWriter`
append to ``.npy`` files whose length is known only at the end (:mod:`attnkit.data.prepare` writes
prepared data with them); :class:`MappedTokenArrays` reads them back without letting the resident
set grow with the corpus.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from .batching import padded_length


@dataclass
class TokenArrays:
    """Token-id sequences stored flat: sequence ``i`` is ``ids[offsets[i]:offsets[i] + lengths[i]]``.

    The arrays may be memory-mapped (prepared training data, :mod:`attnkit.data.prepare`) or in memory
    (:meth:`from_lists`, for validation data); :meth:`pad` gathers a batch from either.

    :param ids: (N_tokens,) token ids (uint16 when the vocabulary fits, else int32).
    :param offsets: (N + 1,) int64 start of each sequence, then the total.
    :param lengths: (N,) tokens per sequence.
    """

    ids: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray

    @classmethod
    def from_lists(cls, seqs: Sequence[Sequence[int]]) -> TokenArrays:
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=int(offsets[-1]))
        return cls(ids, offsets, lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> list[int]:
        start = int(self.offsets[i])
        return self.ids[start: start + int(self.lengths[i])].tolist()

    def pad(self, indices: Sequence[int] | np.ndarray, pad_id: int, multiple: int = 1, *,
            bos: int | None = None, eos: int | None = None) -> torch.Tensor:
        """Sequences ``indices`` as rows ``[bos] + ids + [eos]`` (each marker when given), right-padded like
        :func:`pad_batch` -> LongTensor (B, T)."""
        idx = np.asarray(indices, dtype=np.int64)
        if len(idx) == 0:
            raise ValueError("pad needs at least one sequence")
        starts, lens = self.offsets[idx], self.lengths[idx].astype(np.int64)  # (B,), (B,)
        first = int(bos is not None)
        T = padded_length(int(lens.max()) + first + int(eos is not None), multiple)
        col = np.arange(T)[None, :] - first  # (1, T): position within the sequence
        inside = (col >= 0) & (col < lens[:, None])  # (B, T)
        out = np.full((len(idx), T), pad_id, dtype=np.int64)  # (B, T)
        out[inside] = self.ids[(starts[:, None] + col)[inside]]  # one gather from the (memory-mapped) ids
        if bos is not None:
            out[:, 0] = bos
        if eos is not None:
            out[np.arange(len(idx)), first + lens] = eos
        return torch.from_numpy(out)



#: Bytes of a .npy header written by :class:`NpyWriter` (fixed, so it can be rewritten in place).
_NPY_HEADER_BYTES = 128


class NpyWriter:
    """Append to a 1-D ``.npy`` file whose length is known only at the end (the header is rewritten then)."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype, self.n = path, dtype, 0
        self.f: BinaryIO = open(path, "wb")  # noqa: SIM115 -- closed in close()
        self.f.write(self._header())

    def _header(self) -> bytes:
        text = repr({"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                     "shape": (self.n,)}).encode("latin1")
        pad = _NPY_HEADER_BYTES - 10 - len(text) - 1
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", _NPY_HEADER_BYTES - 10) + text + b" " * pad + b"\n"

    def write(self, values: np.ndarray) -> None:
        self.f.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.n += len(values)

    def close(self) -> None:
        self.f.seek(0)
        self.f.write(self._header())
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


class SideWriter:
    """One side's ``ids``, ``offsets`` and ``lengths`` files."""

    def __init__(self, out: Path, name: str, id_dtype: np.dtype, len_dtype: np.dtype) -> None:
        self.ids = NpyWriter(out / f"{name}.ids.npy", id_dtype)
        self.offsets = NpyWriter(out / f"{name}.offsets.npy", np.dtype(np.int64))
        self.lengths = NpyWriter(out / f"{name}.lengths.npy", len_dtype)
        self.offsets.write(np.zeros(1, dtype=np.int64))
        self.examples = self.tokens = 0

    def add(self, flat: np.ndarray, lens: np.ndarray, keep: np.ndarray | None) -> None:
        """Append a chunk's sequences (``flat`` ids, ``lens`` per sequence), only those ``keep`` marks."""
        if keep is not None and not keep.all():
            flat, lens = flat[np.repeat(keep, lens)], lens[keep]
        self.ids.write(flat)
        self.offsets.write(self.tokens + np.cumsum(lens))
        self.lengths.write(lens)
        self.examples += len(lens)
        self.tokens += int(len(flat))

    def close(self) -> None:
        for w in (self.ids, self.offsets, self.lengths):
            w.close()


def mapped(path: Path) -> np.ndarray:
    """A read-only memory map of a ``.npy`` file, advised for random access (no read-ahead around a batch)."""
    array = np.load(path, mmap_mode="r")
    raw = getattr(array, "_mmap", None)
    if raw is not None and hasattr(mmap, "MADV_RANDOM"):
        raw.madvise(mmap.MADV_RANDOM)
    return array


class MappedTokenArrays(TokenArrays):
    """:class:`TokenArrays` over memory-mapped files that keeps few of their pages in this process's resident set.

    Every page a batch touches stays mapped (with the kernel's fault-around, 64 KB about each example
    gathered), so over an epoch the resident set would grow to the whole file. Every
    :attr:`RELEASE_EVERY` batches the mapped pages are dropped from this process (``MADV_DONTNEED``;
    the file is read-only, so nothing is lost): they stay in the OS page cache, shared by every
    process that maps the file, and the next touch maps them again without reading the disk. Memory
    then stays flat in the corpus size.
    """

    RELEASE_EVERY = 4

    def __init__(self, ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
        super().__init__(ids, offsets, lengths)
        self._gathers = 0

    def pad(self, indices, pad_id: int, multiple: int = 1, *, bos: int | None = None,
            eos: int | None = None):
        out = super().pad(indices, pad_id, multiple, bos=bos, eos=eos)
        self._gathers += 1
        if self._gathers % self.RELEASE_EVERY == 0:
            self.release()
        return out

    def release(self) -> None:
        """Drop the mapped pages from this process's resident set (they stay in the page cache)."""
        for array in (self.ids, self.offsets):
            raw = getattr(array, "_mmap", None)
            if raw is not None and hasattr(mmap, "MADV_DONTNEED"):
                raw.madvise(mmap.MADV_DONTNEED)

