"""The server's engine for one backend, in-process: what ``kvserve bench`` (its engine throughput and needle
answers) and the benchmarks under ``bench/`` step themselves, so that they can read the KV bytes held after every
step."""

from __future__ import annotations


def new_engine(model, tokenizer, backend, streams: int, budget: int | None, chunk: int | None = 256,
               prefix_caching: bool = True):
    """The server's engine (pool, scheduler, runner) for ``backend`` alone, in-process (stepped on this, the main,
    thread: with glibc's allocator thresholds fixed, :func:`server.engine.malloc_tuning.keep_step_memory`)."""
    from server.engine.malloc_tuning import keep_step_memory
    from server.engine.setup import build_engine

    keep_step_memory()
    return build_engine(model, tokenizer, {backend.name: backend}, set(), max_batch_size=streams,
                        budget_bytes=budget, max_total_tokens=model.config.max_position_embeddings,
                        prefill_chunk_tokens=chunk, max_concurrent_requests=max(streams, 1),
                        prefix_caching=prefix_caching)
