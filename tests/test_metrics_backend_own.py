"""A backend's own metrics come from its declaration (issue #43): a backend no kvserve file names, ``toy``, declares
a gauge and a counter; both are exported for it and its compositions, carried from the engine core to the HTTP
side's recorder as plain ``{metric name: value}``, and the metrics module and the core's messages name no
backend."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from cache_backends import catalog
from cache_backends.declaration import BackendDecl, Metric
from server import metrics as metrics_module
from server.engine import messages as m
from server.engine.core_client import CoreClient
from server.engine.core_recorder import CoreRecorder
from server.metrics import Metrics, Recorder

REPO = Path(__file__).resolve().parents[1]
TOY = BackendDecl(name="toy", backend="toy_package.backend:ToyBackend", inners=("int8",),
                  metrics=(Metric("kvserve_toy_widgets", "gauge", "toy: widgets held by live sequences.", "widgets"),
                           Metric("kvserve_toy_spins", "counter", "toy: spins the engine counted.", "spins")))


@pytest.fixture
def toy(monkeypatch):
    """The catalog with ``toy`` declared beside kvserve's own backends."""
    known = catalog.declarations()
    monkeypatch.setattr(catalog, "declarations", lambda: {**known, "toy": TOY})
    metrics_module.backend_metrics.cache_clear()
    yield
    metrics_module.backend_metrics.cache_clear()


def _seq(backend: str, widgets: int):
    store = SimpleNamespace(num_tokens=lambda: 10, stats=lambda: {"widgets": widgets, "spins": 1})
    return SimpleNamespace(backend_name=backend, store=store, kv_stored_bytes=1000, kv_held_bytes=1024,
                           output_ids=[1], kv_tiers={"exact": 10}, kv_stats={"spins": 4})


def _store(seq):
    """The fake sequence's KV view (the KV cache manager's ``store``)."""
    return seq.store


def _value(registry, name: str, backend: str) -> float | None:
    return registry.get_sample_value(name, {"model": "m", "backend": backend})


def test_a_declared_gauge_and_counter_are_exported_for_the_backend_and_its_compositions(toy):
    metrics = Metrics()
    recorder = Recorder(metrics, "m", ["full", "toy", "toy+int8"])
    r = metrics.registry
    text = generate_latest(r).decode()
    assert "# HELP kvserve_toy_widgets toy: widgets held by live sequences." in text
    assert "# TYPE kvserve_toy_spins_total counter" in text
    for b in ("toy", "toy+int8"):
        assert _value(r, "kvserve_toy_widgets", b) == 0 and _value(r, "kvserve_toy_spins_total", b) == 0
    assert _value(r, "kvserve_toy_widgets", "full") is None and _value(r, "kvserve_toy_spins_total", "full") is None

    recorder.step_state([_seq("toy", 3), _seq("toy", 2), _seq("toy+int8", 1), _seq("full", 9)], {}, store=_store)
    assert _value(r, "kvserve_toy_widgets", "toy") == 5
    assert _value(r, "kvserve_toy_widgets", "toy+int8") == 1
    assert _value(r, "kvserve_toy_widgets", "full") is None
    recorder.count(_seq("toy", 0), "spins", 2)
    recorder.count(_seq("full", 0), "spins", 2)  # full declares no counter reading it
    assert _value(r, "kvserve_toy_spins_total", "toy") == 2
    assert _value(r, "kvserve_toy_spins_total", "full") is None
    recorder.step_state([], {}, store=_store)
    assert _value(r, "kvserve_toy_widgets", "toy") == 0  # no live sequence: 0, not the last figure


def test_the_core_carries_a_backends_own_figures_to_the_http_recorder(toy):
    """The engine core's recorder measures and counts; its StepOutput goes through msgpack; the HTTP side's replay
    (:meth:`CoreClient._record`) sets the gauge and adds the counter."""
    core = CoreRecorder()
    core.step_state([_seq("toy+int8", 3), _seq("toy+int8", 4)], {"toy+int8": 1}, store=_store)
    core.count(_seq("toy+int8", 0), "spins", 5)
    rows, tiers, generated, own = core.state
    assert own == {"toy+int8": {"kvserve_toy_widgets": 7}}
    stats = m.CoreStats(running=2, rows=rows, tiers=[(b, t, n) for (b, t), n in tiers.items()], generated=generated,
                        waiting_by_backend=core.waiting, own=own)
    out = m.decode_output(m.encode(m.StepOutput(stats=stats, counters=core.counters)))

    metrics = Metrics()
    recorder = Recorder(metrics, "m", ["toy+int8"])
    CoreClient._record(SimpleNamespace(recorder=recorder), out, {})
    assert _value(metrics.registry, "kvserve_toy_widgets", "toy+int8") == 7
    assert _value(metrics.registry, "kvserve_toy_spins_total", "toy+int8") == 5
    assert _value(metrics.registry, "kvserve_requests_running", "toy+int8") == 2


def test_a_finished_requests_store_figures_add_to_its_counters(toy):
    metrics = Metrics()
    recorder = Recorder(metrics, "m", ["toy"])
    seq = _seq("toy", 0)
    seq.finish_reason = SimpleNamespace(value="length")
    seq.times = SimpleNamespace(prefill_start=None, arrival=0.0)
    recorder.request_done(seq)
    assert _value(metrics.registry, "kvserve_toy_spins_total", "toy") == 4


@pytest.mark.parametrize("path", ["server/metrics.py", "server/engine/core.py", "server/engine/core_recorder.py",
                                  "server/engine/core_client.py", "server/engine/messages.py"])
def test_the_metrics_path_names_no_backend_with_metrics_of_its_own(path):
    owners = [d.name for d in catalog.declarations().values() if d.metrics]
    assert owners  # dca's and elastic's metrics are declared
    source = (REPO / path).read_text()
    assert not [name for name in owners if re.search(rf"\b{re.escape(name)}\b", source)], path
