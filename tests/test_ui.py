"""The built-in page's routes over HTTP (the browser tests are in tests/test_ui_browser.py): the page and its
assets are served from the package, ``POST /`` stays TGI's, the JSON routes answer the request's own KV bytes
and latencies, the live counters and ``kvserve estimate``'s sums, and with ``API_KEY`` set nothing but the
static page is reachable without the key."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from cache_backends.estimate import DTYPE_BYTES, Shape, estimate_rows
from tests.closed_forms import int8_bytes_per_token_per_layer
from server.api.ui import ASSETS, ASSET_TYPES, PUBLIC_PATHS, context_warnings
from server.api.ui_compression import uncompressed_reason
from server.estimate_cli import resolve_specs
from tests.conftest import MODEL_DIR, server_with

server = server_with({"KV_BACKEND": "full", "KV_BACKENDS": "full,int8,elastic"})
keyed = server_with({"KV_BACKEND": "full", "API_KEY": "s3cret"})
single = server_with({"KV_BACKEND": "full", "MAX_CONCURRENT_REQUESTS": "1"})

CFG = json.loads((MODEL_DIR / "config.json").read_text())
LAYERS, HEADS = CFG["num_hidden_layers"], CFG.get("num_key_value_heads") or CFG["num_attention_heads"]
HEAD_DIM = CFG.get("head_dim") or CFG["hidden_size"] // CFG["num_attention_heads"]


def test_page_and_assets_are_served_from_the_package(server):
    for path in ("/", "/ui"):
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "/ui/assets/app.js" in r.text and "http" not in r.text.replace("http-equiv", "")  # nothing external
    for name, media in ASSET_TYPES.items():
        r = httpx.get(f"{server.url}/ui/assets/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(media)
        assert r.content == (ASSETS / name).read_bytes()
    assert httpx.get(server.url + "/ui/assets/..%2Fui.py").status_code == 404
    assert httpx.get(server.url + "/ui/assets/nope.js").status_code == 404


def test_head_answers_as_get(server):
    """Uptime checks and link checkers send HEAD: 200 with GET's headers and no body (it was 405)."""
    for path in ("/", "/ui", "/ui/assets/app.js"):
        got, head = httpx.get(server.url + path), httpx.head(server.url + path)
        assert head.status_code == 200 and head.content == b"", path
        assert head.headers["content-type"] == got.headers["content-type"], path


def test_post_root_stays_tgi(server):
    r = httpx.post(server.url + "/", json={"inputs": "And God said", "parameters": {"max_new_tokens": 3}}, timeout=60)
    assert r.status_code == 200 and isinstance(r.json(), list) and "generated_text" in r.json()[0]


def _generate(server, **body):
    return httpx.post(server.url + "/ui/api/generate", json={"prompt": "And God said", **body}, timeout=120)


@pytest.mark.parametrize("backend", ["full", "int8"])
def test_generate_reports_the_requests_own_kv_bytes_and_latencies(server, backend):
    r = _generate(server, kv_backend=backend, max_new_tokens=80, repetition_penalty=1.3)
    assert r.status_code == 200, r.text
    out = r.json()
    n = len(out["tokens"])
    assert out["kv_backend"] == backend and n == 80 and out["finish_reason"] == "length"
    assert out["text"] == "".join(t["text"] for t in out["tokens"])
    # the text is what /generate answers for the same request (greedy)
    tgi = {"inputs": "And God said", "parameters": {"max_new_tokens": 80, "repetition_penalty": 1.3,
                                                    "kv_backend": backend}}
    assert httpx.post(server.url + "/generate", json=tgi, timeout=120).json()["generated_text"] == out["text"]
    cached = out["prompt_tokens"] + n - 1  # the last token is never fed back
    if backend == "full":
        assert out["kv_peak_bytes"] == 2 * HEADS * HEAD_DIM * 4 * LAYERS * cached
    else:  # int8's peak: its largest size over the generation (its window drains at 64 tokens)
        sizes = [int8_bytes_per_token_per_layer(HEADS, HEAD_DIM, 4, 32, 32, t) * t * LAYERS
                 for t in range(out["prompt_tokens"], cached + 1)]
        assert out["kv_peak_bytes"] == pytest.approx(max(sizes))
    # full's bytes for the same tokens; 82 cached tokens are past int8's 64 exact ones: no reason to give
    assert out["kv_full_peak_bytes"] == 2 * HEADS * HEAD_DIM * 4 * LAYERS * cached
    assert out["kv_uncompressed_reason"] is None
    assert (out["kv_peak_bytes"] < out["kv_full_peak_bytes"]) == (backend == "int8")
    assert out["kv_bytes_per_token"] > 0
    assert 0 < out["ttft_s"] < 60 and 0 < out["tpot_s"] < 5


@pytest.mark.parametrize("backend,words", [
    ("int8", "all 7 tokens within the 32 newest tokens kept exact and the group of 32 forming before them: int8 "
             "quantizes from 64 tokens on"),
    ("elastic", "the KV pool had room: elastic keeps all 7 tokens exact")])
def test_generate_says_why_a_short_request_is_not_compressed(server, backend, words):
    out = _generate(server, kv_backend=backend, max_new_tokens=5).json()
    assert out["kv_peak_bytes"] == out["kv_full_peak_bytes"] == 16384 * 7  # 3 prompt tokens + 4 fed back
    assert out["kv_uncompressed_reason"].startswith(words)


def test_uncompressed_reasons_in_words():
    assert uncompressed_reason(("dca", {"reuse_fraction": 0.5, "window": 32}), 40) == (
        "all 40 tokens within the newest 32-63 tokens each reuse layer keeps itself: dca saves from 64 tokens on")
    assert "fell back" in uncompressed_reason(("dca", {"reuse_fraction": 0.5, "window": 32}), 200)
    assert "no layer to reuse" in uncompressed_reason(("dca+int8", {"reuse_fraction": 0.0, "window": 32}), 200)
    assert "int4 quantizes from 80 tokens on" in uncompressed_reason(
        ("gqa+int4", {"groups": 2, "group_size": 16, "residual": 64}), 70)


GENESIS = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
           "darkness was upon the face of the deep.")


def test_generate_runs_prefill_their_whole_prompt(server):
    """Repeated runs time the same work: no run takes the blocks of the one before from the prefix cache."""
    key = f'kvserve_prefix_cache_hits_total{{backend="full",model="{MODEL_DIR}"}}'  # the served name: MODEL_ID
    before = server.metrics().get(key, 0)
    a, b = (_generate(server, prompt=GENESIS, kv_backend="full", max_new_tokens=2).json() for _ in "ab")
    assert a["prompt_tokens"] > 32 and a["tokens"] == b["tokens"]
    assert server.metrics().get(key, 0) == before
    # /generate still caches and hits as before
    tgi = {"inputs": GENESIS, "parameters": {"max_new_tokens": 2}}
    for _ in "ab":
        httpx.post(server.url + "/generate", json=tgi, timeout=60)
    assert server.metrics()[key] > before


def test_generate_seeded_sampling_repeats(server):
    a, b = (_generate(server, kv_backend="full", max_new_tokens=12, seed=7, temperature=1.0).json() for _ in "ab")
    assert a["tokens"] == b["tokens"]


NOT_SERVED = "not served here; allowed: full, int8, elastic (a server started with KV_BACKENDS=... serves more)"


@pytest.mark.parametrize("body,words", [({"kv_backend": "mla"}, NOT_SERVED),
                                        ({"kv_backend": "full", "max_new_tokens": 100000}, "must be <="),
                                        ({"kv_backend": "full", "prompt": ""}, "prompt"),
                                        ({"kv_backend": "full", "bogus": 1}, "bogus")])
def test_generate_errors_are_readable(server, body, words):
    r = _generate(server, **body)
    assert r.status_code == 422 and words in r.json()["error"]


def test_live_counts_by_backend(server):
    live = httpx.get(server.url + "/ui/api/live").json()
    assert set(live["backends"]) == {"full", "int8", "elastic"} and live["kv_cache_budget_bytes"] is None
    row = live["backends"]["full"]
    assert set(row) == {"running", "waiting", "kv_bytes", "kv_used_bytes", "kv_tokens", "generated_tokens",
                        "requests"}
    before = row["generated_tokens"]
    _generate(server, kv_backend="full", max_new_tokens=5)
    after = httpx.get(server.url + "/ui/api/live").json()
    assert after["backends"]["full"]["generated_tokens"] == before + 5 and after["time"] > live["time"]
    assert after["backends"]["full"]["running"] == 0 and after["backends"]["full"]["kv_bytes"] == 0


def test_sums_are_kvserve_estimates_for_the_served_model(server):
    sums = httpx.get(server.url + "/ui/api/sums", params={"seq_len": 4096, "batch": 8}).json()
    shape = Shape.from_config(CFG)
    want = estimate_rows(shape, resolve_specs(shape, None, DTYPE_BYTES["float32"]), [4096], [8], 4)
    got = {(r["backend"], json.dumps(r["params"], sort_keys=True)): r for r in sums["rows"]}
    for row in want:
        assert got[(row["backend"], json.dumps(row["params"], sort_keys=True))]["total_bytes"] == row["total_bytes"]
    full = next(r for r in sums["rows"] if r["backend"] == "full")
    assert full["bytes_per_token"] == 2 * HEADS * HEAD_DIM * 4 * LAYERS and full["served_as"] == ["full"]
    int8 = [r for r in sums["rows"] if r["backend"] == "int8"]
    assert [(r["aka"], r["served_as"]) for r in int8] == [(None, ["int8"]), ("k8v4", [])]
    assert int8[1]["params"]["value_bits"] == 4
    # every backend the server knows, not only the estimator's defaults; elastic as a range
    assert {r["backend"] for r in sums["rows"]} >= {"full", "gqa", "mla", "int8", "int4", "dca", "elastic",
                                                    "gqa+int4", "dca+int8"}
    elastic = next(r for r in sums["rows"] if r["backend"] == "elastic")
    assert elastic["served_as"] == ["elastic"] and elastic["min_total_bytes"] < elastic["total_bytes"]
    assert sums["rows"][0]["backend"] == "full"
    assert sums["max_position_embeddings"] == CFG["max_position_embeddings"] == 1024
    assert "4,096 tokens is more than this model's 1,024 positions" in sums["warnings"][0]
    assert httpx.get(server.url + "/ui/api/sums", params={"seq_len": 0}).status_code == 422


def test_sums_warn_past_the_models_positions(server):
    sums = httpx.get(server.url + "/ui/api/sums", params={"seq_len": 32768}).json()
    assert sums["warnings"] == ["32,768 tokens is more than this model's 1,024 positions (max_position_embeddings): "
                                "it cannot hold that context; the sums show what the cache would cost if it could."]
    assert httpx.get(server.url + "/ui/api/sums", params={"seq_len": 1024}).json()["warnings"] == []
    assert context_warnings(900, 1024, 512) == [
        "900 tokens is more than this server serves in one sequence (MAX_TOTAL_TOKENS = 512)."]
    assert context_warnings(512, 1024, 512) == []


def test_api_key_guards_everything_but_the_static_page(keyed):
    assert set(PUBLIC_PATHS) >= {"/", "/ui"}
    for path in PUBLIC_PATHS:
        assert httpx.get(keyed.url + path).status_code == 200, path
    for method, path in [("GET", "/ui/api/live"), ("GET", "/ui/api/sums"), ("POST", "/ui/api/generate"),
                         ("GET", "/info"), ("POST", "/"), ("POST", "/generate")]:
        r = httpx.request(method, keyed.url + path, json={"inputs": "x", "prompt": "x", "kv_backend": "full"})
        assert r.status_code == 401, (method, path)
    auth = {"Authorization": "Bearer s3cret"}
    assert httpx.get(keyed.url + "/ui/api/live", headers=auth).status_code == 200
    assert httpx.post(keyed.url + "/ui/api/generate", headers=auth, timeout=60,
                      json={"prompt": "And", "kv_backend": "full", "max_new_tokens": 2}).status_code == 200


def test_generate_counts_against_max_concurrent_requests(single):
    """MAX_CONCURRENT_REQUESTS=1: while a stream runs, the page's route is 429 as /generate is (40 calls were all
    200 while /generate answered 429); and a page run holds the slot in turn."""
    body = {"inputs": "And God said", "parameters": {"max_new_tokens": 1000, "temperature": 0}}
    with httpx.stream("POST", single.url + "/generate_stream", json=body, timeout=120) as stream:
        lines = stream.iter_lines()  # kept: a closed line iterator closes the stream
        next(line for line in lines if line.startswith("data:"))  # the stream is running
        r = _generate(single, kv_backend="full", max_new_tokens=2)
        assert r.status_code == 429 and r.json()["error_type"] == "overloaded" and r.headers["retry-after"] == "1"
    one_token = {"inputs": "a", "parameters": {"max_new_tokens": 1}}
    while httpx.post(single.url + "/generate", json=one_token, timeout=60).status_code == 429:
        time.sleep(0.1)  # until the closed stream has ended
    page = {}

    def page_run():  # retried while one of the probes below holds the one slot
        while (r := _generate(single, kv_backend="full", max_new_tokens=300)).status_code == 429:
            time.sleep(0.05)
        page["r"] = r

    runner = threading.Thread(target=page_run)
    runner.start()
    held, deadline = False, time.monotonic() + 120
    while not held and runner.is_alive() and time.monotonic() < deadline:  # until the page's run is in flight
        held = httpx.post(single.url + "/generate", json=one_token, timeout=60).status_code == 429
        time.sleep(0.05)
    runner.join()
    assert held, "a page run never held the slot"
    assert page["r"].status_code == 200
