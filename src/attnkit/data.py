"""Reading corpora and cutting them into batches.

Everything that touches a user's data file lives here, so every message about a bad file
comes from one place and names ``file:line`` (and the column or key where there is one).

* Files are streamed line by line (:func:`iter_lines`), so a corpus of any size passes through
  a bounded amount of memory; a line longer than :data:`MAX_LINE_BYTES` is skipped and counted
  (:class:`ReadStats`), never held whole. A NUL byte or invalid UTF-8 is an error naming the line.
* Parallel text for translation: :func:`iter_parallel` (:func:`read_parallel` collects it).
* Labelled text for classification: :class:`LabelledReader` (:func:`read_labelled` collects it).
* Length filtering after tokenization: :func:`filter_lengths`, :func:`filter_examples`.
* Token-budget batching: :func:`make_batches`, :func:`padding_fraction`, :func:`pad_batch`, and
  :class:`TokenArrays`, sequences stored flat (memory-mapped when prepared) and gathered into batches.

Files may be plain or gzip-compressed (chosen by a ``.gz`` suffix) and must be UTF-8.
"""

from __future__ import annotations

import csv
import gzip
import json
import random
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, zip_longest
from pathlib import Path
from typing import BinaryIO, overload

import numpy as np
import torch
from numpy.typing import ArrayLike

from attnkit.errors import UserError

__all__ = [
    "Batches",
    "FilterStats",
    "LabelledData",
    "LabelledReader",
    "LABEL_COLUMN_NAMES",
    "MAX_LINE_BYTES",
    "ReadStats",
    "TEXT_COLUMN_NAMES",
    "TokenArrays",
    "filter_examples",
    "filter_lengths",
    "iter_lines",
    "iter_parallel",
    "make_batches",
    "pad_batch",
    "padding_fraction",
    "read_labelled",
    "read_lines",
    "read_parallel",
    "read_stream",
]

#: Header names recognised as the label column of a classification file (case-insensitive).
LABEL_COLUMN_NAMES: tuple[str, ...] = ("label", "labels", "class", "sentiment", "target", "y")
#: Header names recognised as the text column of a classification file (case-insensitive).
TEXT_COLUMN_NAMES: tuple[str, ...] = ("sentence", "text", "content", "review", "document")
#: Longest line the readers hold, in bytes; a longer one is skipped and counted.
MAX_LINE_BYTES = 1 << 20

_UTF8_BOM_BYTES = b"\xef\xbb\xbf"
_READ_BUFFER = 1 << 20
_END = object()  # zip_longest's filler: one file of a pair ended
#: Multiplier that mixes ``seed`` and ``epoch`` into one shuffling seed (a prime, so that
#: ``(seed, epoch)`` pairs do not collide for any realistic number of epochs).
_EPOCH_SEED_STRIDE = 100003


# --------------------------------------------------------------------------------------
# Reading files, line by line
# --------------------------------------------------------------------------------------


def _base_suffix(path: Path) -> str:
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

    suffix = _base_suffix(Path(src_path))
    if suffix == ".tsv":
        yield from _parallel_tsv(src_path, stats)
    elif suffix == ".jsonl":
        yield from _parallel_jsonl(src_path, src_key, tgt_key, stats)
    else:
        raise UserError(
            f"{src_path}: a single parallel file must end in .tsv or .jsonl (optionally .gz), "
            f"got '{suffix or Path(src_path).name}'; rename it or give a separate target file"
        )


def read_parallel(
    src_path: str | Path,
    tgt_path: str | Path | None = None,
    *,
    src_key: str = "src",
    tgt_key: str = "tgt",
    stats: ReadStats | None = None,
) -> list[tuple[str, str]]:
    """All pairs of :func:`iter_parallel` in a list (validation and test sets)."""
    return list(iter_parallel(src_path, tgt_path, src_key=src_key, tgt_key=tgt_key, stats=stats))


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


# --------------------------------------------------------------------------------------
# Labelled text (classification)
# --------------------------------------------------------------------------------------


@dataclass
class LabelledData:
    """Texts and their string labels read from a ``.tsv``/``.csv`` file with a header.

    :param texts: one text per row.
    :param labels: one label per row, surrounding whitespace stripped.
    :param text_column: header name the texts were read from.
    :param label_column: header name the labels were read from.
    :param path: the file they came from.
    :param groups: one group id per row (e.g. the movie a review is about) when a group column was read.
    """

    texts: list[str]
    labels: list[str]
    text_column: str
    label_column: str
    path: str
    groups: list[str] | None = None

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def classes(self) -> list[str]:
        """Distinct labels, sorted (a stable label -> index order)."""
        return sorted(set(self.labels))


def _is_number(field: str) -> bool:
    """True when ``field`` parses as a number (a sign that a 'header' is really data)."""
    try:
        float(field)
    except ValueError:
        return False
    return True


def _header_looks_like_data(header: list[str]) -> bool:
    """Heuristic: a header with a numeric or empty field, or a long multi-word field, is data."""
    return any(_is_number(h) or not h or len(h.split()) >= 4 for h in header)


def _detect_column(header: list[str], names: tuple[str, ...]) -> list[str]:
    """Header entries whose lower-cased name is in ``names``."""
    return [h for h in header if h.lower() in names]


def _choose_column(
    path: str | Path, header: list[str], given: str | None, role: str, names: tuple[str, ...]
) -> str:
    """Return the header name to use for ``role`` ('text' or 'label'), given or detected."""
    config_key = f"data.{role}_column"
    shown = ", ".join(repr(h) for h in header)
    if given is not None:
        if given in header:
            return given
        if _header_looks_like_data(header) and not _detect_column(header, names):
            raise _no_header_error(path, header)
        raise UserError(f"{path}: {role} column '{given}' not found; available columns: {shown}; "
                        f"fix {config_key}")
    found = _detect_column(header, names)
    if len(found) == 1:
        return found[0]
    if not found and _header_looks_like_data(header):
        raise _no_header_error(path, header)
    if found:
        problem = f"{len(found)} columns could be it ({', '.join(repr(f) for f in found)})"
    else:
        problem = f"none is named {'/'.join(names)}"
    raise UserError(f"{path}: cannot tell which column holds the {role}: header is [{shown}] and "
                    f"{problem}; set {config_key} to one of the header names")


def _no_header_error(path: str | Path, header: list[str]) -> UserError:
    """The error for a file whose first row is data rather than column names."""
    first = header[0] if header else ""
    return UserError(f"{path}:1: the file has no header (first row starts with {first!r}); add a "
                     f"header line naming the columns, e.g. 'sentence<TAB>label'")


class LabelledReader:
    """A classification file read row by row: ``.tsv`` (tab, no quoting) or ``.csv`` (comma, quoted fields).

    The first row must be a header. Without explicit column names the label column is the
    single header in :data:`LABEL_COLUMN_NAMES` and the text column the single header in
    :data:`TEXT_COLUMN_NAMES` (both case-insensitive). Blank rows are skipped. The header is
    read when the reader is made; iterating streams ``(text, label)`` rows (labels stripped).

    :param path: the file (optionally ``.gz``).
    :param text_column: header name of the text column (config ``data.text_column``).
    :param label_column: header name of the label column (config ``data.label_column``).
    :param group_column: header name of a column whose value is each row's group (config
        ``data.group_column``), e.g. the movie, for a held-out split that keeps each group on one side.
    :param stats: counts rows skipped for a line over the length cap.
    :raises UserError: no/ambiguous header, a named column missing, a row with the wrong
        number of fields, an empty text or label (each naming ``file:line``).
    """

    def __init__(self, path: str | Path, *, text_column: str | None = None, label_column: str | None = None,
                 group_column: str | None = None, stats: ReadStats | None = None) -> None:
        self.path = str(path)
        self.stats = stats if stats is not None else ReadStats()
        suffix = _base_suffix(Path(path))
        if suffix == ".tsv":
            self._delimiter, self._quoting, self._kind = "\t", csv.QUOTE_NONE, "tab"
        elif suffix == ".csv":
            self._delimiter, self._quoting, self._kind = ",", csv.QUOTE_MINIMAL, "comma"
        else:
            raise UserError(f"{path}: labelled data must be .tsv or .csv (optionally .gz), got "
                            f"'{suffix or Path(path).name}'; rename or convert the file")
        line_no = [0]
        rows = self._rows(ReadStats(max_line_bytes=self.stats.max_line_bytes), line_no)
        header = next(rows, None)
        rows.close()
        if header is None:
            raise UserError(f"{path}: file is empty; expected a header line and data rows")
        self.header = [h.strip() for h in header]
        self.text_column = _choose_column(path, self.header, text_column, "text", TEXT_COLUMN_NAMES)
        self.label_column = _choose_column(path, self.header, label_column, "label", LABEL_COLUMN_NAMES)
        if self.text_column == self.label_column:
            raise UserError(f"{path}: text and label column are both '{self.text_column}'; set "
                            f"data.text_column and data.label_column to different columns")
        self.group_column = (None if group_column is None
                             else _choose_column(path, self.header, group_column, "group", ()))

    def _rows(self, stats: ReadStats, line_no: list[int]) -> Iterator[list[str]]:
        """csv records; ``line_no[0]`` is the file line where the latest record ends."""
        def lines() -> Iterator[str]:
            for i, line in enumerate(iter_lines(self.path, stats), start=1):
                line_no[0] = i
                if line is not None:
                    yield line + "\n"  # the terminator lets a quoted CSV field span lines

        reader = csv.reader(lines(), delimiter=self._delimiter, quoting=self._quoting)
        try:
            yield from reader
        except csv.Error as e:
            raise UserError(f"{self.path}:{line_no[0]}: malformed {self._kind}-separated row ({e})") from None

    def __iter__(self) -> Iterator[tuple[str, str]]:
        """``(text, label)`` rows."""
        return ((text, label) for text, label, _ in self.keyed())

    def keyed(self) -> Iterator[tuple[str, str, str]]:
        """``(text, label, key)`` rows; the key is the row's group (``group_column``), else its row number.

        The key decides which side of a held-out split the row lands on (:func:`attnkit.documents.is_held_out`).
        """
        path, header = self.path, self.header
        text_idx, label_idx = header.index(self.text_column), header.index(self.label_column)
        group_idx = None if self.group_column is None else header.index(self.group_column)
        n = 0
        line_no = [0]
        rows = self._rows(self.stats, line_no)
        next(rows, None)  # the header
        for row in rows:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) != len(header):
                raise UserError(f"{path}:{line_no[0]}: expected {len(header)} {self._kind}-separated fields "
                                f"like the header, found {len(row)}; fix the row (quote fields "
                                f"that contain the delimiter in CSV)")
            row_text, row_label = row[text_idx], row[label_idx].strip()
            if not row_text.strip():
                raise UserError(f"{path}:{line_no[0]}:{self.text_column}: empty text; fill it in or "
                                f"remove the row")
            if not row_label:
                raise UserError(f"{path}:{line_no[0]}:{self.label_column}: empty label; fill it in or "
                                f"remove the row")
            yield row_text, row_label, str(n) if group_idx is None else row[group_idx].strip()
            n += 1


def read_labelled(
    path: str | Path, *, text_column: str | None = None, label_column: str | None = None,
    group_column: str | None = None,
) -> LabelledData:
    """All rows of a classification file in memory; see :class:`LabelledReader` for the format and errors."""
    reader = LabelledReader(path, text_column=text_column, label_column=label_column, group_column=group_column)
    rows = list(reader.keyed())
    return LabelledData(texts=[t for t, _, _ in rows], labels=[label for _, label, _ in rows],
                        text_column=reader.text_column, label_column=reader.label_column, path=str(path),
                        groups=None if group_column is None else [g for _, _, g in rows])


# --------------------------------------------------------------------------------------
# Filtering
# --------------------------------------------------------------------------------------


@dataclass
class FilterStats:
    """What :func:`filter_examples` kept and why it dropped the rest.

    :param kept: pairs kept.
    :param empty: pairs dropped because a side had no tokens.
    :param too_long: pairs dropped because a side had more than ``max_len`` tokens.
    :param max_len: the limit used.
    """

    kept: int
    empty: int
    too_long: int
    max_len: int

    @property
    def total(self) -> int:
        """Number of pairs looked at."""
        return self.kept + self.empty + self.too_long

    def __add__(self, other: FilterStats) -> FilterStats:
        """The counts of two parts of one corpus (filtered with the same ``max_len``)."""
        return FilterStats(self.kept + other.kept, self.empty + other.empty, self.too_long + other.too_long,
                           self.max_len)

    def __str__(self) -> str:
        return (f"kept {self.kept} of {self.total} pairs (dropped {self.empty} with an empty side, "
                f"{self.too_long} with a side longer than {self.max_len} tokens)")


def filter_lengths(src_lens: ArrayLike, tgt_lens: ArrayLike, max_len: int) -> tuple[np.ndarray, FilterStats]:
    """Which pairs to keep, from their side lengths: both sides non-empty and at most ``max_len`` tokens.

    :return: a boolean mask over the pairs and the counts.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    src, tgt = np.asarray(src_lens, dtype=np.int64), np.asarray(tgt_lens, dtype=np.int64)
    empty = (src == 0) | (tgt == 0)
    too_long = ~empty & ((src > max_len) | (tgt > max_len))
    keep = ~(empty | too_long)
    return keep, FilterStats(kept=int(keep.sum()), empty=int(empty.sum()), too_long=int(too_long.sum()),
                             max_len=max_len)


def filter_examples(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]], max_len: int
) -> tuple[list[int], FilterStats]:
    """Keep the token-id pairs whose sides are both non-empty and at most ``max_len`` long (:func:`filter_lengths`).

    :param examples: ``(src_ids, tgt_ids)`` per example.
    :param max_len: longest allowed side, in tokens (inclusive).
    :return: indices of kept examples (ascending) and the counts.
    """
    keep, stats = filter_lengths([len(s) for s, _ in examples], [len(t) for _, t in examples], max_len)
    return np.flatnonzero(keep).tolist(), stats


# --------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------


def python_random_floats(seed: str | int, n: int) -> np.ndarray:
    """``[random.Random(seed).random() for _ in range(n)]`` as a float64 array, without a Python loop.

    Python's ``random`` and numpy's legacy ``RandomState`` are the same Mersenne Twister with the
    same 53-bit double construction, so numpy continues from Python's seeded state.
    """
    version, state, _ = random.Random(seed).getstate()
    rs = np.random.RandomState()
    rs.set_state(("MT19937", np.array(state[:-1], dtype=np.uint32), state[-1]))
    return rs.random_sample(n)


class Batches(Sequence[list[int]]):
    """An epoch's batches (lists of example indices), held as two arrays rather than millions of ints.

    Batch ``b`` is ``order[starts[b]:ends[b]]``. Indexing gives a list of ints; equality with
    another :class:`Batches` or a list of lists compares the batches.
    """

    def __init__(self, order: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        self.order, self.starts, self.ends = order, starts, ends

    def __len__(self) -> int:
        return len(self.starts)

    @overload
    def __getitem__(self, i: int) -> list[int]: ...
    @overload
    def __getitem__(self, i: slice) -> list[list[int]]: ...

    def __getitem__(self, i: int | slice) -> list[int] | list[list[int]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.order[self.starts[i]: self.ends[i]].tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Batches):
            return (len(self) == len(other) and np.array_equal(self.ends - self.starts, other.ends - other.starts)
                    and all(np.array_equal(self.array(b), other.array(b)) for b in range(len(self))))
        if isinstance(other, Sequence):
            return len(self) == len(other) and all(self[b] == list(o) for b, o in enumerate(other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  -- mutable-looking, compared by value

    def array(self, b: int) -> np.ndarray:
        """Batch ``b`` as an array view (no Python ints)."""
        return self.order[self.starts[b]: self.ends[b]]

    def __repr__(self) -> str:
        return f"Batches({len(self)} batches of {len(self.order)} examples)"


def make_batches(
    src_lens: ArrayLike,
    tgt_lens: ArrayLike | None,
    max_tokens: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    pad_multiple: int = 1,
) -> Batches:
    """Group example indices into batches of similar length under a padded-token budget.

    1. Sort indices by (padded length of the longer side, padded target length, source
       length, seeded random key): a batch's size is set by its longer side, and within
       that, examples whose target *and* source lengths are close sit together, so both
       sides pad little (sorting by target length alone left a quarter of the source side
       padding on Multi30k). Equal lengths are mixed differently each epoch.
    2. Walk the sorted order, adding examples to the current batch while
       ``n_examples * max(longest src, longest tgt in the batch) <= max_tokens``; the
       budget counts *padded* positions of the longer side. An example longer than the
       budget on its own gets a batch of its own.
    3. When ``shuffle``, shuffle the batch order with
       ``random.Random(seed * 100003 + epoch)``.

    The result depends only on the lengths, ``seed`` and ``epoch``; every index appears in
    exactly one batch. Lengths may be lists or arrays (memory-mapped ones included): the work
    is done in numpy, so millions of examples need a few arrays, not millions of Python objects.

    :param src_lens: length of each source sequence (as fed to the model).
    :param tgt_lens: length of each target sequence, or None for classification.
    :param max_tokens: padded-token budget per batch.
    :param seed: run seed.
    :param epoch: epoch number (changes tie-breaking and batch order).
    :param shuffle: shuffle batch order (training) or keep it sorted by length (evaluation).
    :param pad_multiple: batches will be padded to a multiple of this length (see :func:`pad_batch`);
        the budget counts those positions.
    :return: the batches, each a list of example indices.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    src = np.asarray(src_lens, dtype=np.int64)
    n = len(src)
    if tgt_lens is not None and len(tgt_lens) != n:
        raise ValueError(f"src_lens and tgt_lens differ in length: {n} vs {len(tgt_lens)}")
    tgt = np.asarray(tgt_lens, dtype=np.int64) if tgt_lens is not None else np.zeros(n, dtype=np.int64)
    tie_keys = python_random_floats(f"attnkit.make_batches:{seed}:{epoch}", n)
    longer = np.maximum(src, tgt)
    order = np.lexsort((tie_keys, src, round_up(tgt, pad_multiple), round_up(longer, pad_multiple)))  # last key first
    if n < 1 << 31:
        order = order.astype(np.int32)  # kept for the whole epoch: half the memory
    del tie_keys
    size = round_up(np.maximum(longer[order], 1), pad_multiple)  # non-decreasing along `order`
    del longer

    # Greedy fill: example j joins the batch that starts at s iff (j - s + 1) * size[j] <= max_tokens
    # (size is non-decreasing, so size[j] is the batch's longest); a batch never exceeds
    # max_tokens // size[s] examples, so only that window is looked at.
    starts: list[int] = []
    s = 0
    while s < n:
        starts.append(s)
        window = size[s + 1: s + 1 + max(max_tokens // int(size[s]), 1)]
        over = np.flatnonzero(np.arange(2, len(window) + 2) * window > max_tokens)
        s += 1 + (int(over[0]) if len(over) else len(window))
    bounds = np.array([*starts, n], dtype=np.int64)
    batch_ids = list(range(len(starts)))
    if shuffle:
        random.Random(seed * _EPOCH_SEED_STRIDE + epoch).shuffle(batch_ids)
    return Batches(order, bounds[:-1][batch_ids], bounds[1:][batch_ids])


def padding_fraction(
    batches: Sequence[Sequence[int]], src_lens: ArrayLike, tgt_lens: ArrayLike | None,
    pad_multiple: int = 1,
) -> float:
    """Fraction of padded positions over all source (and target) positions of ``batches``.

    Each batch is padded to its own longest source and, separately, longest target
    (rounded up to ``pad_multiple``, as :func:`pad_batch` does).

    :return: ``padded / total`` in [0, 1]; 0.0 when there are no positions.
    """
    total = real = 0
    sides = [np.asarray(src_lens)] if tgt_lens is None else [np.asarray(src_lens), np.asarray(tgt_lens)]
    arrays = (batches.array(b) for b in range(len(batches))) if isinstance(batches, Batches) else batches
    for batch in arrays:
        if len(batch) == 0:
            continue
        for lens in sides:
            side = lens[np.asarray(batch)]
            total += len(side) * round_up(int(side.max()), pad_multiple)
            real += int(side.sum())
    return 0.0 if total == 0 else (total - real) / total


@overload
def round_up(n: int, multiple: int) -> int: ...
@overload
def round_up(n: np.ndarray, multiple: int) -> np.ndarray: ...


def round_up(n, multiple):
    """The smallest multiple of ``multiple`` that is >= ``n`` (element-wise for an array)."""
    return -(-n // multiple) * multiple


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, multiple: int = 1) -> torch.Tensor:
    """Right-pad id sequences into one tensor.

    Padding to a multiple of a few tokens keeps the number of distinct batch shapes small, which
    matters on CPUs: oneDNN compiles a kernel per matmul shape (~10 ms each here).

    :param seqs: B sequences of token ids, lengths may differ (and may be 0).
    :param pad_id: id written into padded positions.
    :param multiple: pad the length up to a multiple of this.
    :return: LongTensor of shape (B, T) with T = max length rounded up to ``multiple``.
    """
    if len(seqs) == 0:
        raise ValueError("pad_batch needs at least one sequence")
    t_max = _padded_length(max(len(s) for s in seqs), multiple)
    return torch.tensor([list(s) + [pad_id] * (t_max - len(s)) for s in seqs], dtype=torch.long)  # (B, T)


def _padded_length(longest: int, multiple: int) -> int:
    """The batch length for a longest sequence: rounded up to ``multiple``, and at least one position when
    ``multiple > 1`` (so an all-empty batch still has a shape the model accepts)."""
    return round_up(max(longest, 1 if multiple > 1 else 0), multiple)


# --------------------------------------------------------------------------------------
# Token sequences stored flat
# --------------------------------------------------------------------------------------


@dataclass
class TokenArrays:
    """Token-id sequences stored flat: sequence ``i`` is ``ids[offsets[i]:offsets[i] + lengths[i]]``.

    The arrays may be memory-mapped (prepared training data, :mod:`attnkit.prepare`) or in memory
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
        T = _padded_length(int(lens.max()) + first + int(eos is not None), multiple)
        col = np.arange(T)[None, :] - first  # (1, T): position within the sequence
        inside = (col >= 0) & (col < lens[:, None])  # (B, T)
        out = np.full((len(idx), T), pad_id, dtype=np.int64)  # (B, T)
        out[inside] = self.ids[(starts[:, None] + col)[inside]]  # one gather from the (memory-mapped) ids
        if bos is not None:
            out[:, 0] = bos
        if eos is not None:
            out[np.arange(len(idx)), first + lens] = eos
        return torch.from_numpy(out)
