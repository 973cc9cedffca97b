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
it at start; its idle spells hand the kept heap back (:func:`hand_back`), so a busy core keeps up to
:data:`TRIM_THRESHOLD_BYTES` of freed heap only while it is busy. A core in a thread of the server's process
(``ENGINE_PROCESS=false``) steps on another arena, where the slow state was not seen, and leaves the server's
allocator as it is.

A long prompt's prefill leaves more behind than a decode step reuses: its chunks' temporaries (activations of
``MAX_NUM_BATCHED_TOKENS`` tokens, masks as long as the context) are freed into a heap that fragments as the
context grows, 44-50 MiB free but resident after an 8K-token prefill of SmolLM2-135M, and MKL's GEMM keeps the
packing buffers of the chunk's matmuls (10.9 MiB in 2 buffers) in a cache of its own that glibc cannot trim.
:func:`hand_back` returns both (:func:`mkl_cached_bytes`, then :func:`trim`); the engine calls it when a prompt of at
least :data:`HAND_BACK_PROMPT_TOKENS` tokens has been prefilled (:meth:`server.engine.engine.Engine.step`), so a
long stream decodes within its weights and KV pool plus a few percent (docs/benchmarks.md, "Peak memory of one long
stream"); decode steps take their few MB back from the trimmed heap within the first step.
Elsewhere than glibc :func:`keep_step_memory` and :func:`trim` are no-ops; with a torch without MKL (another BLAS)
:func:`mkl_cached_bytes` is 0 and :func:`hand_back` only trims.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # blocks below this come from the heap (glibc's largest allowed, 64-bit)
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024  # free heap top kept between steps, up to this
HAND_BACK_PROMPT_TOKENS = 1024  # a prompt at least this long hands the prefill's memory back once prefilled


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()
@functools.cache
def _mkl():
    """torch's own MKL (statically linked into ``libtorch_cpu``, which exports its service functions
    ``mkl_serv_mem_stat`` and ``mkl_serv_free_buffers``), or ``None`` where this torch has none; found once."""
    try:
        import torch  # noqa: PLC0415 - only the engine's process needs it, and it has torch loaded

        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    except (ImportError, OSError):
        return None
    if not (hasattr(lib, "mkl_serv_mem_stat") and hasattr(lib, "mkl_serv_free_buffers")):
        return None
    lib.mkl_serv_mem_stat.restype = ctypes.c_int64
    lib.mkl_serv_mem_stat.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.mkl_serv_free_buffers.restype = None
    return lib


def mkl_cached_bytes() -> int:
    """Bytes MKL's memory manager holds now (its GEMM packing buffers, kept between calls; 0 without MKL)."""
    mkl = _mkl()
    if mkl is None:
        return 0
    buffers = ctypes.c_int(0)
    return max(0, int(mkl.mkl_serv_mem_stat(ctypes.byref(buffers))))


def hand_back() -> None:
    """Return what a finished prefill left behind: MKL's cached GEMM buffers (``mkl_serv_free_buffers``: freed into
    the heap, so that the trim takes them too), then the freed heap pages (:func:`trim`). Costs a few milliseconds
    and the page faults of the next step's temporaries. MKL frees only the buffers no call is using: call it between
    steps (the engine does, on its own thread)."""
    mkl = _mkl()
    if mkl is not None:
        mkl.mkl_serv_free_buffers()
    trim()


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
