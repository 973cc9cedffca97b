"""Building the serving stack (model, backends, engine, metrics) from settings."""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from cache_backends.base import KVBackend, ModelGeometry
from cache_backends.calibration_cache import CalibrationCache
from cache_backends.registry import create
from cache_backends.spec import format_spec
from server import __version__
from server.config import Settings
from server.engine.engine import Engine
from server.engine.setup import build_engine
from server.metrics import Metrics, Recorder
from server.model_loading import load_model, resolve_device, resolve_dtype
from server.service import MAX_SEQUENCES_PER_REQUEST, GenerationService, Limits

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
    default of ``KV_BACKENDS`` and that this model cannot take is left out with a log line.

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
    tokenizer, device, dtype, geometry)`` (the HTTP process's engine and the engine core process load alike)."""
    import torch

    torch.set_num_threads(settings.torch_num_threads or default_torch_threads())
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
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
    from server.quality_budget import Scorer, choose

    budget = settings.kv_quality_budget
    calibration = None
    calibrating = any(part in ("gqa", "mla", "dca") for name in names for part in name.split("+"))
    if calibrating or (budget is not None and any(n != "full" for n in names)):
        from cache_backends.calibration import calibration_ids

        calibration = calibration_ids(model, tokenizer, path=settings.kv_calibration_file)
    scorer = Scorer(model, geometry, calibration, cache) if budget is not None and calibration else None
    backends, quality = {}, {}
    for name in names:
        backends[name], choice = choose(name, geometry, settings.backend_options(name),
                                        settings.explicit_options(name), model, calibration, cache, scorer, budget)
        quality[name] = choice.as_dict()
    return backends, quality


def engine_info(s: Settings, dtype, device, backends: dict[str, KVBackend], quality: dict[str, dict],
                cache: CalibrationCache, geometry: ModelGeometry, max_total: int, kv_info: dict) -> dict:
    """``/info``'s facts of the loaded model, its backends and the KV pool (``kv_info``:
    :meth:`server.engine.kv_cache.KVCacheManager.info`), from where the engine runs (JSON-compatible)."""
    return {
        "model_dtype": str(dtype).removeprefix("torch."), "model_device_type": device.type,
        "kv_backend_params": {n: b.params() for n, b in backends.items()},
        "kv_backend_details": {n: b.details() for n, b in backends.items() if b.details()},
        "kv_quality_budget_pct": s.kv_quality_budget, "kv_quality": quality,
        "kv_calibration": [{k: v for k, v in e.as_dict().items() if k != "figures"} for e in cache.events
                           if e.kind != "price"],  # prices: kv_quality
        **kv_sizes(backends, geometry.num_layers, max_total), "num_layers": geometry.num_layers,
        "num_attention_heads": geometry.num_attention_heads,
        "num_key_value_heads": geometry.num_key_value_heads, "head_dim": geometry.head_dim,
        "torch_num_threads": torch_threads(), **kv_info,
    }


@dataclass
class ServerState:
    """Everything the routes need; ``service`` is ``None`` until the model is loaded."""

    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    service: GenerationService | None = None
    engine: Engine | None = None
    backends: dict[str, KVBackend] = field(default_factory=dict)
    quality: dict[str, dict] = field(default_factory=dict)
    """Each served backend's quality-budget choice and price (``/info``'s ``kv_quality``)."""
    model_name: str = ""
    info: dict = field(default_factory=dict)
    load_error: str | None = None
    loading: str = "model is loading"
    """What start-up is doing until ``service`` is set: ``/health``'s 503 message (pricing takes minutes)."""
    started: float = field(default_factory=time.time)
    model_names: list[str] = field(default_factory=list)
    """What the OpenAI routes accept in ``model`` (``SERVED_MODEL_NAME``); the first is ``model_name``."""
    draining: bool = False
    """Set on SIGTERM (``kvserve serve``): ``/health`` answers 503 and new generation requests are refused."""
    in_flight: int = 0
    """Generation requests in flight (:class:`server.middleware.InFlight`)."""

    model_config: dict = field(default_factory=dict)
    """The served model's config (``config.json``'s fields; the built-in page's model shape)."""
    exit_on_fatal: bool = False
    """Stop the server (SIGINT to this process; ``kvserve serve`` then exits 1 naming ``load_error``) when the engine
    core process dies (``ENGINE_PROCESS``)."""

    def load(self) -> None:
        """Load the model and start the engine (runs in a background thread at start-up)."""
        s = self.settings
        if s.engine_process:
            self._load_core()
            return
        model, tokenizer, device, dtype, geometry = load_weights(s)
        names = list(create_backends(s, geometry))  # checked against the model; built below, as priced
        cache = CalibrationCache(s.kv_calibration_cache_dir)
        self.loading = PRICING
        self.backends, self.quality = prepare_backends(s, names, model, tokenizer, geometry, cache)
        # MODEL_ID as given (a path for a local model, as vLLM names it: tools load the tokenizer from the served
        # name), and a local folder's name as an alias
        self.model_names = s.model_names(s.model_id, *([Path(s.model_id).name] if Path(s.model_id).exists() else []))
        self.model_name = self.model_names[0]
        max_input, max_total = s.token_limits(model.config.max_position_embeddings)
        limits = Limits(max_input, max_total, s.max_stop_sequences)
        eos_ids = eos_token_ids(model, tokenizer)
        self.loading = "model loaded; starting the engine"
        recorder = Recorder(self.metrics, self.model_name, names)
        engine = build_engine(model, tokenizer, self.backends, eos_ids, recorder=recorder,
                              **engine_options(s, max_total))
        recorder.cache_config(engine.kv.info())
        engine.start()
        self.engine = engine
        self.model_config = model.config.to_dict()
        self.info = {**self.server_info(max_input, max_total, names),
                     **engine_info(s, dtype, device, self.backends, self.quality, cache, geometry, max_total,
                                   engine.kv.info()), "version": __version__}
        self.service = GenerationService(engine, tokenizer, limits, s.kv_backend, prefix_caching=s.kv_prefix_caching)

    def _load_core(self) -> None:
        """``ENGINE_PROCESS``: start the engine core process (it loads the model and the backends) and serve
        through it (:class:`server.engine.core_client.CoreClient`)."""
        from server.engine.core_client import CoreClient

        s = self.settings
        self.loading = "the engine core process is loading the model and preparing the KV backends"
        client = CoreClient(s, on_death=self._core_died)
        try:
            ready = client.start(on_stage=lambda stage: setattr(self, "loading", stage))
        except BaseException:
            client.stop()
            raise
        self.model_names = s.model_names(s.model_id, *([Path(s.model_id).name] if Path(s.model_id).exists() else []))
        self.model_name = self.model_names[0]
        max_input, max_total = s.token_limits(ready.max_position_embeddings)
        client.recorder = Recorder(self.metrics, self.model_name, ready.backends)
        client.recorder.cache_config(ready.info)
        self.engine = client
        self.model_config = ready.model_config
        self.info = {**self.server_info(max_input, max_total, ready.backends), **ready.info, "version": __version__}
        self.service = GenerationService(client, client.tokenizer, Limits(max_input, max_total, s.max_stop_sequences),
                                         s.kv_backend, prefix_caching=s.kv_prefix_caching)

    def server_info(self, max_input: int, max_total: int, names: list[str]) -> dict:
        """``/info``'s facts of the settings and the limits (the engine's: :func:`engine_info`)."""
        s = self.settings
        return {"model_id": self.model_name, "model_path": s.model_id, "kv_backend": s.kv_backend, "kv_backends": names,
                "max_input_tokens": max_input, "max_total_tokens": max_total,
                "max_stop_sequences": s.max_stop_sequences, "max_batch_size": s.max_batch_size,
                "max_concurrent_requests": s.max_concurrent_requests, "served_model_names": self.model_names,
                "shutdown_grace_seconds": s.shutdown_grace_seconds, "kv_cache_budget_bytes": s.kv_cache_budget_bytes}

    def _core_died(self, reason: str) -> None:
        """The engine core process is gone: ``/health`` answers 503 with ``reason``, and the server stops."""
        self.load_error = reason
        self.service = None
        if self.exit_on_fatal:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGINT)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.stop()
