"""The built-in page's routes over HTTP (the browser tests are in tests/test_ui_browser.py): the page and its
assets are served from the package, ``POST /`` stays TGI's, the JSON routes answer the request's own KV bytes
and latencies (the prompt through the chat template when asked), the live counters, ``kvserve estimate``'s sums
with each served backend's price, and the page's defaults for the served model (chat questions for a chat
model); with ``API_KEY`` set nothing but the static page is reachable without the key."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from cache_backends.estimate import DTYPE_BYTES, Shape, estimate_rows
from tests.closed_forms import int8_bytes_per_token_per_layer
from server.api.ui import ASSETS, ASSET_TYPES, PUBLIC_PATHS, context_warnings, served_price
from server.api.ui_compression import uncompressed_reason
from server.api.ui_presets import CHAT_PRESETS, TEXT_PRESETS, page_defaults
from server.estimate_cli import resolve_specs
from server.model_fetch import DEFAULT_DIR, is_current
from tests.conftest import MODEL_DIR, server_with

server = server_with({"KV_BACKEND": "full", "KV_BACKENDS": "full,int8,elastic"})
keyed = server_with({"KV_BACKEND": "full", "API_KEY": "s3cret"})
single = server_with({"KV_BACKEND": "full", "MAX_CONCURRENT_REQUESTS": "1"})
# SmolLM2-135M-Instruct, a chat model (the quality budget off: nothing to price at start-up)
chat_server = server_with({"MODEL_ID": str(DEFAULT_DIR), "KV_BACKEND": "full", "KV_BACKENDS": "full,int8",
                           "KV_QUALITY_BUDGET": "off"})

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


def test_generate_applies_the_chat_template_when_asked(server):
    """``chat``: the prompt as one user turn through the tokenizer's template (the reference model's plain one), as
    /v1/chat/completions sends it; the answer names the text the model was given."""
    plain = _generate(server, kv_backend="full", max_new_tokens=4).json()
    assert plain["prompt_text"] == "And God said" and plain["prompt_tokens"] == 3
    chat = _generate(server, kv_backend="full", max_new_tokens=4, chat=True).json()
    assert chat["prompt_text"] == "User: And God said\nAssistant:" and chat["prompt_tokens"] > 3
    body = {"model": str(MODEL_DIR), "messages": [{"role": "user", "content": "And God said"}], "max_tokens": 4,
            "temperature": 0}
    openai = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert chat["text"] == openai["choices"][0]["message"]["content"]
    assert chat["prompt_tokens"] == openai["usage"]["prompt_tokens"]


def test_defaults_give_the_reference_model_text_to_continue(server):
    """The reference model was trained on plain text: Genesis to continue, the penalty that keeps its greedy text
    from looping, and the chat switch offered (its tokenizer has a plain template) but off."""
    got = httpx.get(server.url + "/ui/api/defaults").json()
    assert got["chat_template"] is True and got["chat"] is False and got["repetition_penalty"] == 1.3
    assert [p["prompt"] for p in got["presets"]] == [prompt for _, prompt in TEXT_PRESETS]
    assert got["presets"][0]["prompt"].startswith("In the beginning") and got["presets"][0]["tokens"] == 110
    assert got["presets"][1]["tokens"] == 3


def test_defaults_follow_the_tokenizers_chat_template():
    """A template that marks turns with a special token is a chat model's: chat questions through it, a neutral
    penalty; no template: no switch."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    tok.chat_template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}{% endfor %}"
                         "<|endoftext|>assistant:")
    chat = page_defaults(tok)
    assert chat["chat"] and chat["chat_template"] and chat["repetition_penalty"] == 1.0
    assert [p["prompt"] for p in chat["presets"]] == [prompt for _, prompt in CHAT_PRESETS]
    turn = f"<|endoftext|>user\n{CHAT_PRESETS[0][1]}<|endoftext|>assistant:"
    assert chat["presets"][0]["tokens"] == len(tok(turn, add_special_tokens=False)["input_ids"])
    tok.chat_template = None
    plain = page_defaults(tok)
    assert not plain["chat"] and not plain["chat_template"] and plain["repetition_penalty"] == 1.3


def test_generate_refuses_chat_without_a_template(server, monkeypatch):
    """``chat`` on a model whose tokenizer has no template is a 422 naming it (checked in-process: every shipped
    model has one)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from server.api.ui import router
    from server.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)
    app.include_router(router)
    tokenizer = type("NoTemplate", (), {"chat_template": None})()
    monkeypatch.setattr("server.api.ui.get_service", lambda request: type("S", (), {"tokenizer": tokenizer})())
    r = TestClient(app).post("/ui/api/generate", json={"prompt": "x", "kv_backend": "full", "chat": True})
    assert r.status_code == 422 and "no chat template" in r.json()["error"]


@pytest.mark.real_model
def test_a_chat_model_answers_a_question_only_as_a_chat_turn(chat_server):
    """SmolLM2-135M-Instruct: sent raw, a question gets end-of-text at once (what the page said "100.0%, 1 of 1
    tokens" about); as a chat turn, an answer. The page's defaults for it: chat questions, on, penalty 1.0."""
    got = httpx.get(chat_server.url + "/ui/api/defaults").json()
    assert got["chat"] and got["repetition_penalty"] == 1.0
    assert [p["prompt"] for p in got["presets"]] == [prompt for _, prompt in CHAT_PRESETS]
    question = {"prompt": CHAT_PRESETS[2][1], "kv_backend": "full", "max_new_tokens": 16}
    raw = httpx.post(chat_server.url + "/ui/api/generate", json=question, timeout=120).json()
    assert raw["finish_reason"] == "eos_token" and len(raw["tokens"]) == 1 and raw["text"] == ""
    chat = httpx.post(chat_server.url + "/ui/api/generate", json={**question, "chat": True}, timeout=120).json()
    assert "Paris" in chat["text"] and chat["prompt_text"].startswith("<|im_start|>")
    assert chat["prompt_tokens"] == got["presets"][2]["tokens"]


OPTIONAL = {"max_new_tokens": 32, "seed": None, "temperature": 1.0, "repetition_penalty": 1.0, "chat": False}


def test_null_is_the_default_for_every_optional_generate_field():
    """``null`` for an optional field of the page's body is its default, as OpenAI's and TGI's clients send an
    unset field; the required ones still refuse it."""
    from pydantic import ValidationError

    from server.api.ui import UIGenerateRequest

    fields = {n for n, f in UIGenerateRequest.model_fields.items() if not f.is_required()}
    assert fields == set(OPTIONAL)  # every optional field is covered here
    nulls = UIGenerateRequest.model_validate({"prompt": "x", "kv_backend": "full", **dict.fromkeys(OPTIONAL)})
    assert nulls == UIGenerateRequest(prompt="x", kv_backend="full") and nulls.model_dump(exclude={"prompt",
                                                                                                   "kv_backend"}) == OPTIONAL
    for required in ("prompt", "kv_backend"):
        with pytest.raises(ValidationError):
            UIGenerateRequest.model_validate({"prompt": "x", "kv_backend": "full", required: None})


def test_generate_reads_null_as_the_default(server):
    """``"chat": null`` (and every other optional field null) answers as the defaults do, not 422."""
    nulls = _generate(server, kv_backend="full", **dict.fromkeys(OPTIONAL))
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["text"] == _generate(server, kv_backend="full").json()["text"]
    assert _generate(server, kv_backend="full", max_new_tokens=3, chat=None).status_code == 200
    r = _generate(server, kv_backend=None)
    assert r.status_code == 422 and "kv_backend" in r.json()["error"]


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


def test_sums_price_each_served_backend_from_the_quality_budget(server):
    """A served row carries the quality budget's price and top-1 agreement (/info's kv_quality), so a size never
    stands alone; full's are 0 and 1 (the reference), and the rows the server does not serve are not priced."""
    quality = httpx.get(server.url + "/info").json()["kv_quality"]
    rows = httpx.get(server.url + "/ui/api/sums").json()["rows"]
    by_served = {r["served_as"][0]: r for r in rows if r["served_as"]}
    for name in ("int8", "elastic"):
        assert by_served[name]["price"] == {"served_as": name,
                                            "ppl_increase_pct": quality[name]["price"]["ppl_increase_pct"],
                                            "agreement": quality[name]["price"]["agreement"],
                                            "within_budget": True, "budget_pct": 1.0, "min_agreement": None,
                                            "agreement_shortfall": None, "closest": False,
                                            "long_context_warning": None}
        assert 0.9 <= by_served[name]["price"]["agreement"] <= 1
    assert by_served["full"]["price"] == {"served_as": "full", "ppl_increase_pct": 0.0, "agreement": 1.0,
                                          "within_budget": True, "budget_pct": 1.0, "min_agreement": None,
                                          "agreement_shortfall": None, "closest": False,
                                          "long_context_warning": None}
    assert all(r["price"] is None for r in rows if not r["served_as"])


def test_served_price_carries_the_agreement_shortfall():
    """A price under KV_QUALITY_MIN_AGREEMENT carries /info's agreement_shortfall to the page, and ``closest`` when
    the search served the setting closest to the bound (none reached it) rather than an explicit setting."""
    explicit = {"price": {"ppl_increase_pct": 7.5, "agreement": 0.61}, "within_budget": False, "budget_pct": 1.0,
                "min_agreement": 0.9, "agreement_shortfall": 0.29, "searched": None, "explicit": False}
    assert served_price(["gqa"], {"gqa": explicit}) == {
        "served_as": "gqa", "ppl_increase_pct": 7.5, "agreement": 0.61, "within_budget": False, "budget_pct": 1.0,
        "min_agreement": 0.9, "agreement_shortfall": 0.29, "closest": False, "long_context_warning": None}
    searched = {**explicit, "searched": "groups"}
    assert served_price(["gqa"], {"gqa": searched})["closest"] is True
    assert served_price(["gqa"], {"gqa": {**searched, "explicit": True}})["closest"] is False
    within = {**searched, "within_budget": True, "agreement_shortfall": None, "price": {"ppl_increase_pct": 0.5,
                                                                                        "agreement": 0.95}}
    assert served_price(["gqa"], {"gqa": within})["agreement_shortfall"] is None
    assert served_price(["gqa"], {"gqa": within})["closest"] is False


def test_served_price_carries_the_long_context_warning():
    """A backend that loses on the long input what its short price cannot show (/info's long_context_warning)
    carries the warning to the page, within the budget or not; full never does."""
    said = "window: on a 8192-token input it finds 0% of the needles where full finds 75% (missed at depth 0.1)"
    window = {"price": {"ppl_increase_pct": 0.0, "agreement": 1.0}, "within_budget": True, "budget_pct": 1.0,
              "min_agreement": None, "agreement_shortfall": None, "searched": None, "explicit": False,
              "long_context_warning": said}
    assert served_price(["window"], {"window": window})["long_context_warning"] == said
    assert served_price(["full"], {"full": {"budget_pct": 1.0, "min_agreement": None}})["long_context_warning"] is None


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
