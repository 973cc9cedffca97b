"""KV_BACKENDS: a request picks its backend; two concurrent requests on different backends; metrics by backend."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import pytest

from tests.conftest import MODEL_DIR, REPO, server_with


multi = server_with({"KV_BACKEND": "full", "KV_BACKENDS": "full,int8,mla+int8", "KV_MLA_RANK": "128"})


def test_info_lists_the_served_backends(multi):
    info = httpx.get(multi.url + "/info").json()
    assert info["kv_backends"] == ["full", "int8", "mla+int8"]
    assert info["kv_backend_params"]["mla+int8"] == {"rank": 128, "group_size": 32, "residual": 32}


def test_info_kv_sizes_are_what_kvserve_estimate_prints(multi):
    """/info's bytes per token (at 1024 tokens, and at 128 and max_total_tokens) for each served backend are
    the rows `kvserve estimate` prints for the spec /info names."""
    info = httpx.get(multi.url + "/info").json()
    assert info["kv_estimate_spec"] == {"full": "full", "int8": "int8:group_size=32,residual=32",
                                        "mla+int8": "mla+int8:rank=128,rope_dim=0,group_size=32,residual=32"}
    out = subprocess.run([sys.executable, "-m", "server.cli", "estimate", "--model", str(MODEL_DIR), "--dtype",
                          "float32", "--seq-len", "128,1024", "--batch", "1", "--json",
                          *info["kv_estimate_spec"].values()], cwd=REPO, capture_output=True, text=True, check=True,
                         timeout=120).stdout
    rows = json.loads(out)
    for name, (short, long) in zip(info["kv_backends"], zip(rows[::2], rows[1::2])):
        layers = info["num_layers"]
        assert info["kv_bytes_per_token_by_seq_len"][name] == {"128": short["bytes_per_token_per_layer"] * layers,
                                                               "1024": long["bytes_per_token_per_layer"] * layers}
        assert info["kv_bytes_per_token"][name] == long["bytes_per_token_per_layer"] * layers
    assert info["kv_bytes_per_token"]["int8"] == 5472 < info["kv_bytes_per_token_by_seq_len"]["int8"]["128"]


def test_two_concurrent_requests_on_different_backends(multi):
    before = multi.metrics()
    out = {}

    def go(backend):
        out[backend] = httpx.post(multi.url + "/generate", json={"inputs": "And God said", "parameters": {
            "max_new_tokens": 40, "kv_backend": backend, "details": True}}, timeout=120)

    threads = [threading.Thread(target=go, args=(b,)) for b in ("full", "int8")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out["full"].status_code == out["int8"].status_code == 200
    after = multi.metrics()
    for backend in ("full", "int8"):
        key = 'kvserve_requests_total{backend="%s",finish_reason="length",model="%s"}' % (backend, MODEL_DIR)
        assert after[key] - before.get(key, 0) == 1
    # int8 at 43 tokens holds everything in its residual window + one group: less than full only past that
    peak = 'kvserve_request_kv_cache_bytes_sum{backend="%s",model="%s"}'
    assert after[peak % ("int8", MODEL_DIR)] > 0 and after[peak % ("full", MODEL_DIR)] > 0


def test_openai_extra_body_selects_the_backend(multi):
    from openai import OpenAI

    client = OpenAI(base_url=multi.url + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(model="kjv-llama-mha", prompt="In the beginning", max_tokens=5, temperature=0,
                                    extra_body={"kv_backend": "mla+int8"})
    assert out.usage.completion_tokens == 5
    import openai

    with pytest.raises(openai.BadRequestError, match="allowed: full, int8, mla\\+int8"):
        client.completions.create(model="kjv-llama-mha", prompt="x", max_tokens=2, extra_body={"kv_backend": "gqa"})


def test_unlisted_backend_is_422_naming_the_allowed(multi):
    r = httpx.post(multi.url + "/generate", json={"inputs": "a", "parameters": {"kv_backend": "dca"}})
    assert r.status_code == 422 and "allowed: full, int8, mla+int8" in r.json()["error"]
    assert "named alone" not in r.json()["error"]


@pytest.mark.parametrize("spec", ["int8:group_size=64", "mla+int8:rank=0"])
def test_a_served_backend_with_options_is_told_to_come_alone(multi, spec):
    """A request that gives a served backend options (``int8:group_size=64``) is refused saying a request names the
    backend alone and where its options come from, not merely that the string is not served."""
    r = httpx.post(multi.url + "/generate", json={"inputs": "a", "parameters": {"kv_backend": spec}})
    error = r.json()["error"]
    base = spec.partition(":")[0]
    assert r.status_code == 422 and f"names a served backend alone, e.g. {base!r}" in error, error
    assert "kv_backend_params" in error


four_bit = server_with({"KV_BACKEND": "int4", "KV_BACKENDS": "full,int8", "KV_INT4_ROTATE": "true",
                        "KV_INT8_VALUE_BITS": "4"})


def test_int4_and_k8v4_are_served_from_their_settings(four_bit):
    """KV_BACKEND=int4 with KV_INT4_ROTATE, and int8 made k8v4 by KV_INT8_VALUE_BITS: /info names the options and
    the sums kvserve estimate prints for them, and requests on each decode through the pool."""
    info = httpx.get(four_bit.url + "/info").json()
    assert info["kv_backend_params"]["int4"] == {"group_size": 32, "residual": 32, "rotate": True}
    assert info["kv_backend_params"]["int8"] == {"group_size": 32, "residual": 32, "value_bits": 4}
    assert info["kv_estimate_spec"]["int4"] == "int4:group_size=32,residual=32"  # rotation costs no byte
    assert info["kv_estimate_spec"]["int8"] == "int8:group_size=32,residual=32,value_bits=4"
    assert info["kv_bytes_per_token"]["int4"] == 2992 and info["kv_bytes_per_token"]["int8"] == 4232
    for backend in ("int4", "int8", "full"):
        r = httpx.post(four_bit.url + "/generate", json={"inputs": " ".join(["And God said"] * 30), "parameters": {
            "max_new_tokens": 40, "kv_backend": backend}}, timeout=120)
        assert r.status_code == 200 and r.json()["generated_text"], (backend, r.text)
