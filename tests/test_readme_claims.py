"""README and docs statements checked against the code: the README Quickstart's example outputs are what the
server answers, the int8 size ratios (docs/backends.md, docs/benchmarks.md) are what the project's formula
gives, and the Metrics table (docs/metrics.md) lists exactly the metrics the server exports."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.closed_forms import full_bytes_per_token_per_layer, int8_bytes_per_token_per_layer
from server.metrics import Metrics, Recorder
from tests.conftest import MODEL_DIR, REPO, server_with

README = (REPO / "README.md").read_text()
DOCS = REPO / "docs"
plain = server_with({})  # the reference model


@pytest.fixture(scope="module")
def server(starts_server):
    """The Quickstart's server: `make serve`'s model, the real SmolLM2-135M-Instruct (fetched when missing)."""
    from server.model_fetch import DEFAULT_DIR, fetch, is_current
    from tests.conftest import RunningServer

    if not is_current(DEFAULT_DIR):
        fetch(DEFAULT_DIR)
    srv = RunningServer({"MODEL_ID": str(DEFAULT_DIR)})
    yield srv
    srv.stop()


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start: end if end != -1 else None]


# a ```bash block with one curl command, then the block that shows its output
EXAMPLE = re.compile(r"```bash\ncurl (?:-N )?http://127\.0\.0\.1:8000(?P<path>/\S*) [^\n]*\\\n\s+-d '(?P<body>[^']*)'\n```\n"
                     r"```\n(?P<output>.*?)\n```", re.S)


def quickstart_examples() -> list[tuple[str, dict, str]]:
    found = [(m["path"], json.loads(m["body"]), m["output"]) for m in EXAMPLE.finditer(section("Quickstart"))]
    assert len(found) == 2, "the Quickstart shows a /generate and a /generate_stream example with outputs"
    return found


@pytest.mark.real_model
def test_quickstart_generate_output_is_what_the_server_answers(server):
    path, body, output = quickstart_examples()[0]
    assert path == "/generate" and body["parameters"].get("do_sample") is not True  # greedy: reproducible
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200
    assert r.text == output


@pytest.mark.real_model
def test_quickstart_stream_output_is_what_the_server_sends(server):
    path, body, output = quickstart_examples()[1]
    assert path == "/generate_stream"
    shown = [json.loads(line.removeprefix("data: ")) for line in output.splitlines()]
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert len(shown) == 2 and len(events) == body["parameters"]["max_new_tokens"]
    for want, got in zip(shown, (events[0], events[-1])):
        # logprobs are floats from a CPU matmul: equal up to the last bits, not bit for bit
        assert got["token"].pop("logprob") == pytest.approx(want["token"].pop("logprob"), abs=1e-4)
        assert got == want
    assert events[-1]["generated_text"] == "".join(ev["token"]["text"] for ev in events)


def _ratio(dtype_bytes: int) -> float:
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    int8 = int8_bytes_per_token_per_layer(heads, head_dim, dtype_bytes, 32, 32, 1024)
    return int8 / full_bytes_per_token_per_layer(heads, head_dim, dtype_bytes)


def test_docs_int8_ratios_are_the_formulas():
    text = " ".join((DOCS / "backends.md").read_text().split())
    m = re.search(r"int8 at group size 32 on the bundled model holds (\d\.\d\d)x of `full` in fp32 "
                  r"\(the CPU default\) and (\d\.\d\d)x in fp16/bf16 at 1024 tokens", text)
    assert m, "docs/backends.md states int8's size against full at 1024 tokens"
    assert float(m[1]) == round(_ratio(4), 2) and float(m[2]) == round(_ratio(2), 2)
    text = " ".join((DOCS / "benchmarks.md").read_text().split())
    m = re.search(r"\((\d\.\d\d)x of `full`; in fp16/bf16 the same layout is (?:about )?(\d\.\d\d)x", text)
    assert m and float(m[1]) == round(_ratio(4), 2) and float(m[2]) == round(_ratio(2), 2)


def test_metrics_table_lists_exactly_the_exported_metrics():
    documented = set()
    metrics_page = (DOCS / "metrics.md").read_text()
    for cell in re.findall(r"^\| ((?:`kvserve_\w+`(?:, )?)+) \|", metrics_page, re.M):
        documented |= set(re.findall(r"`(kvserve_\w+)`", cell))
    metrics = Metrics()
    Recorder(metrics, "m", ["dca"])
    exported = set()
    for family in metrics.registry.collect():
        exported.add(family.name + ("_total" if family.type == "counter" else ""))
    assert documented == exported


STOP_PROMPT = "And God said, Let there be light: and there was light. And God"


@pytest.fixture(scope="module")
def free_text(plain):
    tgi = {"inputs": STOP_PROMPT, "parameters": {"max_new_tokens": 30}}
    return httpx.post(plain.url + "/generate", json=tgi, timeout=120).json()["generated_text"]


@pytest.mark.parametrize("stop", [["e", "h"], ["h", "e"], ["And", "\nAnd"], ["\nAnd", "And"]])
def test_earliest_stop_ends_the_text_on_every_route(plain, free_text, stop):
    """HTTP API: the result ends just before the earliest occurrence of any stop, whatever the order."""
    server = plain
    free = free_text
    assert all(s in free for s in stop)
    tgi = {"inputs": STOP_PROMPT, "parameters": {"max_new_tokens": 30}}
    expected = free[: min(free.find(s) for s in stop)]
    tgi["parameters"]["stop"] = stop
    assert httpx.post(server.url + "/generate", json=tgi, timeout=120).json()["generated_text"] == expected
    with httpx.stream("POST", server.url + "/generate_stream", json=tgi, timeout=120) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert "".join(ev["token"]["text"] for ev in events) == events[-1]["generated_text"] == expected
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"
    body = {"prompt": STOP_PROMPT, "max_tokens": 30, "temperature": 0, "stop": stop}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    assert out["choices"][0]["text"] == expected and out["choices"][0]["finish_reason"] == "stop"
