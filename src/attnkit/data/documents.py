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
from collections.abc import Iterator, Sequence

from ..config.schema import DataConfig, LineBreakTags, Truncation
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

_BR_TAG = re.compile(r"<br\s*/?\s*>", re.IGNORECASE)


def document_settings(data: DataConfig) -> dict:
    """The ``data:`` settings that decide how documents are read (columns, held-out rows, ``<br />``): what
    prepared classification and pretraining data depend on besides their files."""
    return {"text_column": data.text_column, "label_column": data.label_column, "group_column": data.group_column,
            "valid_fraction": data.valid_fraction, "valid_seed": data.valid_seed,
            "line_break_tags": data.line_break_tags}


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


def is_held_out(key: str, fraction: float, seed: int) -> bool:
    """Whether the row (or group) ``key`` is held out: a stable hash of ``(seed, key)`` is below ``fraction``.

    A key is the row's group (``data.group_column``), else its row number
    (:meth:`attnkit.data.labelled.LabelledReader.keyed`):
    every row of a group lands on one side, and a row's side does not depend on the rest of the file, so a
    streamed file splits row by row (:func:`attnkit.data.documents.split_rows`).
    """
    return _unit_hash(seed, key) < fraction


def document_ids(tok: Tokenizer, texts: list[str], data: DataConfig, *, threads: int = -1) -> list[list[int]]:
    """The token ids of whole documents, ``<br />`` tags treated as ``data.line_break_tags`` says."""
    return tok.encode_src([clean_text(t, data.line_break_tags) for t in texts], threads=threads)


def window_length(data: DataConfig) -> int:
    """Subwords of text in a classifier window: ``data.max_len``, less two for ``<s>``, ``</s>`` (``data.frame``)."""
    return max(data.max_len - 2, 1) if data.frame else data.max_len


def framed(ids: Sequence[int], data: DataConfig) -> list[int]:
    """One window as the classifier reads it: ``<s> ids </s>`` with ``data.frame`` (BERT's ``[CLS] .. [SEP]``),
    else ``ids``, an empty one as one ``<pad>`` (pooled to zeros)."""
    if data.frame:
        return [BOS_ID, *ids, EOS_ID]
    return list(ids) or [PAD_ID]


def classifier_inputs(tok: Tokenizer, texts: list[str], data: DataConfig, *, threads: int = -1) -> list[list[int]]:
    """Token ids the classifier is trained on: :func:`document_ids` truncated to :func:`window_length` as
    ``data.truncate`` says, then :func:`framed`."""
    n = window_length(data)
    return [framed(truncate(x, n, data.truncate), data) for x in document_ids(tok, texts, data, threads=threads)]


def reading_windows(ids: Sequence[int], max_len: int, stride: int | None = None, empty: Sequence[int] = (PAD_ID,)
                    ) -> list[list[int]]:
    """A document read whole: windows of ``max_len`` subwords starting every ``stride`` (default ``max_len // 2``,
    so neighbours overlap by half), the last one ending at the document's end; every subword is in at least one.
    A document of at most ``max_len`` subwords is one window, itself; an empty one is ``empty`` (one ``<pad>``)."""
    if len(ids) <= max_len:
        return [list(ids) or list(empty)]
    stride = stride or max(max_len // 2, 1)
    starts = list(range(0, len(ids) - max_len, stride)) + [len(ids) - max_len]
    return [list(ids[s: s + max_len]) for s in starts]


def text_windows(ids: list[list[int]], max_len: int, min_len: int) -> list[list[int]]:
    """Pretraining examples: every text cut into consecutive windows of ``max_len`` subwords; shorter than
    ``min_len`` are dropped."""
    return [x[i: i + max_len] for x in ids for i in range(0, len(x), max_len) if len(x[i: i + max_len]) >= min_len]


def split_rows(rows: Iterator[tuple[str, str, str]], data: DataConfig, *, held_out: bool
               ) -> Iterator[tuple[str, str]]:
    """``(text, label)`` of the keyed ``rows`` (:meth:`LabelledReader.keyed`) on one side of
    ``data.valid_fraction``: the held-out ones for validation, or the others for training."""
    for text, label, key in rows:
        if (data.valid_fraction > 0 and is_held_out(key, data.valid_fraction, data.valid_seed)) == held_out:
            yield text, label

