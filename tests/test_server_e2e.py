"""End to end: a real `kvserve serve` process on 127.0.0.1, streamed requests, scraped metrics."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.conftest import MODEL_DIR

LABELS = '{backend="full",model="%s"}' % MODEL_DIR


def _m(server, name, labels=LABELS):
    return server.metrics().get(name + labels, 0.0)


def _labels_with(extra: str) -> str:
    """LABELS plus one more label, in the sorted order the scraper uses."""
    key, value = extra.split("=", 1)
    return '{backend="full",%s=%s,model="%s"}' % (key, value, MODEL_DIR)


def stream_events(server, body, path="/generate_stream"):
    events = []
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    return events


def test_health_and_info(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    info = httpx.get(server.url + "/info").json()
    assert info["kv_backend"] == "full" and info["model_id"] == str(MODEL_DIR)
    assert info["num_key_value_heads"] == info["num_attention_heads"] == 8
    assert info["max_total_tokens"] == 1024 and info["version"]
    from cache_backends import kernels

    # what attends over the pool, as this machine allows (the server's default, KV_ATTENTION=auto)
    assert info["kv_attention"] == kernels.status("cpu")


def test_stream_tgi_format_and_metrics_move(server):
    before = server.metrics()
    body = {"inputs": "And God said", "parameters": {"max_new_tokens": 12}}
    events = stream_events(server, body)
    assert len(events) == 12
    for i, ev in enumerate(events):
        assert ev["index"] == i
        assert set(ev["token"]) == {"id", "text", "logprob", "special"}
    assert all(ev["generated_text"] is None and ev["details"] is None for ev in events[:-1])
    last = events[-1]
    assert last["generated_text"] == "".join(ev["token"]["text"] for ev in events)
    d = last["details"]
    assert d["finish_reason"] == "length" and d["generated_tokens"] == 12 and d["seed"] is None
    prompt_len = d["input_length"]
    assert prompt_len == 3

    after = server.metrics()
    delta = lambda name, labels=LABELS: after.get(name + labels, 0) - before.get(name + labels, 0)  # noqa: E731
    assert delta("kvserve_requests_total", _labels_with('finish_reason="length"')) == 1
    assert delta("kvserve_generation_tokens_total") == 12
    assert delta("kvserve_prompt_tokens_total") == prompt_len
    assert delta("kvserve_time_to_first_token_seconds_count") == 1
    assert delta("kvserve_time_per_output_token_seconds_count") == 1
    assert delta("kvserve_inter_token_latency_seconds_count") == 11
    assert delta("kvserve_e2e_request_latency_seconds_count") == 1
    assert delta("kvserve_request_queue_time_seconds_count") == 1
    assert delta("kvserve_request_kv_cache_bytes_count") == 1
    # the request's largest KV: (prompt + generated - 1) tokens cached x 16 KiB per token (8 layers, fp32)
    assert delta("kvserve_request_kv_cache_bytes_sum") == (prompt_len + 12 - 1) * 16384
    assert after["kvserve_kv_cache_bytes" + LABELS] == 0
    assert after["kvserve_requests_running" + LABELS] == 0


def test_generate_non_stream_details_and_full_text(server):
    body = {"inputs": "In the beginning", "parameters": {"max_new_tokens": 8, "details": True,
                                                        "decoder_input_details": True}}
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200
    out = r.json()
    d = out["details"]
    assert d["finish_reason"] == "length" and d["generated_tokens"] == 8 and len(d["tokens"]) == 8
    assert out["generated_text"] == "".join(t["text"] for t in d["tokens"])
    assert [p["id"] for p in d["prefill"]] and d["prefill"][0]["logprob"] is None
    assert all(p["logprob"] <= 0 for p in d["prefill"][1:])
    body["parameters"]["return_full_text"] = True
    full = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    assert full["generated_text"] == "In the beginning" + out["generated_text"]
    # "stream": true on /generate answers with the event stream
    events = stream_events(server, {**body, "stream": True}, path="/generate")
    assert events[-1]["details"]["finish_reason"] == "length"


def test_seeded_sampling_reproduces_and_reports_seed(server):
    body = {"inputs": "The LORD", "parameters": {"max_new_tokens": 10, "do_sample": True, "seed": 77,
                                                "temperature": 0.8, "top_p": 0.9, "details": True}}
    a = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    b = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    assert a["generated_text"] == b["generated_text"] and a["details"]["seed"] == 77


def test_stop_sequence_is_not_in_stream_or_result(server):
    plain = httpx.post(server.url + "/generate", json={"inputs": "And God said",
                                                       "parameters": {"max_new_tokens": 30}}, timeout=60).json()
    text = plain["generated_text"]
    stop = text[6:10]
    events = stream_events(server, {"inputs": "And God said", "parameters": {"max_new_tokens": 30, "stop": [stop]}})
    streamed = "".join(ev["token"]["text"] for ev in events)
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"
    assert streamed == events[-1]["generated_text"] == text[: text.index(stop)]
    assert stop not in streamed


def test_concurrent_streams_are_batched(server):
    """Several streams at once all complete, and the engine ran them in one batch."""
    results = {}

    def one(i):
        results[i] = stream_events(server, {"inputs": f"And the {i}", "parameters": {"max_new_tokens": 40}})

    peak = []
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while any(t.is_alive() for t in threads) and time.time() < deadline:
        peak.append(_m(server, "kvserve_requests_running"))
        time.sleep(0.05)
    for t in threads:
        t.join(60)
    assert all(len(results[i]) == 40 for i in range(4))
    assert max(peak) >= 2


def test_invalid_requests_get_json_422(server):
    cases = [
        {},
        {"inputs": ""},
        {"inputs": 5},
        {"inputs": "x", "parameters": {"max_new_tokens": 0}},
        {"inputs": "x", "parameters": {"temperature": -1}},
        {"inputs": "x", "parameters": {"top_p": 1.5}},
        {"inputs": "x", "parameters": {"max_new_tokens": 5000}},
    ]
    for body in cases:
        r = httpx.post(server.url + "/generate", json=body, timeout=10)
        assert r.status_code == 422, (body, r.text)
        assert set(r.json()) == {"error", "error_type"}
    r = httpx.post(server.url + "/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert httpx.get(server.url + "/health").status_code == 200


def test_prefix_cache_hits_show_in_info_and_metrics(server):
    """A prompt sent twice: the second prefills only past its cached blocks, answers the same, and the prefix
    cache's counters (tokens), its config gauge and /info say so."""
    info = httpx.get(server.url + "/info").json()
    block = info["block_size_tokens"]["full"]
    assert info["prefix_caching"] is True and block > 0
    config = [k for k in server.metrics() if k.startswith("kvserve_cache_config_info{") and 'backend="full"' in k]
    assert config == ['kvserve_cache_config_info{backend="full",block_size="%d",model="%s",num_blocks="%d",'
                      'num_gpu_blocks="%d",prefix_caching="true"}' % (block, MODEL_DIR, info["num_blocks"],
                                                                      info["num_blocks"])]
    prompt = "Prefix cache: " + " ".join(["And the LORD spake unto Moses, saying,"] * 12)  # sent by no other test
    before = server.metrics()
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 4, "details": True}}
    first, second = (httpx.post(server.url + "/generate", json=body, timeout=60).json() for _ in range(2))
    assert first["generated_text"] == second["generated_text"]
    after = server.metrics()
    delta = lambda name: after.get(name + LABELS, 0) - before.get(name + LABELS, 0)  # noqa: E731
    n = delta("kvserve_prompt_tokens_total") / 2
    assert delta("kvserve_prefix_cache_queries_total") == 2 * n
    assert delta("kvserve_prefix_cache_hits_total") == (n - 1) // block * block > 0
