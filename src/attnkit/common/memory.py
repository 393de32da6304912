"""Giving freed memory back to the operating system, for a long-running server.

glibc's ``malloc`` keeps memory a process freed in its heaps (one per thread that allocated) for
reuse, so a server's resident memory (RSS) ratchets up to its largest moment and stays there: one
request for the attention maps of 64 long texts leaves hundreds of MB behind. ``malloc_trim(0)``
returns the free pages of every heap to the system. Elsewhere (macOS, musl, Windows) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc.malloc_trim if libc is not None else None
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_memory() -> bool:
    """Return the freed pages of every malloc heap to the system; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
