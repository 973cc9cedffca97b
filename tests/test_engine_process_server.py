"""A real ``kvserve serve`` with the engine core in its own process (the default) beside one with the same core in a
thread of the server's process (``ENGINE_PROCESS=false``): greedy /generate and /v1/completions, streamed and not,
the page's routes, /info and the metrics are the same; the engine core process dying turns /health into 503, ends
the running stream with an error event, and the server exits 1 saying why."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from bench.serving import child_pids
from tests.conftest import MODEL_DIR, RunningServer, server_with

ENV = {"KV_BACKENDS": "full", "MAX_BATCH_SIZE": "4"}
thread = server_with({**ENV, "ENGINE_PROCESS": "false"})
process = server_with({**ENV, "ENGINE_PROCESS": None})  # the default

GENERATE = {"inputs": "In the beginning God created", "parameters": {"max_new_tokens": 12, "details": True,
                                                                     "decoder_input_details": True,
                                                                     "top_n_tokens": 2}}
COMPLETION = {"model": str(MODEL_DIR), "prompt": "And the earth was", "max_tokens": 12, "temperature": 0,
              "logprobs": 2}


def sse(url: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))
    return events


def without_times(obj):
    """``obj`` less what differs from run to run (ids, timestamps, logprob rounding noise)."""
    if isinstance(obj, dict):
        return {k: without_times(v) for k, v in obj.items() if k not in ("id", "created", "logprob", "logprobs",
                                                                           "top_logprobs", "token_logprobs")}
    if isinstance(obj, list):
        return [without_times(v) for v in obj]
    return obj


@pytest.mark.parametrize("path, body", [("/generate", GENERATE), ("/v1/completions", COMPLETION)])
def test_non_streaming_greedy_output_is_the_same_in_both(thread, process, path, body):
    a = httpx.post(thread.url + path, json=body, timeout=60).json()
    b = httpx.post(process.url + path, json=body, timeout=60).json()
    assert without_times(a) == without_times(b)
    if path == "/generate":
        assert [t["id"] for t in a["details"]["tokens"]] == [t["id"] for t in b["details"]["tokens"]]
        assert [t["logprob"] for t in b["details"]["tokens"]] == pytest.approx(
            [t["logprob"] for t in a["details"]["tokens"]], abs=1e-4)
        assert b["details"]["prefill"][1:] and [p["id"] for p in b["details"]["prefill"]] == [
            p["id"] for p in a["details"]["prefill"]]


@pytest.mark.parametrize("path, body", [("/generate_stream", GENERATE), ("/v1/completions", {**COMPLETION,
                                                                                            "stream": True})])
def test_streaming_greedy_output_is_the_same_in_both(thread, process, path, body):
    a, b = sse(thread.url + path, body), sse(process.url + path, body)
    assert len(a) == len(b) >= 12
    assert without_times(a) == without_times(b)


def test_stop_sequence_the_same_in_both(thread, process):
    body = {"inputs": "In the beginning God created", "parameters": {"max_new_tokens": 40, "stop": ["LORD,"]}}
    a, b = sse(thread.url + "/generate_stream", body), sse(process.url + "/generate_stream", body)
    assert b[-1]["details"]["finish_reason"] == "stop_sequence"
    assert without_times(a) == without_times(b)


def test_the_default_runs_the_engine_core_in_a_process_of_its_own(thread, process):
    (core_pid,) = child_pids(process.proc.pid)
    assert Path(f"/proc/{core_pid}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", b"server.engine.core"]
    assert child_pids(thread.proc.pid) == []  # ENGINE_PROCESS=false: the same core in a thread


def test_zz_the_core_dying_ends_the_stream_with_an_error_and_the_server_exits_1():
    srv = RunningServer({**ENV, "ENGINE_PROCESS": "true"})
    try:
        (core_pid,) = child_pids(srv.proc.pid)
        body = {"inputs": "In the beginning", "parameters": {"max_new_tokens": 900}}
        events = []
        with httpx.stream("POST", srv.url + "/generate_stream", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    if len(events) == 2:
                        os.kill(core_pid, signal.SIGKILL)
        assert events[-1].get("error") == "the engine core process was killed by signal 9", events[-1]
        assert srv.proc.wait(30) == 1
        out = srv.proc.stdout.read()
        assert "kvserve: cannot serve: the engine core process was killed by signal 9" in out
    finally:
        srv.stop()


def test_zz_health_is_503_once_the_core_is_gone():
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.config import Settings

    app = create_app(Settings(model_id=str(MODEL_DIR), kv_backends="full", engine_process=True, log_level="warning"),
                     load_in_background=False)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        state = app.state.kvserve
        os.kill(state.core.host.proc.pid, signal.SIGKILL)
        deadline = time.time() + 10
        while state.load_error is None and time.time() < deadline:
            time.sleep(0.05)
        r = client.get("/health")
        assert r.status_code == 503 and "the engine core process was killed by signal 9" in r.text


def test_the_pages_routes_are_the_same_in_both(thread, process):
    body = {"prompt": "And God said", "kv_backend": "full", "max_new_tokens": 10}
    a = httpx.post(thread.url + "/ui/api/generate", json=body, timeout=60)
    b = httpx.post(process.url + "/ui/api/generate", json=body, timeout=60)
    assert a.status_code == b.status_code == 200, b.text
    timing = ("ttft_s", "tpot_s", "e2e_s", "latency_s")
    a, b = ({k: v for k, v in r.json().items() if k not in timing and not k.endswith("_s")} for r in (a, b))
    assert without_times(b) == without_times(a) and b["kv_peak_bytes"] > 0
    sums = [httpx.get(srv.url + "/ui/api/sums", params={"seq_len": 4096, "batch": 8}, timeout=10).json()
            for srv in (thread, process)]
    assert sums[0] == sums[1]
    defaults = [httpx.get(srv.url + "/ui/api/defaults", timeout=10).json() for srv in (thread, process)]
    assert defaults[0] == defaults[1] and defaults[0]["presets"][0]["tokens"] == 110


def test_info_is_the_same_in_both(thread, process):
    a, b = httpx.get(thread.url + "/info", timeout=10).json(), httpx.get(process.url + "/info", timeout=10).json()
    assert b == a


def counters_and_gauges(srv) -> dict[str, float]:
    """The scrape less what depends on timing (histograms' buckets and sums) and on the process (``process_``)."""
    return {k: v for k, v in srv.metrics().items() if k.startswith("kvserve_") and "_bucket" not in k
            and "_sum" not in k and "_created" not in k}


def settled(srv, predicate) -> dict[str, float]:
    deadline = time.time() + 10
    while not predicate(got := counters_and_gauges(srv)) and time.time() < deadline:
        time.sleep(0.1)
    return got


def test_metrics_are_the_same_in_both(thread, process):  # after the same requests on both
    a, b = counters_and_gauges(thread), counters_and_gauges(process)
    assert a["kvserve_requests_total" + '{backend="full",finish_reason="length",model="%s"}' % MODEL_DIR] >= 4
    assert {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == {}


def test_a_departed_client_is_counted_cancelled_and_its_kv_freed(process):
    label = '{backend="full",model="%s"}' % MODEL_DIR
    cancelled = "kvserve_requests_total" + '{backend="full",finish_reason="cancelled",model="%s"}' % MODEL_DIR
    before = counters_and_gauges(process)
    with httpx.stream("POST", process.url + "/generate_stream", timeout=60,
                      json={"inputs": "And God said", "parameters": {"max_new_tokens": 900}}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                assert counters_and_gauges(process)["kvserve_kv_cache_bytes" + label] > 0
                break
    after = settled(process, lambda m: m[cancelled] > before[cancelled])
    assert after[cancelled] == before[cancelled] + 1
    assert after["kvserve_kv_cache_bytes" + label] == 0 and after["kvserve_requests_running" + label] == 0
    assert after["kvserve_generation_tokens_total" + label] - before["kvserve_generation_tokens_total" + label] < 300
