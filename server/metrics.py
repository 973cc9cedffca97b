"""Every Prometheus metric kvserve exports, defined once, and the recorder that updates them.

Each metric carries the labels ``model`` and ``backend`` (the KV backend a request actually used).
The recorder is handed plain objects: each finished request's HTTP-side state
(:class:`server.engine.request_state.RequestState`, from the engine core's client; an engine driven in-process, as
the tests do, hands its ``Sequence``, which has the same fields) and the engine's running batch; only this
module touches prometheus-client. Definitions follow vLLM/TGI: TTFT = arrival → first generated
token; TPOT = (last token − first token) / (generated tokens − 1), one value per request;
inter-token latency = the gap between consecutive tokens of a request, one value per gap;
e2e = arrival → last token; queue time = arrival → start of prefill.

A backend's own metrics (a layer-reuse gauge, a compression counter) are those its declaration lists
(:attr:`cache_backends.declaration.BackendDecl.metrics`): this module names no backend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from cache_backends import catalog
from cache_backends.declaration import Metric

# `_created` timestamps double the series count and no dashboard uses them.
disable_created_metrics()

# Millisecond CPU timings up to minutes.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                   2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
BYTES_BUCKETS = tuple(float(2**k) for k in range(10, 37, 2))  # 1 KiB … 64 GiB

LABELS = ("model", "backend")


@functools.cache
def backend_metrics(backend: str) -> tuple[Metric, ...]:
    """The metrics of ``backend``'s own: those its parts declare (``outer+inner``: both parts')."""
    found = {}
    for part in backend.split("+"):
        decl = catalog.get(part)
        for metric in decl.metrics if decl is not None else ():
            found.setdefault(metric.name, metric)
    return tuple(found.values())


class Metrics:
    """The metric objects, registered in their own ``CollectorRegistry`` (one per server)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kvserve_time_to_first_token_seconds",
                              "Time to first token: request arrival to its first generated token, seconds.",
                              LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvserve_time_per_output_token_seconds",
                              "Time per output token, one value per request with 2+ tokens: "
                              "(last token time - first token time) / (generated tokens - 1), seconds.",
                              LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvserve_inter_token_latency_seconds",
                             "Inter-token latency: gap between consecutive generated tokens of one request, "
                             "one value per gap, seconds.", LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvserve_e2e_request_latency_seconds",
                             "End-to-end latency: request arrival to its last generated token (or its end), seconds.",
                             LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("kvserve_request_queue_time_seconds",
                               "Queue time: request arrival to the start of its prefill, seconds.",
                               LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.request_kv = Histogram("kvserve_request_kv_cache_bytes",
                                    "KV-cache bytes one request's store held at its largest (sum of its tensors).",
                                    LABELS, buckets=BYTES_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvserve_prompt_tokens", "Prompt tokens prefilled.", LABELS, registry=r)
        self.generation_tokens = Counter("kvserve_generation_tokens", "Tokens generated.", LABELS, registry=r)
        self.requests = Counter("kvserve_requests", "Requests ended, by finish reason "
                                "(length, eos_token, stop_sequence, cancelled, error).",
                                LABELS + ("finish_reason",), registry=r)
        self.running = Gauge("kvserve_requests_running", "Requests in the running (decoding) batch.",
                             LABELS, registry=r)
        self.waiting = Gauge("kvserve_requests_waiting", "Requests queued, waiting for admission.",
                             LABELS, registry=r)
        self.kv_held_bytes = Gauge("kvserve_kv_cache_bytes",
                              "KV-cache bytes held by all live sequences: the KV pool's pages they hold; never "
                              "above KV_CACHE_BUDGET_BYTES.", LABELS, registry=r)
        self.kv_stored_bytes = Gauge("kvserve_kv_cache_used_bytes",
                                   "KV-cache bytes of the cached tokens of all live sequences (what the "
                                   "bytes-per-token formulas count; <= kvserve_kv_cache_bytes).", LABELS, registry=r)
        self.kv_tokens = Gauge("kvserve_kv_cache_tokens", "Tokens cached by all live sequences.",
                               LABELS, registry=r)
        self.kv_bytes_per_token = Gauge("kvserve_kv_cache_bytes_per_token",
                                        "KV-cache bytes / cached tokens over the live sequences (all layers); "
                                        "updated every step, 0 when nothing is cached.", LABELS, registry=r)
        self.preemptions = Counter("kvserve_num_preemptions", "Sequences preempted because the KV pool had no free "
                                   "block (their KV freed, recomputed when readmitted).", LABELS, registry=r)
        self.kv_usage = Gauge("kvserve_kv_cache_usage_perc", "KV-cache usage: blocks in use / blocks in the pool, "
                              "0-1 (vLLM's kv_cache_usage_perc).", ("model",), registry=r)
        self.prefix_queries = Counter("kvserve_prefix_cache_queries", "Prefix cache: context tokens looked up at "
                                      "admission (tokens; vLLM's prefix_cache_queries).", LABELS, registry=r)
        self.prefix_hits = Counter("kvserve_prefix_cache_hits", "Prefix cache: context tokens found cached at "
                                   "admission, not prefilled (tokens; vLLM's prefix_cache_hits).", LABELS, registry=r)
        self.prefix_blocks = Gauge("kvserve_prefix_cache_blocks", "Prefix cache: pool blocks holding a cached block "
                                   "that no sequence holds (evictable, counted free in kv_cache_usage_perc).",
                                   ("model",), registry=r)
        self.cache_config = Gauge("kvserve_cache_config_info", "The KV pool's configuration (value 1): tokens per "
                                  "block of each backend, blocks in the pool (num_blocks, and num_gpu_blocks as "
                                  "vLLM names it), prefix caching on or off.",
                                  ("model", "backend", "block_size", "num_blocks", "num_gpu_blocks", "prefix_caching"),
                                  registry=r)
        self.pod_running = Gauge("kvserve_num_requests_running", "Sequences running, all backends together (vLLM's "
                                 "num_requests_running: one series per server, for routers).", ("model",), registry=r)
        self.pod_waiting = Gauge("kvserve_num_requests_waiting", "Sequences waiting, all backends together (vLLM's "
                                 "num_requests_waiting: one series per server, for routers).", ("model",), registry=r)
        self.tier_tokens = Gauge("kvserve_kv_cache_tier_tokens", "Tokens cached by all live sequences per stored "
                                 "form: tier exact (model dtype), or the codes of a quantized tier (int8, int4, "
                                 "k8v4).", LABELS + ("tier",), registry=r)
        self.backend_own: dict[str, Gauge | Counter] = {}  # every declared backend's own metrics, by name
        for decl in catalog.declarations().values():
            for metric in decl.metrics:
                if metric.name not in self.backend_own:
                    kind = {"gauge": Gauge, "counter": Counter}[metric.kind]
                    self.backend_own[metric.name] = kind(metric.name, metric.help, LABELS, registry=r)


class Recorder:
    """Turns engine stats into metric updates.

    Args:
        metrics: the metric objects.
        model: the ``model`` label value.
        backends: the backend names that may appear (their gauges start at 0).
    """

    def __init__(self, metrics: Metrics, model: str, backends: list[str]):
        self.m = metrics
        self.model = model
        self.backends = backends
        # Tokens generated so far by the running sequences, by backend (set with the live gauges; not a metric:
        # the built-in page adds it to kvserve_generation_tokens_total, counted when a request ends, for a
        # tokens/s that moves while requests run).
        self.live_generated: dict[str, int] = dict.fromkeys(backends, 0)
        self._tiers_seen: set[tuple[str, str]] = {(b, "exact") for b in backends}
        for b in backends:  # every series exists from the start, so dashboards and rates see zeros, not gaps
            for gauge in (metrics.running, metrics.waiting, metrics.kv_held_bytes, metrics.kv_stored_bytes, metrics.kv_tokens):
                gauge.labels(model, b).set(0)
            for counter in (metrics.prompt_tokens, metrics.generation_tokens, metrics.preemptions,
                            metrics.prefix_queries, metrics.prefix_hits):
                counter.labels(model, b)
            for reason in ("length", "eos_token", "stop_sequence", "cancelled", "error"):
                metrics.requests.labels(model, b, reason)
            metrics.tier_tokens.labels(model, b, "exact").set(0)
            for metric in backend_metrics(b):
                child = metrics.backend_own[metric.name].labels(model, b)
                if metric.kind == "gauge":
                    child.set(0)

        metrics.kv_usage.labels(model).set(0)
        metrics.prefix_blocks.labels(model).set(0)
        metrics.pod_running.labels(model).set(0)
        metrics.pod_waiting.labels(model).set(0)

    def _l(self, backend: str) -> dict[str, str]:
        return {"model": self.model, "backend": backend}

    def cache_config(self, info: dict) -> None:
        """Publish the pool's shape (:meth:`server.engine.kv_cache.KVCacheManager.info`) as
        ``kvserve_cache_config_info``: one series per served backend, its
        ``prefix_caching`` label true where that backend's blocks go through the prefix cache."""
        sizes = info["block_size_tokens"]
        for b in self.backends:
            cached = info["prefix_caching"] and b in info.get("prefix_cached_backends", sizes)
            self.m.cache_config.labels(self.model, b, str(sizes.get(b, 0)), str(info["num_blocks"]),
                                       str(info["num_blocks"]), str(cached).lower()).set(1)

    def prefix_cache(self, seq, queried: int, hit: int) -> None:
        """A paged sequence was admitted: ``queried`` context tokens looked up, ``hit`` of them cached."""
        labels = self._l(seq.backend_name)
        self.m.prefix_queries.labels(**labels).inc(queried)
        self.m.prefix_hits.labels(**labels).inc(hit)

    def count(self, seq, key: str, value: int = 1) -> None:
        """The engine counted ``value`` of ``key`` for ``seq`` (``compressed_blocks``: blocks freed by compressing
        an on-demand tier; ``preemptions_avoided``: compressing made room instead of a preemption): added to
        the counters of ``seq``'s backend that read ``key``."""
        self._add(seq.backend_name, {key: value})

    def _add(self, backend: str, figures: dict) -> None:
        """Add ``figures`` (key -> number) to ``backend``'s own counters that read them."""
        for metric in backend_metrics(backend):
            if metric.kind == "counter" and figures.get(metric.key):
                self.m.backend_own[metric.name].labels(**self._l(backend)).inc(figures[metric.key])

    def preempted(self, seq) -> None:
        self.m.preemptions.labels(**self._l(seq.backend_name)).inc()

    def prefill_done(self, seq) -> None:
        """``seq`` (a :class:`~server.engine.request_state.RequestState`: ``backend_name``, ``times``,
        ``prompt_ids``) started its prefill at ``seq.times.prefill_start``: its queue time and prompt tokens."""
        labels = self._l(seq.backend_name)
        self.m.queue.labels(**labels).observe(seq.times.prefill_start - seq.times.arrival)
        self.m.prompt_tokens.labels(**labels).inc(len(seq.prompt_ids))

    def request_done(self, seq) -> None:
        """``seq`` (a :class:`~server.engine.request_state.RequestState`) ended with ``seq.finish_reason``: its
        count, tokens, latencies (seconds, from ``seq.times``), KV peak (bytes) and its backend's own figures."""
        labels = self._l(seq.backend_name)
        t = seq.times
        n = len(seq.output_ids)
        self.m.requests.labels(finish_reason=seq.finish_reason.value, **labels).inc()
        self._add(seq.backend_name, seq.kv_stats)
        self.m.generation_tokens.labels(**labels).inc(n)
        if t.prefill_start is None:
            return  # cancelled while queued: it never reached the model
        end = t.last_token if t.last_token is not None else t.prefill_start
        self.m.e2e.labels(**labels).observe(end - t.arrival)
        self.m.request_kv.labels(**labels).observe(seq.peak_kv_stored_bytes)
        if t.first_token is not None:
            self.m.ttft.labels(**labels).observe(t.first_token - t.arrival)
        if n > 1:
            self.m.tpot.labels(**labels).observe((t.last_token - t.first_token) / (n - 1))
            itl = self.m.itl.labels(**labels)
            for a, b in zip(t.token_times, t.token_times[1:]):
                itl.observe(b - a)

    def step_state(self, running: list, waiting: dict[str, int] | None, usage: float | None = None,
                   cached_blocks: int | None = None, *, store: Callable) -> None:
        """Update the live gauges (after every engine step, and when a sequence finishes).

        Args:
            running: the running sequences.
            waiting: queued request counts by backend name, or ``None`` to leave the queue gauges as
                they are.
            usage: the pool's blocks in use / blocks, 0-1, or ``None`` to leave it.
            cached_blocks: the prefix cache's evictable blocks, or ``None`` to leave it.
            store: ``store(seq)``, a sequence's KV view (:meth:`server.engine.kv_cache.KVCacheManager.store`), or
                ``None`` if it holds none.
        """
        self.publish(*live_rows(running, store), waiting, usage, cached_blocks)

    def publish(self, rows: dict[str, list[int]], tier_tokens: dict[tuple[str, str], int], generating: dict[str, int],
                own: dict[str, dict[str, float]], waiting: dict[str, int] | None, usage: float | None = None,
                cached_blocks: int | None = None) -> None:
        """Set the live gauges from plain numbers (:func:`live_rows`' and :meth:`step_state`'s others; the engine
        core sends them, :mod:`server.engine.core`)."""
        if usage is not None:
            self.m.kv_usage.labels(self.model).set(usage)
        if cached_blocks is not None:
            self.m.prefix_blocks.labels(self.model).set(cached_blocks)
        per_backend: dict[str, list[int]] = {b: [0, 0, 0, 0] for b in self.backends}
        per_backend.update(rows)
        generated = {**dict.fromkeys(self.backends, 0), **generating}
        tiers = {**dict.fromkeys(self._tiers_seen, 0), **tier_tokens}  # a tier no live sequence holds now reads 0
        for backend, (count, nbytes, tokens, allocated) in per_backend.items():
            labels = self._l(backend)
            self.m.running.labels(**labels).set(count)
            self.m.kv_held_bytes.labels(**labels).set(allocated)
            self.m.kv_stored_bytes.labels(**labels).set(nbytes)
            self.m.kv_tokens.labels(**labels).set(tokens)
            # 0 when nothing is cached, rather than the last sequence's figure
            self.m.kv_bytes_per_token.labels(**labels).set(nbytes / tokens if tokens else 0)
            figures = own.get(backend, {})
            for metric in backend_metrics(backend):
                if metric.kind == "gauge":
                    self.m.backend_own[metric.name].labels(**labels).set(figures.get(metric.name, 0))
        for (backend, tier), n in tiers.items():
            self.m.tier_tokens.labels(self.model, backend, tier).set(n)
        self._tiers_seen |= tiers.keys()
        self.m.pod_running.labels(self.model).set(sum(row[0] for row in per_backend.values()))
        self.live_generated = generated
        if waiting is not None:
            for backend in per_backend:
                self.m.waiting.labels(**self._l(backend)).set(waiting.get(backend, 0))
            self.m.pod_waiting.labels(self.model).set(sum(waiting.values()))


def live_rows(running: list, store: Callable) -> tuple[dict[str, list[int]], dict[tuple[str, str], int],
                                                      dict[str, int], dict[str, dict[str, float]]]:
    """Plain numbers of the running sequences for :meth:`Recorder.publish`, each sequence's KV read through
    ``store(seq)`` (:meth:`server.engine.kv_cache.KVCacheManager.store`; ``None``: it holds none): by backend
    ``[sequences with a store, bytes of their cached tokens, tokens, bytes allocated]``; tokens by
    ``(backend, tier)``; tokens generated so far by backend; by backend, its own gauges (:func:`backend_metrics`)
    as ``{metric name: value}``, their stores' figures summed."""
    rows: dict[str, list[int]] = {}
    tiers: dict[tuple[str, str], int] = {}
    generated: dict[str, int] = {}
    own: dict[str, dict[str, float]] = {}
    for seq in running:
        for tier, n in seq.kv_tiers.items():
            tiers[seq.backend_name, tier] = tiers.get((seq.backend_name, tier), 0) + n
        generated[seq.backend_name] = generated.get(seq.backend_name, 0) + len(seq.output_ids)
        kv = store(seq)
        if kv is None:
            continue
        row = rows.setdefault(seq.backend_name, [0, 0, 0, 0])
        row[0] += 1
        row[1] += seq.kv_stored_bytes  # measured by the engine once per step (it may be below the peak)
        row[2] += kv.num_tokens()
        row[3] += seq.kv_held_bytes
        gauges = [m for m in backend_metrics(seq.backend_name) if m.kind == "gauge"]
        if gauges:
            stats, figures = kv.stats(), own.setdefault(seq.backend_name, {})
            for metric in gauges:
                figures[metric.name] = figures.get(metric.name, 0) + stats.get(metric.key, 0)
    return rows, tiers, generated, own
