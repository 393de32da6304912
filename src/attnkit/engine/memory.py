"""Freed memory kept by the process for its next tensors, instead of handed back to the system and faulted in again.

On Linux, glibc's ``malloc`` serves a large block (over 128 KB at first, 32 MB at most) with a fresh ``mmap`` and
gives it back with ``munmap`` when it is freed, and trims the top of its heap when much is free there. A training
step on a CPU allocates and frees the same activations and gradients every update (a language model's chunk of
logits is 200 MB), so every update the kernel maps and zeroes those pages again, one fault per 4 KB page, and
elementwise passes over fresh tensors run several times slower than over reused ones. :func:`hold_freed_memory`
sets ``malloc`` (``mallopt``) to take every block from its heap and to keep what is freed there (up to
:data:`KEEP_FREE`): the next update's tensors reuse the pages, already mapped. The peak resident set stays about
the same (the heap holds what the step held at its peak); the process does not shrink between steps.

This is what tcmalloc or jemalloc (``LD_PRELOAD``) give a PyTorch process on a CPU, without a library to install;
computation is unchanged. Elsewhere (another C library, macOS, Windows) nothing is done.
"""

from __future__ import annotations

from ..common.memory import glibc

__all__ = ["KEEP_FREE", "hold_freed_memory"]

#: Freed memory the heap keeps at its top before trimming (``M_TRIM_THRESHOLD``; the most an ``int`` holds).
KEEP_FREE = 2**31 - 1
# mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def hold_freed_memory() -> bool:
    """Make glibc's ``malloc`` serve blocks from its heap and keep freed ones (module doc) -> whether it was set
    (False where the C library is not glibc)."""
    libc = glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success; no mmap'd blocks (M_MMAP_MAX 0), and no trimming below KEEP_FREE
    return libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, KEEP_FREE) == 1
