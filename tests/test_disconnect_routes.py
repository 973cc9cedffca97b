"""README: "a client that disconnects is dropped from the batch at the next decode step and its KV is
freed at once" — on every generation route, streaming or not.

Each case asks for 500 tokens and gives up after about 0.3 s (far fewer tokens than that on any machine
this runs on); the request must end ``cancelled`` (not ``length``), generate fewer than 500 tokens, and
leave no KV behind.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import MODEL_DIR

PROMPT = "And the LORD spake unto Moses, saying"
LABELS = '{backend="full",model="%s"}' % MODEL_DIR
TGI = {"inputs": PROMPT, "parameters": {"max_new_tokens": 500}}
COMPLETION = {"prompt": PROMPT, "max_tokens": 500, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 500, "temperature": 0}
CASES = [
    ("/generate", TGI),
    ("/generate", {**TGI, "stream": True}),
    ("/", TGI),
    ("/", {**TGI, "stream": True}),
    ("/generate_stream", TGI),
    ("/v1/completions", COMPLETION),
    ("/v1/completions", {**COMPLETION, "stream": True}),
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
]


def _finished(metrics: dict, reason: str) -> float:
    return metrics.get('kvserve_requests_total{backend="full",finish_reason="%s",model="%s"}'
                       % (reason, MODEL_DIR), 0.0)


def give_up_after(url: str, body: dict, seconds: float = 0.3) -> None:
    """Send ``body``, read whatever comes for ``seconds``, then close the connection."""
    start = time.monotonic()
    try:
        with httpx.stream("POST", url, json=body, timeout=httpx.Timeout(30, read=seconds)) as r:
            assert r.status_code == 200
            for _ in r.iter_bytes():
                if time.monotonic() - start > seconds:
                    return
    except httpx.ReadTimeout:
        return
    raise AssertionError("the response ended before the client gave up")


def _settled(server, before: dict, timeout: float = 30.0) -> dict:
    """Metrics once the request has ended (counted under any finish reason) and the batch is empty."""
    reasons = ("cancelled", "length", "eos_token", "stop_sequence", "error")
    deadline = time.time() + timeout
    while time.time() < deadline:
        now = server.metrics()
        ended = sum(_finished(now, r) - _finished(before, r) for r in reasons)
        if ended >= 1 and now["kvserve_requests_running" + LABELS] == 0:
            return now
        time.sleep(0.05)
    raise AssertionError("the request did not end")


@pytest.mark.parametrize("path,body", CASES, ids=[f"{p} stream={b.get('stream', p == '/generate_stream')}"
                                                    for p, b in CASES])
def test_departed_client_is_cancelled_and_its_kv_freed(server, path, body):
    before = server.metrics()
    give_up_after(server.url + path, body)
    after = _settled(server, before)
    assert _finished(after, "cancelled") - _finished(before, "cancelled") == 1
    assert _finished(after, "length") == _finished(before, "length")
    generated = (after["kvserve_generation_tokens_total" + LABELS]
                 - before.get("kvserve_generation_tokens_total" + LABELS, 0.0))
    assert generated < 500
    assert after["kvserve_kv_cache_bytes" + LABELS] == 0
