"""What the engine core loads from the settings: torch's threads, the model, the served KV backends (each at the
setting the quality budget chooses, priced), the engine's options, and ``/info``'s facts of them
(:func:`server.engine.core_loading.load_core` runs them, in the engine core's process or thread)."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from cache_backends.base import KVBackend
from cache_backends.geometry import ModelGeometry
from cache_backends.calibration_cache import CalibrationCache
from cache_backends.registry import create
from cache_backends import catalog
from cache_backends.spec import format_spec
from server.config import Settings
from server.model_loading import load_model, resolve_device, resolve_dtype
from server.service import MAX_SEQUENCES_PER_REQUEST

log = logging.getLogger("kvserve")

REFERENCE_SEQ_LEN = 1024  # the length of /info's headline bytes per token (as the README's tables and the bench)
SHORT_SEQ_LEN = 128


def kv_sizes(backends: dict[str, KVBackend], num_layers: int, max_total_tokens: int) -> dict:
    """``/info``'s KV sizes, each backend's bytes per token over all layers from its closed-form sums (the
    function ``kvserve estimate`` prints):

    * ``kv_bytes_per_token``: at :data:`REFERENCE_SEQ_LEN` tokens;
    * ``kv_bytes_per_token_by_seq_len``: at 128 and 1024 tokens (those under ``max_total_tokens``) and at
      ``max_total_tokens``, keyed by the length as a string. A sequence of n tokens holds n times the
      figure at n: int8-family backends cost more per token on short sequences, whose newest 32-63 tokens
      (the residual window and the forming group) are in full precision;
    * ``kv_min_bytes_per_token``: for a backend whose size is a range (``elastic``, from every token exact to
      every compressible group quantized), its least at :data:`REFERENCE_SEQ_LEN` tokens;
    * ``kv_estimate_spec``: the ``kvserve estimate`` spec that gives the same numbers (``dca``: with its
      calibrated reuse fraction; a live sequence's own reuse shows in ``kvserve_dca_reuse_layers``).
    """
    lengths = sorted({n for n in (SHORT_SEQ_LEN, REFERENCE_SEQ_LEN) if n < max_total_tokens} | {max_total_tokens})
    sizes = {n: b.bytes_per_token_per_layer(REFERENCE_SEQ_LEN) for n, b in backends.items()}
    return {
        # floats for every backend (the sums of some backends are whole numbers, others' are not): one JSON type
        "kv_bytes_per_token": {n: float(per * num_layers) for n, per in sizes.items()},
        "kv_bytes_per_token_by_seq_len": {n: {str(t): float(b.bytes_per_token_per_layer(t) * num_layers)
                                              for t in lengths} for n, b in backends.items()},
        "kv_min_bytes_per_token": {n: float(least * num_layers) for n, least in (
            (n, b.min_bytes_per_token_per_layer(REFERENCE_SEQ_LEN)) for n, b in backends.items())
            if least < sizes[n]},
        "kv_estimate_spec": {n: format_spec(*b.sums_spec()) for n, b in backends.items()},
    }


def torch_threads() -> int:
    """torch's intra-op thread count now."""
    import torch

    return torch.get_num_threads()


def create_backends(settings: Settings, geometry: ModelGeometry) -> dict[str, KVBackend]:
    """The served backends (:meth:`Settings.served_backends`), built for ``geometry``; one that came from the
    default of ``KV_BACKENDS`` and that this model cannot take is left out with a log line. ``KV_SLIDING_WINDOW_POOL
    =false``: none keeps only a sliding layer's window in the pool.

    Raises:
        ValueError: a backend that was asked for cannot serve this model (the backend's one-line message).
    """
    backends = {}
    for name in settings.served_backends():
        try:
            backends[name] = create(name, geometry, **settings.backend_options(name))
        except ValueError as exc:
            if name not in settings.optional_backends():
                raise
            log.info("not serving %s besides KV_BACKEND (KV_BACKENDS unset): %s", name, exc)
            continue
        if not settings.kv_sliding_window_pool:  # every layer keeps every token (a model's windows ignored)
            backends[name].windowed_pool = False
    return backends


PRICING = "model loaded; calibrating and pricing the KV backends (cached for the next start)"
"""``/health``'s 503 message once the model is loaded, while the KV backends are calibrated and priced."""


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
"""cgroup v2's CPU quota of this process's group: ``"<quota> <period>"`` in microseconds, or ``"max <period>"``."""


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (``cpu.max``, as a container's
    ``--cpus`` sets it), at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def default_torch_threads() -> int:
    """``TORCH_NUM_THREADS=0``'s thread count: :func:`usable_cpus` less one, which the HTTP side (event loop,
    detokenization, sockets) then has to itself, and no more than torch's own default; at least 1. Measured on 2
    cores (``python -m bench.threads``, docs/benchmarks.md "Threads"): one thread had the best worst case of every
    wait policy and thread count, quiet and beside a process busy on one core, where two threads were up to 4x
    slower beside it."""
    import torch

    return max(1, min(usable_cpus() - 1, torch.get_num_threads()))


def load_weights(settings: Settings):
    """``TORCH_NUM_THREADS`` (0: :func:`default_torch_threads`), then the model on its device and dtype: ``(model,
    tokenizer, device, dtype, geometry)`` (in the engine core)."""
    import torch

    from cache_backends import kernels

    torch.set_num_threads(settings.torch_num_threads or default_torch_threads())
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    kernels.configure(settings.kv_attention)  # KV_ATTENTION=kernel and no kernel: ValueError, before the weights
    attention = kernels.status(device)
    log.info("attention over the KV pool: %s%s", attention["path"],
             f" ({attention['isa']}; 4-bit keys scored in {attention['int4_key_scores']})" if attention["isa"]
             else f" ({attention['reason']})")
    model, tokenizer = load_model(settings.model_id, device, dtype)
    return model, tokenizer, device, dtype, ModelGeometry.from_config(model.config, dtype)


def eos_token_ids(model, tokenizer) -> set[int]:
    """The ids that end generation: the generation config's end-of-text id(s), else the tokenizer's."""
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [tokenizer.eos_token_id])


def engine_options(settings: Settings, max_total_tokens: int) -> dict:
    """:func:`server.engine.setup.build_engine`'s options from the settings."""
    s = settings
    return dict(max_batch_size=s.max_batch_size, budget_bytes=s.kv_cache_budget_bytes,
                max_total_tokens=max_total_tokens, block_size=s.kv_block_size,
                prefill_chunk_tokens=s.max_num_batched_tokens or None,
                # requests are counted at the HTTP edge (server.middleware.InFlight); the engine's own count is
                # of sequences, and this many can never be exceeded by those requests
                max_concurrent_requests=s.max_concurrent_requests * MAX_SEQUENCES_PER_REQUEST,
                prefix_caching=s.kv_prefix_caching, prefill_itl_ratio=s.prefill_itl_ratio or None)


def prepare_backends(settings: Settings, names: list[str], model, tokenizer, geometry: ModelGeometry,
                     cache: CalibrationCache) -> tuple[dict[str, KVBackend], dict[str, dict]]:
    """Build and prepare the served backends, each at the setting the quality budget chooses
    (:mod:`server.quality_budget`; ``KV_QUALITY_BUDGET``), and price each.

    Returns:
        ``(backends by name, each one's choice and price as /info's kv_quality shows it)``.
    """
    from server.quality_budget import choose
    from server.quality_price import Scorer

    budget = settings.kv_quality_budget
    calibration = None
    calibrating = any(catalog.get(part).calibrates for name in names for part in name.split("+"))
    if calibrating or (budget is not None and any(n != "full" for n in names)):
        from cache_backends.calibration import calibration_ids

        calibration = calibration_ids(model, tokenizer, path=settings.kv_calibration_file)
    scorer = None
    if budget is not None and calibration:
        scorer = Scorer(model, geometry, calibration, cache,
                        long_probe=long_probe(settings, names, model, tokenizer, geometry, calibration))
    served = settings.token_limits(model.config.max_position_embeddings)[1]
    backends, quality = {}, {}
    for name in names:
        backends[name], choice = choose(name, geometry, settings.backend_options(name),
                                        settings.explicit_options(name), model, calibration, cache, scorer, budget,
                                        settings.kv_quality_min_agreement)
        quality[name] = choice.as_dict()
        # a token-dropping backend priced only on windows it never drops a token of, and not on a long input,
        # though it drops tokens of the contexts served
        warning = window_warning(backends[name]) if choice.long_price is None and backends[name].drops_tokens(
            served) else None
        if warning:
            log.warning("%s: %s", name, warning)
            quality[name]["window_warning"] = warning
    return backends, quality


def long_context(settings: Settings, max_positions: int) -> int:
    """The quality budget's long input length in tokens (:func:`server.long_context.long_context_length`:
    ``KV_QUALITY_LONG_CONTEXT``, default 8192, capped by ``max_positions`` and ``MAX_TOTAL_TOKENS``); 0: none (the
    setting off, or the budget off)."""
    from server.long_context import long_context_length

    if settings.kv_quality_budget is None:
        return 0
    return long_context_length(settings.kv_quality_long_context, max_positions, settings.max_total_tokens)


def long_probe(settings: Settings, names: list[str], model, tokenizer, geometry: ModelGeometry,
               calibration: list[int]):
    """The quality budget's long input (:func:`server.long_context.build_long_probe`, from the end of the
    calibration text ``calibration``) when a backend of ``names`` can lose far tokens at its length
    (:meth:`cache_backends.base.KVBackend.drops_tokens`), else ``None``; also ``None``, with a warning, when it cannot
    be built (a calibration text shorter than it, a tokenizer without character offsets)."""
    from server.long_context import build_long_probe

    length = long_context(settings, model.config.max_position_embeddings)
    if not length or not any(create(n, geometry, **settings.backend_options(n)).drops_tokens(length)
                             for n in names):
        return None
    try:
        return build_long_probe(tokenizer, calibration, length)
    except (ValueError, NotImplementedError) as exc:  # no character offsets: a slow tokenizer
        log.warning("not pricing on a long input of %d tokens (KV_QUALITY_LONG_CONTEXT): %s", length, exc)
        return None


def window_warning(backend: KVBackend) -> str | None:
    """What ``/info``'s ``kv_quality`` and the start-up log say of a backend that drops tokens older than its window
    (``window``: :meth:`cache_backends.window.WindowBackend.window_warning`) when the quality budget's windows
    (:data:`server.quality_price.PRICE_WINDOW` tokens) are no longer than it: its price there is 0 and says nothing
    of longer contexts; ``None`` for any other backend."""
    from server.quality_price import PRICE_WINDOW

    says = getattr(backend, "window_warning", None)
    return says(PRICE_WINDOW) if says else None


def kernels_status(device) -> dict:
    """What attends a step over the pool on ``device`` (:func:`cache_backends.kernels.status`)."""
    from cache_backends import kernels

    return kernels.status(device)


def engine_info(s: Settings, dtype, device, backends: dict[str, KVBackend], quality: dict[str, dict],
                cache: CalibrationCache, geometry: ModelGeometry, max_total: int, kv_info: dict) -> dict:
    """``/info``'s facts of the loaded model, its backends and the KV pool (``kv_info``:
    :meth:`server.engine.kv_cache.KVCacheManager.info`), from where the engine runs (JSON-compatible)."""
    return {
        "model_dtype": str(dtype).removeprefix("torch."), "model_device_type": device.type,
        "kv_backend_params": {n: b.params() for n, b in backends.items()},
        "kv_backend_details": {n: b.details() for n, b in backends.items() if b.details()},
        "kv_quality_budget_pct": s.kv_quality_budget, "kv_quality_min_agreement": s.kv_quality_min_agreement,
        "kv_quality": quality,
        "kv_calibration": [{k: v for k, v in e.as_dict().items() if k != "figures"} for e in cache.events
                           if e.kind != "price"],  # prices: kv_quality
        **kv_sizes(backends, geometry.num_layers, max_total), "num_layers": geometry.num_layers,
        "num_attention_heads": geometry.num_attention_heads,
        "num_key_value_heads": geometry.num_key_value_heads, "head_dim": geometry.head_dim,
        "sliding_window": sliding_window_info(geometry),
        "torch_num_threads": torch_threads(), "kv_attention": kernels_status(device), **kv_info,
    }


def sliding_window_info(geometry: ModelGeometry) -> dict | None:
    """``/info``'s ``sliding_window``: the model's windows and the layers that attend through each, or ``None`` when
    no layer has a window shorter than the context."""
    if not geometry.sliding_layers:
        return None
    windows = sorted({w for w in geometry.layer_windows if w is not None})
    return {"tokens": windows[0] if len(windows) == 1 else windows,
            "layers": [i for i, w in enumerate(geometry.layer_windows) if w is not None]}
