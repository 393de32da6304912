"""Prepared training data: the corpus tokenized once, stored flat and memory-mapped by every run.

``attnkit prepare CONFIG --run-dir RUN`` (and ``attnkit train`` when the prepared data is missing)
does, for a corpus of any size:

1. stream the training file(s) line by line with the checks of :mod:`attnkit.data`;
2. train SentencePiece on a bounded sample of the stream (:func:`attnkit.tokenizer.train_tokenizer`);
3. encode in several processes, chunk by chunk, filter by length (:func:`attnkit.data.filter_lengths`)
   and append the ids to flat arrays;
4. write them into a temporary directory, the manifest last, and rename it into place, so a run
   killed mid-way leaves nothing that a later run would trust.

Layout in the run directory (beside the tokenizer files)::

    data/manifest.json            sources (path, bytes, sha256), settings, tokenizer hash, counts, filter statistics
    data/SIDE.ids.npy             (N_tokens,) uint16 (int32 for vocabularies over 65,536) token ids, no <s>/</s>
    data/SIDE.offsets.npy         (N + 1,) int64 where each example starts
    data/SIDE.lengths.npy         (N,) tokens per example
    data/labels.npy               (N,) class index per example (classification)

SIDE is ``src`` and ``tgt`` (translation) or ``text`` (classification; pretraining, one example per
window of ``data.max_len`` subwords). A run reuses the data while
the manifest's sources (content), settings and tokenizer match; otherwise ``train`` prepares
again and ``train --resume`` stops (its checkpoint's data position refers to the old data).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import multiprocessing
import os
import shutil
import struct
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from itertools import chain, islice
from pathlib import Path
from typing import BinaryIO

import numpy as np

from . import dates
from .data import (
    FilterStats,
    LabelledReader,
    ReadStats,
    TokenArrays,
    _base_suffix,
    filter_lengths,
    iter_lines,
    iter_parallel,
)
from .documents import clean_text, is_held_out, truncate
from .errors import UserError
from .files import atomic_write_text, fsync_dir
from .runconfig import DataConfig, RunConfig
from .tokenizer import PAD_ID, TOKENIZER_FILE, Tokenizer, train_tokenizer

__all__ = ["CLASSES_FILE", "DATA_DIR", "MANIFEST_FILE", "Prepared", "classifier_inputs", "labelled_reader",
           "pretraining_texts", "prepare", "split_rows", "text_windows"]

DATA_DIR, MANIFEST_FILE, CLASSES_FILE = "data", "manifest.json", "classes.json"
_FORMAT_VERSION = 1
#: Examples per chunk handed to an encoding process.
_CHUNK = 4096
#: Below this many bytes of input, encoding in this process beats starting others.
_PARALLEL_MIN_BYTES = 8 << 20
#: Bytes of a .npy header written by :class:`_NpyWriter` (fixed, so it can be rewritten in place).
_NPY_HEADER_BYTES = 128
_HASH_BLOCK = 1 << 22
_TOKENIZER_FILES = (TOKENIZER_FILE, "spm.model", "src.model", "tgt.model")


def classifier_inputs(tok: Tokenizer, texts: list[str], data: DataConfig, *, threads: int = -1) -> list[list[int]]:
    """Token ids the classifier reads: ``<br />`` tags and truncation to ``data.max_len`` as ``data`` says
    (:mod:`attnkit.documents`); an empty text becomes one ``<pad>`` (pooled to zeros)."""
    ids = tok.encode_src([clean_text(t, data.line_break_tags) for t in texts], threads=threads)
    return [truncate(x, data.max_len, data.truncate) or [PAD_ID] for x in ids]


def text_windows(ids: list[list[int]], max_len: int, min_len: int) -> list[list[int]]:
    """Pretraining examples: every text cut into consecutive windows of ``max_len`` subwords; shorter than
    ``min_len`` are dropped."""
    return [x[i: i + max_len] for x in ids for i in range(0, len(x), max_len) if len(x[i: i + max_len]) >= min_len]


@dataclass
class Prepared:
    """A run's prepared training data, memory-mapped.

    :param tok: the tokenizer the ids come from.
    :param sides: ``{"src": ..., "tgt": ...}`` (translation) or ``{"text": ...}`` (classification, pretraining).
    :param labels: (N,) class indices (classification), else None.
    :param classes: class names in index order (classification), else None.
    :param manifest: the manifest it was loaded with.
    """

    tok: Tokenizer
    sides: dict[str, TokenArrays]
    labels: np.ndarray | None
    classes: list[str] | None
    manifest: dict

    def __len__(self) -> int:
        return int(self.manifest["counts"]["examples"])


# --------------------------------------------------------------------------------------
# What the data is made from
# --------------------------------------------------------------------------------------


def _source_paths(cfg: RunConfig) -> list[str]:
    d = cfg.data
    if d.generate != "none":
        return []
    if cfg.task == "pretrain":
        return [d.train, *d.extra_text]
    return [d.train] + ([d.train_tgt] if cfg.task == "translate" and d.train_tgt else [])


def _settings(cfg: RunConfig) -> dict:
    """Everything besides the files' content that the prepared data depends on."""
    d = cfg.data
    settings = {"task": cfg.task, "max_len": d.max_len, "tokenizer": asdict(d.tokenizer), "seed": cfg.train.seed,
                "layout": "two files" if d.train_tgt else "one file", "max_line_bytes": ReadStats().max_line_bytes}
    if cfg.task != "translate":
        settings.update(text_column=d.text_column, label_column=d.label_column, group_column=d.group_column,
                        valid_fraction=d.valid_fraction, valid_seed=d.valid_seed, line_break_tags=d.line_break_tags)
    if cfg.task == "classify":
        settings.update(truncate=d.truncate)
    if cfg.task == "pretrain":
        settings.update(min_len=cfg.mlm.min_len)
    if d.generate != "none":
        settings.update(generate=d.generate, generate_train=d.generate_train)
    return settings


def file_digest(path: str | Path) -> dict:
    """``{"path", "bytes", "sha256"}`` of a file, read in blocks."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(_HASH_BLOCK):
                h.update(block)
    except FileNotFoundError:
        raise UserError(f"{path}: file not found; check data.train / data.train_tgt (relative paths start "
                        f"from the current directory {Path.cwd()})") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    return {"path": str(path), "bytes": Path(path).stat().st_size, "sha256": h.hexdigest()}


def tokenizer_digest(run_dir: Path) -> str | None:
    """sha256 over the tokenizer files in ``run_dir``, or None without a tokenizer."""
    if not (run_dir / TOKENIZER_FILE).exists():
        return None
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        if (run_dir / name).exists():
            h.update(name.encode() + b"\0" + (run_dir / name).read_bytes())
    return h.hexdigest()


def _changes(manifest: dict, sources: list[dict], settings: dict, tok_hash: str | None) -> str | None:
    """What differs between a manifest and the current inputs, as a phrase; None when nothing does."""
    old = manifest.get("sources", [])
    if len(old) != len(sources):
        return f"the training data changed from {len(old)} to {len(sources)} file(s)"
    for before, now in zip(old, sources, strict=True):
        if (before.get("bytes"), before.get("sha256")) != (now["bytes"], now["sha256"]):
            return (f"{now['path']} changed ({before.get('bytes')} -> {now['bytes']} bytes, sha256 "
                    f"{str(before.get('sha256'))[:12]} -> {now['sha256'][:12]})")
    old_settings = manifest.get("settings", {})
    differ = sorted(k for k in settings.keys() | old_settings.keys() if old_settings.get(k) != settings.get(k))
    if differ:
        shown = ", ".join(f"{k} {old_settings.get(k)!r} -> {settings.get(k)!r}" for k in differ)
        return f"the data settings changed ({shown})"
    if manifest.get("tokenizer_sha256") != tok_hash:
        return "the tokenizer files changed"
    return None


def split_rows(rows: Iterator[tuple[str, str, str]], data: DataConfig, *, held_out: bool
               ) -> Iterator[tuple[str, str]]:
    """``(text, label)`` of the keyed ``rows`` (:meth:`LabelledReader.keyed`) on one side of
    ``data.valid_fraction``: the held-out ones for validation, or the others for training."""
    for text, label, key in rows:
        if (data.valid_fraction > 0 and is_held_out(key, data.valid_fraction, data.valid_seed)) == held_out:
            yield text, label


def labelled_reader(cfg: RunConfig, stats: ReadStats | None = None) -> LabelledReader:
    """The reader of the classification training file, with the configured columns."""
    d = cfg.data
    return LabelledReader(d.train, text_column=d.text_column, label_column=d.label_column,
                          group_column=d.group_column, stats=stats)


def pretraining_texts(cfg: RunConfig, paths: list[str], *, held_out: bool = False, stats: ReadStats | None = None,
                      log: Callable[[str], None] | None = None) -> Iterator[str]:
    """The texts of pretraining files on one side of ``data.valid_fraction``, ``<br />`` treated as configured.

    ``.txt`` (optionally ``.gz``): one text per line, blank lines skipped. ``.tsv`` / ``.csv``: the text column
    (``data.text_column`` or detected; the first file's rows grouped by ``data.group_column``); labels unread.
    """
    d = cfg.data
    for i, path in enumerate(paths):
        if _base_suffix(Path(path)) in (".tsv", ".csv"):
            reader = LabelledReader(path, text_column=d.text_column, label_column=d.label_column,
                                    group_column=d.group_column if i == 0 and d.valid_fraction else None,
                                    stats=stats)
            if log is not None:
                log(f"{path}: pretraining on column '{reader.text_column}'; the labels in "
                    f"'{reader.label_column}' are ignored")
            rows: Iterator[tuple[str, str, str]] = reader.keyed()
        else:
            lines = (line for line in iter_lines(path, stats) if line is not None and line.strip())
            rows = ((line, "", str(n)) for n, line in enumerate(lines))
        for text, _ in split_rows(rows, d, held_out=held_out):
            yield clean_text(text, d.line_break_tags)


def _train_examples(cfg: RunConfig, stats: ReadStats | None = None, log: Callable[[str], None] | None = None
                    ) -> Iterator[tuple[str, str]]:
    """The training examples, streamed: ``(source, target)``, ``(text, label)`` or ``(text, "")`` (pretraining)."""
    d = cfg.data
    if d.generate == "dates":
        return iter(dates.generate_pairs(d.generate_train, seed=cfg.train.seed, split="train"))
    if cfg.task == "classify":
        return split_rows(labelled_reader(cfg, stats).keyed(), d, held_out=False)
    if cfg.task == "pretrain":
        return ((text, "") for text in pretraining_texts(cfg, _source_paths(cfg), stats=stats, log=log))
    return iter_parallel(d.train, d.train_tgt, stats=stats)


def _column(cfg: RunConfig, side: int) -> Iterator[str]:
    """One side of the training text, streamed for the tokenizer (two files: just that file)."""
    d = cfg.data
    if cfg.task == "translate" and d.generate == "none" and d.train_tgt:
        return (line for line in iter_lines(d.train if side == 0 else d.train_tgt) if line is not None)
    if cfg.task == "classify":
        return (clean_text(text, d.line_break_tags) for text, _ in _train_examples(cfg))
    return (example[side] for example in _train_examples(cfg))


def load_or_train_tokenizer(cfg: RunConfig, run_dir: Path, log: Callable[[str], None], *, retrain: bool) -> Tokenizer:
    """The run's tokenizer: loaded from ``run_dir``, copied from ``model.init_from``'s pretraining run, or
    (``retrain`` or none there) trained on a sample of the data (with ``<mask>`` for pretraining)."""
    if cfg.model.init_from:
        from .pretrain import copy_pretrained_tokenizer

        return copy_pretrained_tokenizer(cfg.model.init_from, run_dir, log)
    if not retrain and (run_dir / TOKENIZER_FILE).exists():
        return Tokenizer.load(run_dir)
    t = cfg.data.tokenizer
    log(f"training a {t.model_type} SentencePiece tokenizer (vocab {t.vocab_size}"
        + (f", joint {t.joint})" if cfg.task == "translate" else ", with <mask>)" if cfg.task == "pretrain" else ")"))
    tgt = _column(cfg, 1) if cfg.task == "translate" else None
    tok = train_tokenizer(_column(cfg, 0), tgt, run_dir, vocab_size=t.vocab_size, model_type=t.model_type,
                          joint=t.joint, seed=cfg.train.seed, max_sentences=t.max_sentences,
                          mask=cfg.task == "pretrain", where=", ".join(_source_paths(cfg)) or "data.generate")
    log(f"trained the tokenizer: {tok!r}")
    return tok


# --------------------------------------------------------------------------------------
# Preparing
# --------------------------------------------------------------------------------------


def prepare(cfg: RunConfig, run_dir: str | Path, log: Callable[[str], None] = print, *, resume: bool = False,
            workers: int | None = None) -> Prepared:
    """The run's prepared training data: reused when the manifest matches the inputs, else made.

    :param resume: the run continues from a checkpoint: changed inputs are an error, not a reason to prepare again.
    :param workers: encoding processes (default: one per CPU for inputs over a few MB, else none).
    :raises UserError: a reader error (naming file and line), no usable example, or changed inputs on ``resume``.
    """
    run_dir = Path(run_dir)
    data_dir = run_dir / DATA_DIR
    sources = [file_digest(p) for p in _source_paths(cfg)]
    settings = _settings(cfg)
    manifest = _read_manifest(data_dir / MANIFEST_FILE)
    if manifest is not None:
        changed = _changes(manifest, sources, settings, tokenizer_digest(run_dir))
        if changed is None:
            log(f"using the prepared data in {data_dir} ({manifest['counts']['examples']} examples)")
            return _load(run_dir, manifest)
        if resume:
            raise UserError(f"{run_dir}: {changed} since the data was prepared; the checkpoints' data position "
                            f"refers to the old data, so --resume cannot continue: restore it or train in a new "
                            f"--run-dir")
        log(f"{changed}: preparing the data again")
        retrain = changed != "the tokenizer files changed"
    else:
        retrain = not resume  # unprepared, or killed mid-way; a run resumed without a manifest keeps its tokenizer
    for leftover in chain(run_dir.glob(".data-tmp-*"), run_dir.glob(".data-old-*")):  # from a killed prepare
        shutil.rmtree(leftover, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    tok = load_or_train_tokenizer(cfg, run_dir, log, retrain=retrain)
    if workers is None:
        workers = _default_workers() if sum(s["bytes"] for s in sources) >= _PARALLEL_MIN_BYTES else 0
    tmp = run_dir / f".data-tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        counts = _encode_into(cfg, run_dir, tmp, tok, workers, log)
        created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        manifest = {"format_version": _FORMAT_VERSION, "created": created,
                    "sources": sources, "settings": settings, "tokenizer_sha256": tokenizer_digest(run_dir), **counts}
        atomic_write_text(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")  # last
        if data_dir.exists():  # a crash between the two renames leaves no data dir: prepared again next time
            old = run_dir / f".data-old-{os.getpid()}"
            os.replace(data_dir, old)
            os.replace(tmp, data_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, data_dir)
        fsync_dir(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _load(run_dir, manifest)


def _default_workers() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(cpus, 1)


def _read_manifest(path: Path) -> dict | None:
    """The manifest, or None when it is missing or unreadable (the data is then prepared again)."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format_version") == _FORMAT_VERSION else None


def _encode_into(cfg: RunConfig, run_dir: Path, out: Path, tok: Tokenizer, workers: int,
                 log: Callable[[str], None]) -> dict:
    """Stream, encode, filter and write the training examples into ``out`` -> the manifest's counts."""
    translate, labelled = cfg.task == "translate", cfg.task == "classify"
    vocab = max(tok.src_vocab_size, tok.tgt_vocab_size if translate else 0)
    id_dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.int32)
    len_dtype = np.dtype(np.uint16 if cfg.data.max_len < 1 << 16 else np.int32)
    names = ("src", "tgt") if translate else ("text",)
    sides = {name: _SideWriter(out, name, id_dtype, len_dtype) for name in names}
    labels = _NpyWriter(out / "labels.npy", np.dtype(np.int32)) if labelled else None
    label_ids: dict[str, int] = {}  # first-seen order; sorted into the class order at the end
    stats = ReadStats()
    filtered = FilterStats(0, 0, 0, cfg.data.max_len)
    max_len = cfg.data.max_len

    def write(chunk: tuple[list[np.ndarray], list[str]]) -> None:
        nonlocal filtered
        arrays, chunk_labels = chunk
        if translate:
            (src, src_lens, tgt, tgt_lens) = arrays
            keep, part = filter_lengths(src_lens, tgt_lens, max_len)
            filtered = filtered + part
            sides["src"].add(src, src_lens, keep)
            sides["tgt"].add(tgt, tgt_lens, keep)
        else:
            sides["text"].add(*arrays, None)
        if labels is not None:
            labels.write(np.array([label_ids.setdefault(c, len(label_ids)) for c in chunk_labels], dtype=np.int32))

    examples = _train_examples(cfg, stats, log)
    chunks = iter(lambda: list(islice(examples, _CHUNK)), [])
    job = _Job(cfg.task, id_dtype.str, cfg.data, cfg.mlm.min_len)
    if workers < 1:
        _init_worker(str(run_dir))
        for chunk in chunks:
            write(_encode_chunk(job, chunk))
    else:
        # spawn: a fresh interpreter per worker (fork would copy this process's threads and state)
        with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (str(run_dir),)) as pool:
            pending: deque = deque()
            for chunk in chunks:
                pending.append(pool.apply_async(_encode_chunk, (job, chunk)))
                if len(pending) >= 2 * workers:  # bounded: the reader never runs far ahead of the encoders
                    write(pending.popleft().get())
            while pending:
                write(pending.popleft().get())
    for side in sides.values():
        side.close()
    counts: dict = {"sides": {name: {"examples": s.examples, "tokens": s.tokens, "ids_dtype": id_dtype.name}
                              for name, s in sides.items()},
                    "skipped_long_lines": stats.long_lines, "max_line_bytes": stats.max_line_bytes}
    n = sides[names[0]].examples
    where = cfg.data.train or "data.generate_train"
    if translate:
        counts["filter"] = asdict(filtered)
        log(f"training data: {filtered}" + (f"; skipped {stats.long_lines} line(s) longer than "
                                            f"{stats.max_line_bytes} bytes" if stats.long_lines else ""))
        if n == 0:
            raise UserError(f"{where}: no usable training pairs ({filtered})")
    elif not labelled:
        if n == 0:
            raise UserError(f"{', '.join(_source_paths(cfg))}: no text of at least mlm.min_len={cfg.mlm.min_len} "
                            f"subwords to pretrain on; give files with one text per line")
        log(f"pretraining data: {n} windows of at most {max_len} subwords")
    else:
        labels.close()
        if n == 0:
            raise UserError(f"{where}: no training rows")
        classes = sorted(label_ids)
        remap = np.zeros(len(label_ids), dtype=np.int32)
        for name, first_seen in label_ids.items():
            remap[first_seen] = classes.index(name)
        y = np.load(out / "labels.npy", mmap_mode="r+")
        y[:] = remap[y]
        y.flush()
        del y
        counts["classes"] = classes
        atomic_write_text(run_dir / CLASSES_FILE, json.dumps(classes, ensure_ascii=False) + "\n")
    counts["counts"] = {"examples": n}
    return counts


# --------------------------------------------------------------------------------------
# Encoding processes
# --------------------------------------------------------------------------------------

_worker_tok: Tokenizer | None = None


def _init_worker(tokenizer_dir: str) -> None:
    global _worker_tok
    _worker_tok = Tokenizer.load(tokenizer_dir)


def _flat(seqs: list[list[int]], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Id lists -> (flat ids, lengths)."""
    lens = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    return np.fromiter(chain.from_iterable(seqs), dtype=dtype, count=int(lens.sum())), lens


@dataclass(frozen=True)
class _Job:
    """What an encoding process needs besides the tokenizer."""

    task: str
    dtype: str
    data: DataConfig
    min_len: int


def _encode_chunk(job: _Job, chunk: list[tuple[str, str]]) -> tuple[list[np.ndarray], list[str]]:
    """Encode one chunk of examples (in a worker) -> (flat ids and lengths per side, labels)."""
    tok = _worker_tok
    if tok is None:
        raise RuntimeError("encoding worker used before _init_worker")
    first = [a for a, _ in chunk]
    # one SentencePiece thread per process: the processes are the parallelism
    if job.task == "translate":
        src = _flat(tok.encode_src(first, threads=1), job.dtype)
        tgt = _flat(tok.encode_tgt([b for _, b in chunk], threads=1), job.dtype)
        return [*src, *tgt], []
    if job.task == "pretrain":  # the texts come cleaned from pretraining_texts
        windows = text_windows(tok.encode_src(first, threads=1), job.data.max_len, job.min_len)
        return list(_flat(windows, job.dtype)), []
    return list(_flat(classifier_inputs(tok, first, job.data, threads=1), job.dtype)), [b for _, b in chunk]


# --------------------------------------------------------------------------------------
# Writing and reading flat arrays
# --------------------------------------------------------------------------------------


class _NpyWriter:
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


class _SideWriter:
    """One side's ``ids``, ``offsets`` and ``lengths`` files."""

    def __init__(self, out: Path, name: str, id_dtype: np.dtype, len_dtype: np.dtype) -> None:
        self.ids = _NpyWriter(out / f"{name}.ids.npy", id_dtype)
        self.offsets = _NpyWriter(out / f"{name}.offsets.npy", np.dtype(np.int64))
        self.lengths = _NpyWriter(out / f"{name}.lengths.npy", len_dtype)
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


def _mapped(path: Path) -> np.ndarray:
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


def _load(run_dir: Path, manifest: dict) -> Prepared:
    data_dir = run_dir / DATA_DIR
    tok = Tokenizer.load(run_dir)
    sides = {name: MappedTokenArrays(ids=_mapped(data_dir / f"{name}.ids.npy"),
                                     offsets=_mapped(data_dir / f"{name}.offsets.npy"),
                                     lengths=np.load(data_dir / f"{name}.lengths.npy"))
             for name in manifest["sides"]}
    labels = np.load(data_dir / "labels.npy") if "classes" in manifest else None
    return Prepared(tok, sides, labels, manifest.get("classes"), manifest)
