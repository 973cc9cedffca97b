"""Building an engine: the pool's page size and pages from the KV budget, the runner, the scheduler."""

from __future__ import annotations

import os

import torch

from cache_backends.base import KVBackend
from cache_backends.pool import KVPool
from server.engine.engine import Engine
from server.engine.itl_budget import ChunkBudget
from server.engine.kv_cache import KVCacheManager, largest_step, page_layouts
from server.engine.runner import ModelRunner
from server.engine.scheduler import Scheduler

DEFAULT_BLOCK_SIZE = 16  # tokens per block (vLLM's default)
MEMORY_FRACTION = 0.25  # of the memory free at start-up, the most an unset KV budget takes


def free_memory_bytes(device: torch.device) -> int:
    """Bytes free on ``device`` now (CUDA: ``mem_get_info``; CPU: the kernel's MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover - non-POSIX
        return 8 << 30


def default_budget(backends: dict[str, KVBackend], layouts: dict, page_bytes: int, max_batch_size: int,
                   max_total_tokens: int, prefill_chunk_tokens: int | None, device: torch.device) -> int:
    """The KV budget when ``KV_CACHE_BUDGET_BYTES`` is unset (bytes): the pages ``max_batch_size`` sequences of
    ``max_total_tokens`` tokens of the costliest served backend can hold at once, plus the null page; at most
    :data:`MEMORY_FRACTION` of the memory free now. A sequence counts as admission counts it
    (:meth:`KVCacheManager.pages_to_finish`): a prompt of ``max_total_tokens`` prefilled in steps cut anywhere (an
    int8-family prompt's exact pages while it is prefilled included), so that the longest request fits alone. A
    prompt that asks for every position's log-probability is prefilled in one step and may need more."""
    def most(name: str, layout) -> int:
        chunk = largest_step(prefill_chunk_tokens if backends[name].chunked_prefill else None)
        return max(layout.pages_for(max_total_tokens, prefill_chunk_tokens),
                   layout.pages_to_generate(max_total_tokens, max_total_tokens, chunk))

    pages = max(most(name, layout) for name, layout in layouts.items())
    need = (max_batch_size * pages + 1) * page_bytes
    return int(min(need, MEMORY_FRACTION * free_memory_bytes(device)))


def pages_in_budget(budget_bytes: int, page_bytes: int) -> int:
    """The KV pages ``budget_bytes`` holds (pages of ``page_bytes`` bytes).

    Raises:
        ValueError: naming ``KV_CACHE_BUDGET_BYTES``, if it holds fewer than two pages (the null page and one).
    """
    num_pages = budget_bytes // page_bytes
    if num_pages < 2:
        raise ValueError(f"KV_CACHE_BUDGET_BYTES={budget_bytes} holds fewer than 2 KV blocks of {page_bytes} bytes "
                         f"(at least {2 * page_bytes} for the served backends)")
    return num_pages


def build_engine(model, tokenizer, backends: dict[str, KVBackend], eos_token_ids: set[int], *, max_batch_size: int,
                 budget_bytes: int | None, max_total_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 prefill_chunk_tokens: int | None = 256, max_concurrent_requests: int = 128,
                 prefix_caching: bool = True, prefill_itl_ratio: float | None = None) -> Engine:
    """An engine over one KV pool of ``budget_bytes`` (default: :func:`default_budget`) for ``backends``; with
    ``prefill_itl_ratio``, a step that carries prefill chunks while sequences decode costs at most that many decode
    steps (:class:`ChunkBudget`).

    Raises:
        ValueError: if the budget holds fewer than two pages.
    """
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    page_bytes, layouts = page_layouts(backends, dtype, block_size)
    if budget_bytes is None:
        budget_bytes = default_budget(backends, layouts, page_bytes, max_batch_size, max_total_tokens,
                                      prefill_chunk_tokens, device)
    num_pages = pages_in_budget(budget_bytes, page_bytes)
    num_layers = next(iter(backends.values())).geometry.num_layers
    pool = KVPool(num_pages, page_bytes, layouts, device)
    kv = KVCacheManager(backends, layouts, page_bytes, num_pages, prefill_chunk_tokens, prefix_caching)
    runner = ModelRunner(model, num_layers, pool)
    scheduler = Scheduler(max_batch_size, kv, prefill_chunk_tokens, ChunkBudget(prefill_itl_ratio))
    return Engine(runner, backends, tokenizer, eos_token_ids, scheduler, max_concurrent_requests)
