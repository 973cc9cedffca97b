"""glibc's allocator, for an engine stepped on a process's main thread (the engine core process, the in-process
benchmarks).

A decode step allocates tensors of a few MB (the gathered pages of a layer, attention scores, MLP activations)
and frees them within the step. Left to itself, glibc sizes its mmap and trim thresholds dynamically, and on
the main thread's arena it can settle on handing such blocks back to the OS at every free (``munmap``, or
shrinking the heap top), so the next step takes them again as fresh pages and the kernel zeroes every one: one
decode step of 16 sequences x 512 cached tokens on the reference model took 111-117 ms in 8 of 12 measurements
(4 fresh processes, 3 each) against 42-47 ms in the others, the same code (``bench.budget.step_time``; 42-54 ms
in 12 of 12 with the thresholds fixed). :func:`keep_step_memory` fixes both (what
``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:glibc.malloc.trim_threshold=...`` does, here at run time with
``mallopt``); the benchmarks that step an engine in-process call it (``server.bench_cmd.in_process.new_engine``).

The engine core process (``ENGINE_PROCESS=true``, the default) steps its engine on its main thread too, and calls
it at start; its idle spells hand the kept heap back (:func:`trim`), so a busy core keeps up to
:data:`TRIM_THRESHOLD_BYTES` of freed heap only while it is busy. A core in a thread of the server's process
(``ENGINE_PROCESS=false``) steps on another arena, where the slow state was not seen, and leaves the server's
allocator as it is.
Elsewhere than glibc both functions are no-ops.
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
