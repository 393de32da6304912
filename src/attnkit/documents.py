"""Long documents for the encoder: line-break tags, truncation, and held-out validation rows.

IMDB reviews (the seeds' sentiment data) are raw web text, ~230 words on average and some over
2,000, written with HTML ``<br />`` tags between paragraphs. Three choices, all in ``data:``:

``line_break_tags``
    ``newline`` (default): every ``<br>``, ``<br/>`` or ``<br />`` becomes a line break ``"\\n"``.
    A line break is whitespace to SentencePiece (its ``nmt_nfkc`` normalisation folds it into the
    one space between words), so a tag no longer splits into the pieces ``<``, ``br``, ``/>``
    that would fill the truncated window. ``keep`` leaves the text as it is.
``truncate``
    ``head``: the first ``max_len`` subwords. ``head+tail``: the first quarter and the last three
    quarters of ``max_len`` (Sun et al. 2019, "How to Fine-Tune BERT for Text Classification":
    head 128 + tail 382 read IMDB best), as reviews often end with the verdict.
``valid_fraction``, ``group_column``, ``valid_seed``
    Hold out a fixed part of the training file for validation (checkpoint selection, early
    stopping), so dev and test sets are read only by the final ``attnkit evaluate``. With a group
    column (IMDB: ``movie``) whole groups go to one side: reviews of one movie share names and
    plot words, and a split that separates them reads optimistic.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Literal

from .data import LabelledData

LineBreakTags = Literal["newline", "keep"]
Truncation = Literal["head", "head+tail"]

_BR_TAG = re.compile(r"<br\s*/?\s*>", re.IGNORECASE)


def clean_text(text: str, line_break_tags: LineBreakTags) -> str:
    """``text`` with its ``<br />`` tags as line breaks (``newline``) or unchanged (``keep``)."""
    return text if line_break_tags == "keep" else _BR_TAG.sub("\n", text)


def truncate(ids: Sequence[int], max_len: int, how: Truncation) -> list[int]:
    """At most ``max_len`` ids: the first ones (``head``), or the first quarter and the rest from the end."""
    if len(ids) <= max_len:
        return list(ids)
    if how == "head":
        return list(ids[:max_len])
    head = max_len // 4
    return list(ids[:head]) + list(ids[len(ids) - (max_len - head):])


def _unit_hash(seed: int, key: str) -> float:
    """A stable number in [0, 1) for ``(seed, key)``: the same on every machine and Python run."""
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def held_out_rows(n: int, fraction: float, seed: int, groups: Sequence[str] | None = None) -> list[bool]:
    """Which of ``n`` rows are held out: a fixed ``fraction`` of the groups (or of the rows, without groups).

    A row (or its group) is held out when a stable hash of ``(seed, group id or row number)`` is
    below ``fraction``, so the split does not depend on the file's order beyond the row numbers,
    and every row of a group lands on the same side.
    """
    keys = groups if groups is not None else [str(i) for i in range(n)]
    if len(keys) != n:
        raise ValueError(f"{len(keys)} group ids for {n} rows")
    return [is_held_out(key, fraction, seed) for key in keys]


def is_held_out(key: str, fraction: float, seed: int) -> bool:
    """Whether the row (or group) ``key`` is held out: a stable hash of ``(seed, key)`` is below ``fraction``.

    Decided row by row, so a streamed file splits as the same file read whole (:func:`held_out_rows`).
    """
    return _unit_hash(seed, key) < fraction


def split_labelled(data: LabelledData, fraction: float, seed: int) -> tuple[LabelledData, LabelledData]:
    """``(training rows, held-out rows)`` of ``data`` (grouped by ``data.groups`` when it has them)."""
    held = held_out_rows(len(data), fraction, seed, data.groups)

    def part(keep: bool, name: str) -> LabelledData:
        rows = [i for i, h in enumerate(held) if h == keep]
        groups = None if data.groups is None else [data.groups[i] for i in rows]
        return LabelledData([data.texts[i] for i in rows], [data.labels[i] for i in rows], data.text_column,
                            data.label_column, f"{data.path} ({name})", groups)

    return part(False, "training rows"), part(True, "held-out rows")
