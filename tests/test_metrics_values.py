"""Metric values the README promises, read from the recorder's registry while an engine runs.

- the live gauges drop a finished request before its last event is handed to its client;
- ``kvserve_request_kv_cache_bytes`` is a request's KV at its largest, also for int8 stores that
  shrink when their residual window drains;
- the dca gauges and counters exist for ``dca`` and for every composition with it.
"""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from tests.closed_forms import full_bytes_per_token_per_layer, int8_bytes_per_token_per_layer
from server.metrics import Metrics, Recorder
from server.engine.sequence import FinishReason
from tests.engine_helpers import make_engine, make_seq, on_events, run_all, run_step

MODEL = "m"


def _value(registry: CollectorRegistry, name: str, backend: str) -> float | None:
    return registry.get_sample_value(name, {"model": MODEL, "backend": backend})


def _engine_with_recorder(ref_model, backend: str, **options):
    model, tok = ref_model
    engine = make_engine(model, tok, backend, **options)
    metrics = Metrics()
    engine.recorder = Recorder(metrics, MODEL, [backend])
    return engine, metrics.registry, tok


def test_gauges_drop_a_request_before_its_last_event(ref_model):
    engine, registry, tok = _engine_with_recorder(ref_model, "full")
    seen_at_last_event = {}

    def emit(event):
        if event.finish_reason is not None:
            for name in ("kvserve_kv_cache_bytes", "kvserve_kv_cache_used_bytes", "kvserve_kv_cache_tokens",
                         "kvserve_requests_running"):
                seen_at_last_event[(event.finish_reason, name)] = _value(registry, name, "full")

    done = make_seq(tok, "And God said", 6)
    cancelled = make_seq(tok, "In the beginning", 300)
    on_events(done, emit)
    on_events(cancelled, emit)
    engine.submit(done)
    engine.submit(cancelled)
    run_step(engine)
    run_step(engine)
    assert _value(registry, "kvserve_kv_cache_bytes", "full") > 0
    cancelled.cancel()
    run_all(engine, [])
    assert done.finish_reason == FinishReason.LENGTH and cancelled.finish_reason == FinishReason.CANCELLED
    # when the cancelled one ended, `done` was still running (6 tokens): only its KV was left
    assert seen_at_last_event[(FinishReason.CANCELLED, "kvserve_requests_running")] == 1
    assert 0 < seen_at_last_event[(FinishReason.CANCELLED, "kvserve_kv_cache_used_bytes")] < 16384 * 12
    # held: `done`'s one block of the pool (its prompt + 6 tokens fit one 16-token block)
    assert seen_at_last_event[(FinishReason.CANCELLED, "kvserve_kv_cache_bytes")] == engine.kv.page_bytes
    for name in ("kvserve_kv_cache_bytes", "kvserve_kv_cache_used_bytes", "kvserve_kv_cache_tokens",
                 "kvserve_requests_running"):
        assert seen_at_last_event[(FinishReason.LENGTH, name)] == 0, name


def test_request_kv_histogram_records_the_peak_of_a_draining_int8_store(ref_model):
    engine, registry, tok = _engine_with_recorder(ref_model, "int8", group_size=32, residual=32)
    seq = make_seq(tok, "And God said", 70, backend="int8")
    run_all(engine, [seq])
    prompt, generated = len(seq.prompt_ids), len(seq.output_ids)
    assert prompt + generated - 1 > 64  # the residual window drained at 64 cached tokens
    cfg = ref_model[0].config
    heads, head_dim, layers = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, cfg.num_hidden_layers

    def store_bytes(tokens: int) -> float:  # the project's formula: average bytes/token/layer at `tokens`
        return int8_bytes_per_token_per_layer(heads, head_dim, 4, 32, 32, tokens) * tokens * layers

    # cached tokens run from the prompt (after prefill) to prompt + generated - 1 (the last token is never fed)
    sizes = [store_bytes(n) for n in range(prompt, prompt + generated)]
    peak = max(sizes)
    assert peak == store_bytes(63) == 63 * full_bytes_per_token_per_layer(heads, head_dim, 4) * layers
    assert sizes[-1] < peak  # the final size is not the peak
    assert _value(registry, "kvserve_request_kv_cache_bytes_sum", "int8") == peak
    assert _value(registry, "kvserve_request_kv_cache_bytes_count", "int8") == 1


def _fake_seq(backend: str, reuse: int):
    store = SimpleNamespace(num_tokens=lambda: 10, stats=lambda: {"dca_reuse_layers": reuse, "dca_fallbacks": 0})
    return SimpleNamespace(backend_name=backend, store=store, kv_stored_bytes=1000, kv_held_bytes=1024, output_ids=[1, 2],
                           kv_tiers={"exact": 10})


def test_dca_metrics_exist_for_every_dca_composition():
    backends = ["full", "int8", "dca", "dca+int8", "dca+mla"]
    metrics = Metrics()
    recorder = Recorder(metrics, MODEL, backends)
    r = metrics.registry
    for b in ("dca", "dca+int8", "dca+mla"):
        assert _value(r, "kvserve_dca_reuse_layers", b) == 0, b
        assert _value(r, "kvserve_dca_fallbacks_total", b) == 0, b
    for b in ("full", "int8"):
        assert _value(r, "kvserve_dca_reuse_layers", b) is None
    recorder.step_state([_fake_seq("dca+int8", 3), _fake_seq("dca+mla", 2), _fake_seq("dca+mla", 1)], {},
                        store=lambda seq: seq.store)
    assert _value(r, "kvserve_dca_reuse_layers", "dca+int8") == 3
    assert _value(r, "kvserve_dca_reuse_layers", "dca+mla") == 3
    assert _value(r, "kvserve_dca_reuse_layers", "dca") == 0
    assert recorder.live_generated == {"full": 0, "int8": 0, "dca": 0, "dca+int8": 2, "dca+mla": 4}


def test_a_dca_composition_reports_its_reuse_layers_from_a_real_store(ref_model, monkeypatch):
    """dca+int8 with every other layer reusing (threshold -1): the gauge counts 4 layers while it runs."""
    import cache_backends.calibration as calibration

    full_slice = calibration.calibration_ids
    # threshold -1 reuses whatever the fitted maps are: a short calibration slice is enough (and fast)
    monkeypatch.setattr(calibration, "calibration_ids", lambda model, tokenizer=None, max_tokens=0:
                        full_slice(model, tokenizer, max_tokens=512))
    engine, registry, tok = _engine_with_recorder(ref_model, "dca+int8", threshold=-1.0, probe_interval=1000)
    seen = []

    def emit(event):
        if event.finish_reason is None:
            seen.append(_value(registry, "kvserve_dca_reuse_layers", "dca+int8"))

    seq = on_events(make_seq(tok, "And God said, Let there be light", 5, backend="dca+int8"), emit)
    run_all(engine, [seq])
    # each token is delivered once its step is over (Engine.step returns its events), after that step's report
    assert seen == [4.0, 4.0, 4.0, 4.0]
    assert _value(registry, "kvserve_dca_reuse_layers", "dca+int8") == 0


def test_bytes_per_token_gauge_resets_when_nothing_is_cached(ref_model):
    """kvserve_kv_cache_bytes_per_token describes the live sequences: 0 once none is left, not the last one's."""
    engine, registry, tok = _engine_with_recorder(ref_model, "full")
    seq = make_seq(tok, "And God said", 4)
    engine.submit(seq)
    run_step(engine)
    assert _value(registry, "kvserve_kv_cache_bytes_per_token", "full") == 16384  # fp32, 8 layers
    run_all(engine, [])
    assert seq.finish_reason == FinishReason.LENGTH
    assert _value(registry, "kvserve_kv_cache_bytes_per_token", "full") == 0
    assert engine.recorder.live_generated == {"full": 0}


def test_info_bytes_per_token_are_floats_for_every_backend():
    """/info's kv_bytes_per_token: one JSON type (float) whether a backend's sum is whole (full) or not (int8)."""
    import torch
    import transformers

    from cache_backends.geometry import ModelGeometry
    from cache_backends.registry import create
    from server.engine_loading import kv_sizes
    from tests.conftest import MODEL_DIR

    geometry = ModelGeometry.from_config(transformers.AutoConfig.from_pretrained(MODEL_DIR), torch.float32)
    sizes = kv_sizes({n: create(n, geometry) for n in ("full", "int8", "mla")}, geometry.num_layers, 1024)
    assert all(type(v) is float for v in sizes["kv_bytes_per_token"].values())
    assert all(type(v) is float for row in sizes["kv_bytes_per_token_by_seq_len"].values() for v in row.values())
    assert sizes["kv_bytes_per_token"]["full"] == 16384.0
