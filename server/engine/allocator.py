"""glibc's allocator, set for an engine whose every step allocates and frees the same large transients.

A decode step allocates tensors of a few MB (the gathered pages of a layer, attention scores, MLP activations)
and frees them within the step. Left to itself glibc sizes its mmap and trim thresholds dynamically, and in
some processes it settles on handing such blocks back to the OS at every free (``munmap``, or shrinking the
heap top), so the next step takes them again as fresh pages and the kernel zeroes every one: one decode step
of 16 sequences x 512 cached tokens on the reference model took 111-119 ms in 8 of 12 fresh processes against
38-48 ms in the others, the same code (``bench.budget.step_time``). Fixing both thresholds (what
``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:glibc.malloc.trim_threshold=...`` does, set here at run time
with ``mallopt``) keeps a step's freed blocks for the next one; the memory of a busy spell goes back to the OS
when the engine goes idle (:func:`trim`). Elsewhere than glibc both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # blocks below this come from the heap (glibc's largest allowed, 64-bit)
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024  # free heap top kept between steps, up to this


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def keep_step_memory() -> bool:
    """Fix glibc's mmap and trim thresholds (see the module); True when set (glibc), False elsewhere."""
    if _LIBC is None:
        return False
    return bool(_LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
        bool(_LIBC.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def trim() -> None:
    """glibc's ``malloc_trim(0)``: hand the freed heap pages back to the OS (the engine calls it once per idle
    spell: freed tensors stay in glibc's arenas otherwise, and the process keeps its busiest moment's memory)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
