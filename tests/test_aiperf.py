"""aiperf (NVIDIA's benchmarking client), unchanged, against a real server on 127.0.0.1: its vLLM quick-start
(``aiperf profile --model <served name> --endpoint-type chat --endpoint /v1/chat/completions --streaming
--synthetic-input-tokens-mean/-stddev --output-tokens-mean/-stddev --url --request-count``), no tokenizer flag,
with ``--extra-inputs ignore_eos:true`` so every answer is as long as asked. Results checked by value.

aiperf 0.13.0 pins ``huggingface_hub<2``, ``pandas~=2.3``, ``rich~=14.1``, ``pillow~=12.3`` and more, which
would downgrade the project's, so it gets its own venv (:mod:`tests.client_venv`).

Offline: aiperf 0.13.0 cannot load a tokenizer from a local path with ``HF_HUB_OFFLINE=1``, with or without
``--tokenizer``: offline, its loader sends every name to ``huggingface_hub.snapshot_download(...,
local_files_only=True)``, which refuses a path as a repo id (``HFValidationError``). vLLM's served name for a
local model is the same path, so nothing on the server's side helps. The run leaves ``HF_HUB_OFFLINE`` unset
and points ``HF_ENDPOINT`` at a closed local port instead: a hub lookup would fail at once, so a passing run
loaded the tokenizer from the served path alone. :func:`test_aiperf_offline_mode_refuses_a_local_path` pins the
limitation: it fails once an aiperf release loads a path offline, and then the run can set ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from tests.client_venv import client_script, closed_url, subprocess_env
from tests.conftest import MODEL_DIR

AIPERF = "aiperf==0.13.0"
PYTHONS = dict(lowest=(3, 11), below=(3, 14))  # aiperf 0.13.0: Requires-Python >=3.11,<3.14
REQUESTS = 4
INPUT_TOKENS = 16
OUTPUT_TOKENS = 8
RETOKENIZED = 2  # tokens aiperf's re-tokenization of 8 streamed tokens may differ by (9 seen)
RUN_TIMEOUT = 300  # seconds: aiperf starts a dozen service processes, loads the tokenizer in several of them


def aiperf_bin():
    return client_script("aiperf", AIPERF, "aiperf", **PYTHONS)


def test_aiperf_profile_streaming_chat(server, tmp_path):
    exe = aiperf_bin()
    served = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    assert served == str(MODEL_DIR)
    artifacts = tmp_path / "artifacts"
    cmd = [str(exe), "profile", "--model", served, "--endpoint-type", "chat", "--endpoint", "/v1/chat/completions",
           "--streaming", "--synthetic-input-tokens-mean", str(INPUT_TOKENS), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--url", server.url, "--request-count", str(REQUESTS),
           "--artifact-dir", str(artifacts), "--ui-type", "none"]
    env = subprocess_env(HF_ENDPOINT=closed_url(), HF_HUB_OFFLINE=None, TRANSFORMERS_OFFLINE=None,
                         TOKENIZERS_PARALLELISM="false")
    try:
        run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        out = "".join((x.decode(errors="replace") if isinstance(x, bytes) else x or "")[-3000:]
                      for x in (exc.stdout, exc.stderr))
        pytest.fail(f"aiperf ran past {RUN_TIMEOUT} s:\n{out}")
    log = f"{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    assert run.returncode == 0, log

    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert summary["is_complete"] is True and summary["was_cancelled"] is False, log
    assert summary["error_summary"] == [], summary["error_summary"]
    assert summary["request_count"]["avg"] == summary["completed_request_count"]["avg"] == REQUESTS
    assert summary["request_error_rate"]["avg"] == 0
    assert [m["name"] for m in summary["input_config"]["models"]["items"]] == [served]
    # The server's usage is exact: every request got the 8 tokens it asked for. aiperf's own output length is
    # its re-tokenization of the streamed text, which BPE may merge or split by a token (9 seen).
    usage = summary["usage_completion_tokens"]
    assert usage["min"] == usage["max"] == OUTPUT_TOKENS and usage["count"] == REQUESTS, usage
    assert summary["total_usage_completion_tokens"]["avg"] == REQUESTS * OUTPUT_TOKENS
    lengths = summary["output_sequence_length"]
    assert OUTPUT_TOKENS - RETOKENIZED <= lengths["min"] <= lengths["max"] <= OUTPUT_TOKENS + RETOKENIZED, lengths
    for metric in ("time_to_first_token", "inter_token_latency", "request_latency"):
        stats = summary[metric]
        assert stats["count"] == REQUESTS and stats["min"] > 0, (metric, stats)
    assert summary["time_to_first_token"]["max"] < summary["request_latency"]["max"]

    # What was sent: the served name, streaming, 8 tokens asked with ignore_eos; no tokenizer was configured.
    assert summary["input_config"]["tokenizer"] == {}
    payloads = [p for session in json.loads((artifacts / "inputs.json").read_text())["data"]
                for p in session["payloads"]]
    assert len(payloads) == REQUESTS
    for body in payloads:
        assert body["model"] == served and body["stream"] is True and body["ignore_eos"] is True, body
        assert body["max_completion_tokens"] == OUTPUT_TOKENS, body

    # Every request streamed: a first token before the end, then a chunk for most of the others.
    records = [json.loads(line) for line in (artifacts / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == REQUESTS
    for record in records:
        assert "error" not in record or record["error"] is None, record
        metrics = record["metrics"]
        assert metrics["usage_completion_tokens"]["value"] == OUTPUT_TOKENS, metrics
        assert 0 < metrics["time_to_first_token"]["value"] < metrics["request_latency"]["value"], metrics
        assert len(metrics["inter_chunk_latency"]["value"]) >= OUTPUT_TOKENS // 2, metrics


def test_aiperf_offline_mode_refuses_a_local_path(tmp_path):
    """aiperf 0.13.0 with ``HF_HUB_OFFLINE=1`` cannot load the tokenizer from a local folder (see the module's
    docstring); the same load without it works. When this fails, aiperf has fixed it: set
    ``HF_HUB_OFFLINE=1`` in the run above and drop this test."""
    python = aiperf_bin().with_name("python")
    load = ("import sys\nfrom aiperf.common.tokenizer import Tokenizer\n"
            "try:\n    t = Tokenizer.from_pretrained(sys.argv[1])\nexcept Exception as e:\n"
            "    print(type(e).__name__, e)\nelse:\n    print('loaded', t.encode('And God said'))\n")

    def load_with(**env):
        return subprocess.run([str(python), "-c", load, str(MODEL_DIR)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, env=subprocess_env(**env))

    offline = load_with(HF_HUB_OFFLINE="1")
    assert offline.stdout.startswith("TokenizerError") and "HFValidationError" in offline.stdout, offline
    online = load_with(HF_ENDPOINT=closed_url(), HF_HUB_OFFLINE=None, TRANSFORMERS_OFFLINE=None)
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(str(MODEL_DIR)).encode("And God said")
    assert online.stdout.strip() == f"loaded {want}", online
