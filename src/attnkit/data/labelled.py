"""Labelled text for classification: a ``.tsv`` / ``.csv`` file with a header, streamed.

:class:`LabelledReader` finds the text and label columns (configured, or detected by their header
names), checks every row and names ``file:line`` and the column in every error;
:func:`read_labelled` collects a file. Lines come from :func:`attnkit.data.readers.iter_lines`.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..common.errors import UserError
from .readers import ReadStats, base_suffix, iter_lines

#: Header names recognised as the label column of a classification file (case-insensitive).
LABEL_COLUMN_NAMES: tuple[str, ...] = ("label", "labels", "class", "sentiment", "target", "y")


#: Header names recognised as the text column of a classification file (case-insensitive).
TEXT_COLUMN_NAMES: tuple[str, ...] = ("sentence", "text", "content", "review", "document")



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
    :param labelled: False reads a file of texts without labels (pretraining): no label column is looked for
        and every row's label is ``""``.
    :raises UserError: no/ambiguous header, a named column missing, a row with the wrong
        number of fields, an empty text or label (each naming ``file:line``).
    """

    def __init__(self, path: str | Path, *, text_column: str | None = None, label_column: str | None = None,
                 group_column: str | None = None, stats: ReadStats | None = None, labelled: bool = True) -> None:
        self.path = str(path)
        self.stats = stats if stats is not None else ReadStats()
        suffix = base_suffix(Path(path))
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
        self.label_column = (_choose_column(path, self.header, label_column, "label", LABEL_COLUMN_NAMES)
                             if labelled else None)
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

        The key decides which side of a held-out split the row lands on (:func:`attnkit.data.documents.is_held_out`).
        """
        path, header = self.path, self.header
        text_idx = header.index(self.text_column)
        label_idx = None if self.label_column is None else header.index(self.label_column)
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
            row_text, row_label = row[text_idx], "" if label_idx is None else row[label_idx].strip()
            if not row_text.strip():
                raise UserError(f"{path}:{line_no[0]}:{self.text_column}: empty text; fill it in or "
                                f"remove the row")
            if not row_label and label_idx is not None:
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

