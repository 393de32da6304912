"""Reading corpora and cutting them into batches.

Everything that touches a user's data file lives here, so every message about a bad file
comes from one place and names ``file:line`` (and the column or key where there is one).

* Parallel text for translation: :func:`read_lines`, :func:`read_parallel`.
* Labelled text for classification: :func:`read_labelled`.
* Length filtering after tokenization: :func:`filter_examples`.
* Token-budget batching: :func:`make_batches`, :func:`padding_fraction`, :func:`pad_batch`.

Files may be plain or gzip-compressed (chosen by a ``.gz`` suffix) and must be UTF-8.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from attnkit.errors import UserError

__all__ = [
    "FilterStats",
    "LabelledData",
    "LABEL_COLUMN_NAMES",
    "TEXT_COLUMN_NAMES",
    "filter_examples",
    "make_batches",
    "pad_batch",
    "padding_fraction",
    "read_labelled",
    "read_lines",
    "read_parallel",
]

#: Header names recognised as the label column of a classification file (case-insensitive).
LABEL_COLUMN_NAMES: tuple[str, ...] = ("label", "labels", "class", "sentiment", "target", "y")
#: Header names recognised as the text column of a classification file (case-insensitive).
TEXT_COLUMN_NAMES: tuple[str, ...] = ("sentence", "text", "content", "review", "document")

_UTF8_BOM = "\ufeff"
#: Multiplier that mixes ``seed`` and ``epoch`` into one shuffling seed (a prime, so that
#: ``(seed, epoch)`` pairs do not collide for any realistic number of epochs).
_EPOCH_SEED_STRIDE = 100003


# --------------------------------------------------------------------------------------
# Reading files
# --------------------------------------------------------------------------------------


def _base_suffix(path: Path) -> str:
    """Return the lower-case suffix that names the format, ignoring a trailing ``.gz``.

    ``train.tsv.gz`` -> ``.tsv``; ``train.de`` -> ``.de``; ``train.gz`` -> ``""``.
    """
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def _read_text(path: str | Path) -> str:
    """Read a whole file (gzip when the name ends in ``.gz``) as strict UTF-8.

    A leading byte-order mark is dropped. Line terminators are kept.

    :raises UserError: the file is missing, unreadable, not gzip, or not UTF-8.
    """
    p = Path(path)
    try:
        if p.suffix.lower() == ".gz":
            with gzip.open(p, "rb") as f:
                data = f.read()
        else:
            data = p.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: file not found; check the path (relative paths start from "
                        f"the current directory {Path.cwd()})") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, expected a text file") from None
    except PermissionError:
        raise UserError(f"{path}: permission denied; make the file readable") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise UserError(f"{path}: not a valid gzip file ({e}); decompress it and drop the .gz "
                        f"suffix, or re-create it with gzip") from None
    return decode_utf8(data, str(path))


def decode_utf8(data: bytes, name: str) -> str:
    """Strict UTF-8 decoding of a file's (or stdin's) bytes, without a leading byte-order mark.

    :raises UserError: ``name:line: invalid UTF-8 at column ...``.
    """
    try:
        text = data.decode("utf-8", errors="strict")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise UserError(f"{name}:{line}: invalid UTF-8 at column {column} (byte 0x{data[e.start]:02x}); "
                        f"convert the file to UTF-8, e.g. `iconv -f latin1 -t utf-8`") from None
    if text.startswith(_UTF8_BOM):
        text = text[len(_UTF8_BOM):]
    return text


def split_lines(text: str) -> list[str]:
    """Lines without their terminator (``\n`` or ``\r\n``); no extra empty line after a final terminator."""
    if not text:
        return []
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the text ended with a terminator
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_lines(path: str | Path) -> list[str]:
    """Read a text file (gzip when it ends in ``.gz``) into a list of lines.

    Only the line terminator (``\\n`` or ``\\r\\n``) is removed, so leading/trailing spaces
    and tabs survive; a final line without terminator is kept; a file ending in a
    terminator does not produce an extra empty line. A UTF-8 byte-order mark is dropped.

    :param path: file to read.
    :return: one string per line.
    :raises UserError: missing file or invalid UTF-8 (the message gives ``file:line``).
    """
    return split_lines(_read_text(path))


def read_parallel(
    src_path: str | Path,
    tgt_path: str | Path | None = None,
    *,
    src_key: str = "src",
    tgt_key: str = "tgt",
) -> list[tuple[str, str]]:
    """Read a parallel corpus as ``(source, target)`` pairs.

    Two layouts are accepted:

    * two line-aligned files, ``src_path`` and ``tgt_path`` (any suffix);
    * one file when ``tgt_path`` is None: ``.tsv`` with exactly two tab-separated columns
      (source, target; no header) or ``.jsonl`` with one JSON object per line holding the
      keys ``src_key`` and ``tgt_key``. Blank lines in ``.jsonl`` are skipped.

    Any of them may be gzip-compressed (``.gz`` suffix). Empty sentences are kept here;
    :func:`filter_examples` drops them after tokenization and reports how many.

    :raises UserError: unequal line counts (naming both files and counts), a malformed
        line (naming ``file:line``), or an unsupported single-file suffix.
    """
    if tgt_path is not None:
        src_lines = read_lines(src_path)
        tgt_lines = read_lines(tgt_path)
        if len(src_lines) != len(tgt_lines):
            raise UserError(
                f"parallel files differ in length: {src_path} has {len(src_lines)} lines but "
                f"{tgt_path} has {len(tgt_lines)}; they must be line-aligned (line i of one is "
                f"the translation of line i of the other)"
            )
        return list(zip(src_lines, tgt_lines, strict=True))

    suffix = _base_suffix(Path(src_path))
    if suffix == ".tsv":
        return _read_parallel_tsv(src_path)
    if suffix == ".jsonl":
        return _read_parallel_jsonl(src_path, src_key, tgt_key)
    raise UserError(
        f"{src_path}: a single parallel file must end in .tsv or .jsonl (optionally .gz), "
        f"got '{suffix or Path(src_path).name}'; rename it or give a separate target file"
    )


def _read_parallel_tsv(path: str | Path) -> list[tuple[str, str]]:
    """Parse ``source<TAB>target`` lines; see :func:`read_parallel`."""
    pairs: list[tuple[str, str]] = []
    for line_no, line in enumerate(read_lines(path), start=1):
        fields = line.split("\t")
        if len(fields) != 2:
            raise UserError(
                f"{path}:{line_no}: expected 2 tab-separated columns (source<TAB>target), "
                f"found {len(fields)}; remove stray tabs or fix the line"
            )
        pairs.append((fields[0], fields[1]))
    return pairs


def _read_parallel_jsonl(path: str | Path, src_key: str, tgt_key: str) -> list[tuple[str, str]]:
    """Parse one JSON object per line; see :func:`read_parallel`."""
    pairs: list[tuple[str, str]] = []
    for line_no, line in enumerate(read_lines(path), start=1):
        if not line.strip():
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
        pairs.append((values[0], values[1]))
    return pairs


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


def read_labelled(
    path: str | Path, *, text_column: str | None = None, label_column: str | None = None,
    group_column: str | None = None,
) -> LabelledData:
    """Read a classification file: ``.tsv`` (tab, no quoting) or ``.csv`` (comma, quoted fields).

    The first row must be a header. Without explicit column names the label column is the
    single header in :data:`LABEL_COLUMN_NAMES` and the text column the single header in
    :data:`TEXT_COLUMN_NAMES` (both case-insensitive). Blank rows are skipped.

    :param path: the file (optionally ``.gz``).
    :param text_column: header name of the text column (config ``data.text_column``).
    :param label_column: header name of the label column (config ``data.label_column``).
    :param group_column: header name of a column to keep as :attr:`LabelledData.groups`
        (config ``data.group_column``), e.g. the movie for a split that keeps each movie on one side.
    :raises UserError: no/ambiguous header, a named column missing, a row with the wrong
        number of fields, an empty text or label (each naming ``file:line``).
    """
    suffix = _base_suffix(Path(path))
    if suffix == ".tsv":
        delimiter, quoting, kind = "\t", csv.QUOTE_NONE, "tab"
    elif suffix == ".csv":
        delimiter, quoting, kind = ",", csv.QUOTE_MINIMAL, "comma"
    else:
        raise UserError(f"{path}: labelled data must be .tsv or .csv (optionally .gz), got "
                        f"'{suffix or Path(path).name}'; rename or convert the file")
    text = _read_text(path)
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, quoting=quoting)
    try:
        header = next(reader, None)
        if header is None:
            raise UserError(f"{path}: file is empty; expected a header line and data rows")
        header = [h.strip() for h in header]
        text_col = _choose_column(path, header, text_column, "text", TEXT_COLUMN_NAMES)
        label_col = _choose_column(path, header, label_column, "label", LABEL_COLUMN_NAMES)
        if text_col == label_col:
            raise UserError(f"{path}: text and label column are both '{text_col}'; set "
                            f"data.text_column and data.label_column to different columns")
        text_idx, label_idx = header.index(text_col), header.index(label_col)
        group_idx = None if group_column is None else header.index(_choose_column(path, header, group_column,
                                                                                  "group", ()))
        texts: list[str] = []
        labels: list[str] = []
        groups: list[str] = []
        for row in reader:
            line_no = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) != len(header):
                raise UserError(f"{path}:{line_no}: expected {len(header)} {kind}-separated fields "
                                f"like the header, found {len(row)}; fix the row (quote fields "
                                f"that contain the delimiter in CSV)")
            row_text, row_label = row[text_idx], row[label_idx].strip()
            if not row_text.strip():
                raise UserError(f"{path}:{line_no}:{text_col}: empty text; fill it in or "
                                f"remove the row")
            if not row_label:
                raise UserError(f"{path}:{line_no}:{label_col}: empty label; fill it in or "
                                f"remove the row")
            texts.append(row_text)
            labels.append(row_label)
            if group_idx is not None:
                groups.append(row[group_idx].strip())
    except csv.Error as e:
        raise UserError(f"{path}:{reader.line_num}: malformed {kind}-separated row ({e})") from None
    return LabelledData(texts=texts, labels=labels, text_column=text_col, label_column=label_col, path=str(path),
                        groups=groups if group_idx is not None else None)


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

    def __str__(self) -> str:
        return (f"kept {self.kept} of {self.total} pairs (dropped {self.empty} with an empty side, "
                f"{self.too_long} with a side longer than {self.max_len} tokens)")


def filter_examples(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]], max_len: int
) -> tuple[list[int], FilterStats]:
    """Keep the token-id pairs whose sides are both non-empty and at most ``max_len`` long.

    :param examples: ``(src_ids, tgt_ids)`` per example.
    :param max_len: longest allowed side, in tokens (inclusive).
    :return: indices of kept examples (ascending) and the counts.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    kept: list[int] = []
    empty = too_long = 0
    for i, (src, tgt) in enumerate(examples):
        if len(src) == 0 or len(tgt) == 0:
            empty += 1
        elif len(src) > max_len or len(tgt) > max_len:
            too_long += 1
        else:
            kept.append(i)
    return kept, FilterStats(kept=len(kept), empty=empty, too_long=too_long, max_len=max_len)


# --------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------


def make_batches(
    src_lens: Sequence[int],
    tgt_lens: Sequence[int] | None,
    max_tokens: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    pad_multiple: int = 1,
) -> list[list[int]]:
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
    exactly one batch.

    :param src_lens: length of each source sequence (as fed to the model).
    :param tgt_lens: length of each target sequence, or None for classification.
    :param max_tokens: padded-token budget per batch.
    :param seed: run seed.
    :param epoch: epoch number (changes tie-breaking and batch order).
    :param shuffle: shuffle batch order (training) or keep it sorted by length (evaluation).
    :param pad_multiple: batches will be padded to a multiple of this length (see :func:`pad_batch`);
        the budget counts those positions.
    :return: list of batches, each a list of example indices.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    n = len(src_lens)
    if tgt_lens is not None and len(tgt_lens) != n:
        raise ValueError(f"src_lens and tgt_lens differ in length: {n} vs {len(tgt_lens)}")
    tie_rng = random.Random(f"attnkit.make_batches:{seed}:{epoch}")
    tie_keys = [tie_rng.random() for _ in range(n)]
    tgt = tgt_lens if tgt_lens is not None else [0] * n
    order = sorted(range(n), key=lambda i: (round_up(max(src_lens[i], tgt[i]), pad_multiple),
                                            round_up(tgt[i], pad_multiple), src_lens[i], tie_keys[i]))

    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0
    for i in order:
        size = round_up(max(src_lens[i], tgt[i], 1), pad_multiple)
        new_longest = max(longest, size)
        if batch and (len(batch) + 1) * new_longest > max_tokens:
            batches.append(batch)
            batch, new_longest = [], size
        batch.append(i)
        longest = new_longest
    if batch:
        batches.append(batch)

    if shuffle:
        random.Random(seed * _EPOCH_SEED_STRIDE + epoch).shuffle(batches)
    return batches


def padding_fraction(
    batches: Sequence[Sequence[int]], src_lens: Sequence[int], tgt_lens: Sequence[int] | None,
    pad_multiple: int = 1,
) -> float:
    """Fraction of padded positions over all source (and target) positions of ``batches``.

    Each batch is padded to its own longest source and, separately, longest target
    (rounded up to ``pad_multiple``, as :func:`pad_batch` does).

    :return: ``padded / total`` in [0, 1]; 0.0 when there are no positions.
    """
    total = real = 0
    sides = [src_lens] if tgt_lens is None else [src_lens, tgt_lens]
    for batch in batches:
        if not batch:
            continue
        for lens in sides:
            side = [lens[i] for i in batch]
            total += len(side) * round_up(max(side), pad_multiple)
            real += sum(side)
    return 0.0 if total == 0 else (total - real) / total


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
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
    t_max = round_up(max(max(len(s) for s in seqs), 1 if multiple > 1 else 0), multiple)
    return torch.tensor([list(s) + [pad_id] * (t_max - len(s)) for s in seqs], dtype=torch.long)  # (B, T)
