"""Prepared training data: the corpus tokenized once, stored flat and memory-mapped by every run.

``attnkit prepare CONFIG --run-dir RUN`` (and ``attnkit train`` when the prepared data is missing)
does, for a corpus of any size and any task:

1. stream the training examples the task's :class:`Recipe` reads, with the checks of
   :mod:`attnkit.data.readers`;
2. train SentencePiece on a bounded sample of the stream (:func:`attnkit.data.tokenizer.train_tokenizer`);
3. encode in several processes, chunk by chunk (the recipe's :meth:`Recipe.encode`: filtering by length,
   windows, truncation), and append the ids to flat arrays;
4. write them into a temporary directory, the manifest last, and rename it into place, so a run
   killed mid-way leaves nothing that a later run would trust.

Layout of the data directory (``data/`` of a run, :mod:`attnkit.runs.layout`)::

    manifest.json            sources (path, bytes, sha256), settings, tokenizer hash, counts, filter statistics
    SIDE.ids.npy             (N_tokens,) uint16 (int32 for vocabularies over 65,536) token ids, no <s>/</s>
    SIDE.offsets.npy         (N + 1,) int64 where each example starts
    SIDE.lengths.npy         (N,) tokens per example
    labels.npy               (N,) class index per example (labelled examples)

SIDE is one of the recipe's :attr:`Recipe.sides` (``src`` and ``tgt`` for translation, ``text`` for a
classifier or pretraining, ``text`` and ``scored``, a 0 or 1 per token, for conversations). A run reuses the
data while the manifest's sources (content), settings and tokenizer match; otherwise ``train`` prepares again
and ``train --resume`` stops (its checkpoint's data position refers to the old data). Nothing here knows a
task: the recipe says what to read and how.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from itertools import chain, islice
from pathlib import Path
from typing import Protocol

import numpy as np

from ..common.errors import UserError
from ..common.files import atomic_write_text, fsync_dir
from ..config.schema import RunConfig
from .arrays import MappedTokenArrays, NpyWriter, SideWriter, TokenArrays, mapped
from .batching import FilterStats
from .readers import ReadStats
from .tokenizer import TOKENIZER_FILE, Tokenizer, tokenizer_files, train_tokenizer

__all__ = ["MANIFEST_FILE", "Encoded", "Prepared", "Recipe", "file_digest", "prepare_data", "tokenizer_digest"]

MANIFEST_FILE, LABELS_FILE = "manifest.json", "labels.npy"
_FORMAT_VERSION = 1
#: Examples per chunk handed to an encoding process.
_CHUNK = 4096
#: Below this many bytes of input, encoding in this process beats starting others.
_PARALLEL_MIN_BYTES = 8 << 20
_HASH_BLOCK = 1 << 22


@dataclass
class Encoded:
    """One chunk of examples, encoded (in a worker) by :meth:`Recipe.encode`.

    :param sides: per side of :attr:`Recipe.sides`, ``(flat ids, lengths)`` of the chunk's sequences.
    :param keep: (n,) bool, the sequences to write (None: all), when the recipe filters.
    :param filtered: what the filter kept and dropped, when the recipe filters.
    :param labels: the examples' class labels (labelled recipes), else empty.
    """

    sides: list[tuple[np.ndarray, np.ndarray]]
    keep: np.ndarray | None = None
    filtered: FilterStats | None = None
    labels: list[str] | None = None


class Recipe(Protocol):
    """What a task tells :func:`prepare_data`: what its examples are made from and how they are encoded.

    A recipe is sent to the encoding processes, so it holds plain data (its config) and is defined at
    module level. Examples are pairs of strings: ``(source, target)``, ``(text, label)`` or ``(text, "")``.
    """

    cfg: RunConfig
    sides: tuple[str, ...]  # the token-array sides it writes: ("src", "tgt") or ("text",)
    labelled: bool  # the examples carry class labels: labels.npy and the manifest's classes
    mask: bool  # the tokenizer needs a <mask> piece (pretraining)

    def sources(self) -> list[str]: ...  # the files the data is made from (their content is hashed)
    def settings(self) -> dict: ...  # everything else the prepared data depends on, beyond the common ones
    def examples(self, stats: ReadStats | None, log: Callable[[str], None] | None) -> Iterator[tuple[str, str]]: ...
    def tokenizer_texts(self) -> tuple[Iterator[str], Iterator[str] | None]: ...  # what SentencePiece reads
    def tokenizer_note(self) -> str: ...  # how the log line describes the tokenizer, e.g. ", joint True"
    def given_tokenizer(self, run_dir: Path, log: Callable[[str], None]) -> Tokenizer | None: ...
    def encode(self, tok: Tokenizer, chunk: list[tuple[str, str]], dtype: str) -> Encoded: ...
    def finish(self, n: int, filtered: FilterStats, stats: ReadStats, log: Callable[[str], None]) -> dict: ...


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



def _settings(recipe: Recipe) -> dict:
    """Everything besides the files' content that the prepared data depends on."""
    cfg = recipe.cfg
    d = cfg.data
    settings = {"task": cfg.task, "max_len": d.max_len, "tokenizer": asdict(d.tokenizer), "seed": cfg.train.seed,
                "layout": "two files" if d.train_tgt else "one file", "max_line_bytes": ReadStats().max_line_bytes,
                **recipe.settings()}
    if d.generate != "none":
        settings.update(generate=d.generate, generate_train=d.generate_train)
    return settings


def tokenizer_digest(run_dir: Path) -> str | None:
    """sha256 over the tokenizer files in ``run_dir``, or None without a tokenizer."""
    if not (run_dir / TOKENIZER_FILE).exists():
        return None
    h = hashlib.sha256()
    for name in tokenizer_files(run_dir):
        h.update(name.encode() + b"\0" + (run_dir / name).read_bytes())
    return h.hexdigest()


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






def load_or_train_tokenizer(recipe: Recipe, run_dir: Path, log: Callable[[str], None], *, retrain: bool
                            ) -> Tokenizer:
    """The run's tokenizer: the recipe's own (fine-tuning copies its pretraining run's), loaded from ``run_dir``,
    or (``retrain`` or none there) trained on a sample of the data."""
    given = recipe.given_tokenizer(run_dir, log)
    if given is not None:
        return given
    if not retrain and (run_dir / TOKENIZER_FILE).exists():
        return Tokenizer.load(run_dir)
    t = recipe.cfg.data.tokenizer
    log(f"training a {t.model_type} SentencePiece tokenizer (vocab {t.vocab_size}{recipe.tokenizer_note()})")
    first, second = recipe.tokenizer_texts()
    tok = train_tokenizer(first, second, run_dir, vocab_size=t.vocab_size, model_type=t.model_type, joint=t.joint,
                          seed=recipe.cfg.train.seed, max_sentences=t.max_sentences, mask=recipe.mask,
                          where=", ".join(recipe.sources()) or "data.generate")
    log(f"trained the tokenizer: {tok!r}")
    return tok


def prepare_data(recipe: Recipe, run_dir: str | Path, data_dir: str | Path, log: Callable[[str], None] = print, *,
                 resume: bool = False, workers: int | None = None) -> Prepared:
    """The prepared training data of ``recipe`` in ``data_dir`` (tokenizer in ``run_dir``): reused when the
    manifest matches the inputs, else made.

    :param resume: the run continues from a checkpoint: changed inputs are an error, not a reason to prepare again.
    :param workers: encoding processes (default: one per CPU for inputs over a few MB, else none).
    :raises UserError: a reader error (naming file and line), no usable example, or changed inputs on ``resume``.
    """
    run_dir, data_dir = Path(run_dir), Path(data_dir)
    sources = [file_digest(p) for p in recipe.sources()]
    settings = _settings(recipe)
    manifest = _read_manifest(data_dir / MANIFEST_FILE)
    if manifest is not None:
        changed = _changes(manifest, sources, settings, tokenizer_digest(run_dir))
        if changed is None:
            log(f"using the prepared data in {data_dir} ({manifest['counts']['examples']} examples)")
            return _load(run_dir, data_dir, manifest)
        if resume:
            raise UserError(f"{run_dir}: {changed} since the data was prepared; the checkpoints' data position "
                            f"refers to the old data, so --resume cannot continue: restore it or train in a new "
                            f"--run-dir")
        log(f"{changed}: preparing the data again")
        retrain = changed != "the tokenizer files changed"
    else:
        retrain = not resume  # unprepared, or killed mid-way; a run resumed without a manifest keeps its tokenizer
    name = data_dir.name
    for leftover in chain(run_dir.glob(f".{name}-tmp-*"), run_dir.glob(f".{name}-old-*")):  # from a killed prepare
        shutil.rmtree(leftover, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    tok = load_or_train_tokenizer(recipe, run_dir, log, retrain=retrain)
    if workers is None:
        workers = _default_workers() if sum(s["bytes"] for s in sources) >= _PARALLEL_MIN_BYTES else 0
    tmp = data_dir.parent / f".{name}-tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        counts = _encode_into(recipe, run_dir, tmp, tok, workers, log)
        created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        manifest = {"format_version": _FORMAT_VERSION, "created": created,
                    "sources": sources, "settings": settings, "tokenizer_sha256": tokenizer_digest(run_dir), **counts}
        atomic_write_text(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")  # last
        if data_dir.exists():  # a crash between the two renames leaves no data dir: prepared again next time
            old = data_dir.parent / f".{name}-old-{os.getpid()}"
            os.replace(data_dir, old)
            os.replace(tmp, data_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, data_dir)
        fsync_dir(data_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _load(run_dir, data_dir, manifest)


def _encode_into(recipe: Recipe, run_dir: Path, out: Path, tok: Tokenizer, workers: int,
                 log: Callable[[str], None]) -> dict:
    """Stream, encode, filter and write the recipe's training examples into ``out`` -> the manifest's counts."""
    vocab = max(tok.src_vocab_size, tok.tgt_vocab_size if tok.has_target else 0)  # every side's ids fit
    id_dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.int32)
    len_dtype = np.dtype(np.uint16 if recipe.cfg.data.max_len < 1 << 16 else np.int32)
    sides = {name: SideWriter(out, name, id_dtype, len_dtype) for name in recipe.sides}
    labels = NpyWriter(out / LABELS_FILE, np.dtype(np.int32)) if recipe.labelled else None
    label_ids: dict[str, int] = {}  # first-seen order; sorted into the class order at the end
    stats = ReadStats()
    filtered = FilterStats(0, 0, 0, recipe.cfg.data.max_len)

    def write(encoded: Encoded) -> None:
        nonlocal filtered
        if encoded.filtered is not None:
            filtered = filtered + encoded.filtered
        for name, (flat, lens) in zip(recipe.sides, encoded.sides, strict=True):
            sides[name].add(flat, lens, encoded.keep)
        if labels is not None:
            labels.write(np.array([label_ids.setdefault(c, len(label_ids)) for c in encoded.labels or []],
                                  dtype=np.int32))

    examples = recipe.examples(stats, log)
    chunks = iter(lambda: list(islice(examples, _CHUNK)), [])
    if workers < 1:
        _init_worker(str(run_dir))
        for chunk in chunks:
            write(_encode_chunk(recipe, id_dtype.str, chunk))
    else:
        # spawn: a fresh interpreter per worker (fork would copy this process's threads and state)
        with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (str(run_dir),)) as pool:
            pending: deque = deque()
            for chunk in chunks:
                pending.append(pool.apply_async(_encode_chunk, (recipe, id_dtype.str, chunk)))
                if len(pending) >= 2 * workers:  # bounded: the reader never runs far ahead of the encoders
                    write(pending.popleft().get())
            while pending:
                write(pending.popleft().get())
    for side in sides.values():
        side.close()
    counts: dict = {"sides": {name: {"examples": s.examples, "tokens": s.tokens, "ids_dtype": id_dtype.name}
                              for name, s in sides.items()},
                    "skipped_long_lines": stats.long_lines, "max_line_bytes": stats.max_line_bytes}
    n = sides[recipe.sides[0]].examples
    counts.update(recipe.finish(n, filtered, stats, log))
    if labels is not None:
        labels.close()
        counts["classes"] = _sort_labels(out / LABELS_FILE, label_ids)
    counts["counts"] = {"examples": n}
    return counts


def _sort_labels(path: Path, label_ids: dict[str, int]) -> list[str]:
    """Renumber the labels in ``path`` from first-seen order to sorted class names -> the class names."""
    classes = sorted(label_ids)
    remap = np.zeros(len(label_ids), dtype=np.int32)
    for name, first_seen in label_ids.items():
        remap[first_seen] = classes.index(name)
    y = np.load(path, mmap_mode="r+")
    y[:] = remap[y]
    y.flush()
    del y
    return classes


# --------------------------------------------------------------------------------------
# Encoding processes
# --------------------------------------------------------------------------------------

_worker_tok: Tokenizer | None = None


def _init_worker(tokenizer_dir: str) -> None:
    global _worker_tok
    _worker_tok = Tokenizer.load(tokenizer_dir)


def _encode_chunk(recipe: Recipe, dtype: str, chunk: list[tuple[str, str]]) -> Encoded:
    """Encode one chunk of examples (in a worker) with the worker's tokenizer."""
    if _worker_tok is None:
        raise RuntimeError("encoding worker used before _init_worker")
    return recipe.encode(_worker_tok, chunk, dtype)


def flat(seqs: list[list[int]], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Id lists -> (flat ids, lengths)."""
    lens = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    return np.fromiter(chain.from_iterable(seqs), dtype=dtype, count=int(lens.sum())), lens


def _load(run_dir: Path, data_dir: Path, manifest: dict) -> Prepared:
    tok = Tokenizer.load(run_dir)
    sides: dict[str, TokenArrays] = {
        name: MappedTokenArrays(ids=mapped(data_dir / f"{name}.ids.npy"),
                                offsets=mapped(data_dir / f"{name}.offsets.npy"),
                                lengths=np.load(data_dir / f"{name}.lengths.npy"))
        for name in manifest["sides"]}
    labels = np.load(data_dir / LABELS_FILE) if "classes" in manifest else None
    return Prepared(tok, sides, labels, manifest.get("classes"), manifest)
