"""Reading corpora: parallel text and labelled text, streamed, with errors that name file and line.

Everything that touches a user's data file lives here, so every message about a bad file
comes from one place and names ``file:line`` (and the column or key where there is one).

* Files are streamed line by line (:func:`iter_lines`), so a corpus of any size passes through
  a bounded amount of memory; a line longer than :data:`MAX_LINE_BYTES` is skipped and counted
  (:class:`ReadStats`), never held whole. A NUL byte or invalid UTF-8 is an error naming the line.
* Parallel text for translation: :func:`iter_parallel` (:func:`read_parallel` collects it).
* Labelled text for classification: :mod:`attnkit.data.labelled`, on these readers.

Files may be plain or gzip-compressed (chosen by a ``.gz`` suffix) and must be UTF-8.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import BinaryIO

from ..common.errors import UserError

__all__ = [
    "MAX_LINE_BYTES",
    "ReadStats",
    "iter_kept_lines",
    "iter_lines",
    "iter_parallel",
    "read_lines",
    "read_parallel",
    "read_stream",
]

#: Longest line the readers hold, in bytes; a longer one is skipped and counted.
MAX_LINE_BYTES = 1 << 20

_UTF8_BOM_BYTES = b"\xef\xbb\xbf"
_READ_BUFFER = 1 << 20
_END = object()  # zip_longest's filler: one file of a pair ended


# --------------------------------------------------------------------------------------
# Reading files, line by line
# --------------------------------------------------------------------------------------


def base_suffix(path: Path) -> str:
    """Return the lower-case suffix that names the format, ignoring a trailing ``.gz``.

    ``train.tsv.gz`` -> ``.tsv``; ``train.de`` -> ``.de``; ``train.gz`` -> ``""``.
    """
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


@dataclass
class ReadStats:
    """What the streaming readers skipped: lines longer than ``max_line_bytes`` (never held whole in memory)."""

    long_lines: int = 0
    max_line_bytes: int = MAX_LINE_BYTES


def _open_binary(path: str | Path) -> BinaryIO:
    """Open a file for reading bytes (gzip when the name ends in ``.gz``), with errors as one-line messages."""
    p = Path(path)
    try:
        if p.suffix.lower() == ".gz":
            return gzip.open(p, "rb")  # noqa: SIM115 -- closed by the caller
        return open(p, "rb", buffering=_READ_BUFFER)  # noqa: SIM115 -- closed by the caller
    except FileNotFoundError:
        raise UserError(f"{path}: file not found; check the path (relative paths start from "
                        f"the current directory {Path.cwd()})") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, expected a text file") from None
    except PermissionError:
        raise UserError(f"{path}: permission denied; make the file readable") from None


def _gzip_error(path: str | Path, e: Exception) -> UserError:
    return UserError(f"{path}: not a valid gzip file ({e}); decompress it and drop the .gz "
                     f"suffix, or re-create it with gzip")


def iter_lines(path: str | Path, stats: ReadStats | None = None) -> Iterator[str | None]:
    """Stream a text file (gzip when it ends in ``.gz``) line by line, checking each line.

    Only the line terminator (``\\n`` or ``\\r\\n``) is removed, so leading/trailing spaces
    and tabs survive; a final line without terminator is kept; a file ending in a
    terminator does not produce an extra empty line. A UTF-8 byte-order mark is dropped.
    At most ``stats.max_line_bytes`` (+1) bytes are held at a time: a longer line, or a file
    without newlines, yields ``None`` for that line (it is skipped and counted in ``stats``).

    :raises UserError: missing file, not gzip, invalid UTF-8 or a NUL byte (a binary or
        corrupt file), each naming ``file:line`` (and the column).
    """
    stats = stats if stats is not None else ReadStats()
    cap = stats.max_line_bytes
    with _open_binary(path) as f:
        try:
            yield from _checked_lines(f, str(path), stats, cap)
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise _gzip_error(path, e) from None


def _checked_lines(f: BinaryIO, name: str, stats: ReadStats, cap: int) -> Iterator[str | None]:
    """The lines of ``f`` (see :func:`iter_lines`); ``name`` is used in messages."""
    line_no = 0
    while True:
        raw = f.readline(cap + 2)  # a line of `cap` bytes and its terminator (\r\n) fits
        if not raw:
            return
        line_no += 1
        unfinished = len(raw) == cap + 2 and not raw.endswith(b"\n")
        if unfinished:  # longer than the cap: skip to the next newline, a bounded piece at a time
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(cap)
        elif raw.endswith(b"\n"):
            raw = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
        if unfinished or len(raw) > cap:
            stats.long_lines += 1
            yield None
            continue
        if line_no == 1 and raw.startswith(_UTF8_BOM_BYTES):
            raw = raw[len(_UTF8_BOM_BYTES):]
        yield _decode_line(raw, name, line_no)


def _decode_line(raw: bytes, name: str, line_no: int) -> str:
    """One line's bytes as text: strict UTF-8 without NUL bytes."""
    nul = raw.find(0)
    if nul >= 0:
        raise UserError(f"{name}:{line_no}: NUL byte at column {nul + 1}: a binary or corrupt file, "
                        f"not text; check that this is the file you meant, or remove the NUL bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{name}:{line_no}: invalid UTF-8 at column {e.start + 1} (byte 0x{raw[e.start]:02x}); "
                        f"convert the file to UTF-8, e.g. `iconv -f latin1 -t utf-8`") from None


def iter_kept_lines(path: str | Path) -> Iterator[str]:
    """The lines of ``path`` that :func:`iter_lines` does not skip (over-long ones are left out)."""
    return (line for line in iter_lines(path) if line is not None)


def read_stream(f: BinaryIO, name: str) -> list[str]:
    """All lines of an open binary stream (standard input), checked like :func:`iter_lines`.

    :raises UserError: invalid UTF-8, a NUL byte, or a line longer than :data:`MAX_LINE_BYTES`.
    """
    lines = _checked_lines(f, name, ReadStats(), MAX_LINE_BYTES)
    return [_whole(line, name, i) for i, line in enumerate(lines, start=1)]


def _whole(line: str | None, name: str, line_no: int) -> str:
    """``line``, or an error when it was longer than the cap (where skipping it would misalign outputs)."""
    if line is None:
        raise UserError(f"{name}:{line_no}: line longer than {MAX_LINE_BYTES} bytes; split it")
    return line


def read_text(path: str | Path) -> str:
    """A whole text file as one string, each line ending in a newline (checked as :func:`read_lines` checks)."""
    return "".join(line + "\n" for line in read_lines(path))


def read_lines(path: str | Path) -> list[str]:
    """Read a text file (gzip when it ends in ``.gz``) into a list of lines; see :func:`iter_lines`.

    :raises UserError: missing file, invalid UTF-8, a NUL byte or an over-long line (the message gives ``file:line``).
    """
    return [_whole(line, str(path), i) for i, line in enumerate(iter_lines(path), start=1)]


def iter_parallel(
    src_path: str | Path,
    tgt_path: str | Path | None = None,
    *,
    src_key: str = "src",
    tgt_key: str = "tgt",
    stats: ReadStats | None = None,
) -> Iterator[tuple[str, str]]:
    """Stream a parallel corpus as ``(source, target)`` pairs.

    Two layouts are accepted:

    * two line-aligned files, ``src_path`` and ``tgt_path`` (any suffix);
    * one file when ``tgt_path`` is None: ``.tsv`` with exactly two tab-separated columns
      (source, target; no header) or ``.jsonl`` with one JSON object per line holding the
      keys ``src_key`` and ``tgt_key``. Blank lines in ``.jsonl`` are skipped.

    Any of them may be gzip-compressed (``.gz`` suffix). Empty sentences are kept here;
    :func:`filter_examples` drops them after tokenization and reports how many. A pair with a
    line longer than ``stats.max_line_bytes`` on either side is skipped and counted in ``stats``.

    :raises UserError: unequal line counts (naming both files and counts), a malformed
        line (naming ``file:line``), or an unsupported single-file suffix.
    """
    stats = stats if stats is not None else ReadStats()
    if tgt_path is not None:
        n_src = n_tgt = 0
        for s, t in zip_longest(iter_lines(src_path, stats), iter_lines(tgt_path, stats), fillvalue=_END):
            n_src += s is not _END
            n_tgt += t is not _END
            if isinstance(s, str) and isinstance(t, str):  # None: an over-long line, skipped with its partner
                yield s, t
        if n_src != n_tgt:
            raise UserError(
                f"parallel files differ in length: {src_path} has {n_src} lines but "
                f"{tgt_path} has {n_tgt}; they must be line-aligned (line i of one is "
                f"the translation of line i of the other)"
            )
        return

    suffix = base_suffix(Path(src_path))
    if suffix == ".tsv":
        yield from _parallel_tsv(src_path, stats)
    elif suffix == ".jsonl":
        yield from _parallel_jsonl(src_path, src_key, tgt_key, stats)
    else:
        raise UserError(
            f"{src_path}: a single parallel file must end in .tsv or .jsonl (optionally .gz), "
            f"got '{suffix or Path(src_path).name}'; rename it or give a separate target file"
        )


def read_parallel(src_path: str | Path, tgt_path: str | Path | None = None, *, src_key: str = "src",
                  tgt_key: str = "tgt") -> list[tuple[str, str]]:
    """All pairs of :func:`iter_parallel` in a list (validation and test sets)."""
    return list(iter_parallel(src_path, tgt_path, src_key=src_key, tgt_key=tgt_key))


def _parallel_tsv(path: str | Path, stats: ReadStats) -> Iterator[tuple[str, str]]:
    """Parse ``source<TAB>target`` lines; see :func:`iter_parallel`."""
    for line_no, line in enumerate(iter_lines(path, stats), start=1):
        if line is None:
            continue
        fields = line.split("\t")
        if len(fields) != 2:
            raise UserError(
                f"{path}:{line_no}: expected 2 tab-separated columns (source<TAB>target), "
                f"found {len(fields)}; remove stray tabs or fix the line"
            )
        yield fields[0], fields[1]


def _parallel_jsonl(path: str | Path, src_key: str, tgt_key: str, stats: ReadStats) -> Iterator[tuple[str, str]]:
    """Parse one JSON object per line; see :func:`iter_parallel`."""
    for line_no, line in enumerate(iter_lines(path, stats), start=1):
        if line is None or not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{line_no}:{e.colno}: invalid JSON ({e.msg}); each line must "
                            f"be one object like {{\"{src_key}\": ..., \"{tgt_key}\": ...}}") from None
        if not isinstance(obj, dict):
            raise UserError(f"{path}:{line_no}: expected a JSON object, found "
                            f"{type(obj).__name__}; each line must be one object with keys "
                            f"'{src_key}' and '{tgt_key}'")
        values: list[str] = []
        for key in (src_key, tgt_key):
            if key not in obj:
                found = ", ".join(repr(k) for k in obj) or "none"
                raise UserError(f"{path}:{line_no}: missing key '{key}' (keys found: {found}); "
                                f"add it or set the source/target key names in the config")
            value = obj[key]
            if not isinstance(value, str):
                raise UserError(f"{path}:{line_no}: key '{key}' must be a string, found "
                                f"{type(value).__name__}")
            values.append(value)
        yield values[0], values[1]
