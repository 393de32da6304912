"""Memory in a long-running server: giving freed memory back to the operating system, and keeping the
garbage collector off what lives as long as the process (:func:`freeze_long_lived`).

glibc's ``malloc`` keeps memory a process freed in its heaps for reuse, so a server's resident memory
(RSS) ratchets up to its largest moment and stays there: one request for the attention maps of many
long texts would leave tens of MB behind. ``malloc_trim(0)`` returns the free pages inside every heap
to the system, and the free end (the "top") of the main heap; the free top of the heap glibc gives
each further thread (an "arena") it leaves in place. So a server first asks for one heap shared by
all its threads (:func:`share_one_heap`), then trims it when idle (:func:`release_free_memory`).
Elsewhere (macOS, musl, Windows) both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

#: ``mallopt``'s parameter for the most heaps (arenas) glibc may make (``<malloc.h>``).
M_ARENA_MAX = -8


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has ``malloc_trim`` and ``mallopt``), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    # glibc alone has both; musl has neither, macOS neither
    return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def release_free_memory() -> bool:
    """Return the free pages of every malloc heap, and the main heap's free top, to the system; False where the
    C library cannot."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def freeze_long_lived() -> int:
    """Collect garbage once, then move every object that survives out of the garbage collector's sight
    (``gc.freeze``); return how many were frozen.

    For a server, after its models, libraries and app are loaded: they live as long as the process, yet each full
    collection would scan all of them again, and no request is answered while it does (docs/serving.md, memory).
    Frozen objects are never freed, so call it once, when what exists is what stays.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def share_one_heap() -> bool:
    """Make the threads that first allocate from now on use the main heap (``mallopt(M_ARENA_MAX, 1)``), whose
    free top :func:`release_free_memory` returns whole, instead of heaps of their own, whose top it leaves.

    Call it before the threads start. They then take the main heap's lock for each ``malloc``, a cost the serving
    race would show (docs/results.md, serving). False where the C library has no such setting.
    """
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, 1))
