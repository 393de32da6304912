"""Atomic file writes: a crash or ^C mid-write leaves the old file or the new one, never half of one.

A file is written to a temporary sibling, flushed and fsynced, then moved onto the target with
``os.replace``; the directory entry of the rename is fsynced too. Every module that writes a
file a later command reads back (configs, tokenizers, checkpoints, the explorer page) uses these.
:func:`cache_dir` is where attnkit keeps what it can compute again (compiled steps, precision choices).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Write ``path`` atomically: ``write(tmp)`` fills a temporary sibling that replaces ``path``.

    :param path: the target file; its parent directory is created if needed.
    :param write: called with the temporary path; must create and close that file.
    If ``write`` raises, the target is untouched and the temporary file is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)  # the writer closed its handle; fsync through a new one
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Persist the directory entry of a rename (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def cache_dir(name: str) -> Path | None:
    """Where attnkit keeps ``name`` (one kind of cached result) between processes: ``$ATTNKIT_CACHE/name``
    (``ATTNKIT_CACHE=off``: nowhere, None), else ``$XDG_CACHE_HOME/attnkit/name``, else ``~/.cache/attnkit/name``."""
    root = os.environ.get("ATTNKIT_CACHE")
    if root == "off":
        return None
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnkit")
    return Path(root) / name
