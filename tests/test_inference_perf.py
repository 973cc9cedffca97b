"""inference-perf (the Kubernetes Gateway API Inference Extension's benchmarking tool), unchanged, against a
real server on 127.0.0.1: its streaming run on ``/v1/completions`` reports TTFT, ITL and output tokens (#26).

inference-perf needs Python >= 3.12 (kvserve runs on 3.11), so it gets its own venv, made once under the
git-ignored ``.venv-clients/inference-perf`` with the first interpreter >= 3.12 found (:mod:`tests.client_venv`).
Without one the test skips, saying so; the byte-level SSE framing test (tests/test_vllm_compat.py) covers the
framing this tool depends on everywhere.
"""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from tests.client_venv import client_script, subprocess_env
from tests.conftest import MODEL_DIR

INFERENCE_PERF = "inference-perf==0.7.0"
OUTPUT_TOKENS = 16
RETOKENIZED = 4  # tokens the client's re-tokenization of 16 sampled tokens may differ by (15..18 seen)
RUN_TIMEOUT = 170  # seconds: inference-perf's whole run (load ~10 s, report, tokenizer load)


CONFIG = """\
api:
  type: completion
  streaming: true
data:
  type: random
  input_distribution: {{min: 8, max: 24, mean: 16, std_dev: 4}}
  output_distribution: {{min: {out}, max: {out}, mean: {out}, std_dev: 0}}
load:
  type: constant
  stages:
    - rate: 0.5
      duration: 10
  num_workers: 1
  request_timeout: 60
server:
  type: vllm
  base_url: {url}
  ignore_eos: true
report:
  request_lifecycle:
    summary: true
    per_stage: false
    per_request: true
    per_request_fields: {{request: true, response: false, info: true, response_chunks: true, computed_metrics: true}}
  prometheus:
    summary: false
    per_stage: false
storage:
  local_storage:
    path: {reports}
"""


def test_inference_perf_streaming_reports_ttft_itl_and_tokens(server, tmp_path):
    """Its vLLM instructions (``server: {type: vllm, base_url}``: no model name, no tokenizer section): it takes
    the model from ``/v1/models`` (``MODEL_ID`` as given, the model folder's path) and loads the tokenizer from
    that path, offline."""
    exe = client_script("inference-perf", INFERENCE_PERF, "inference-perf", lowest=(3, 12))
    served = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    assert served == str(MODEL_DIR)
    reports = tmp_path / "reports"
    config = tmp_path / "config.yml"
    config.write_text(CONFIG.format(out=OUTPUT_TOKENS, url=server.url, reports=json.dumps(str(reports))))
    env = subprocess_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                         TOKENIZERS_PARALLELISM="false")
    try:
        run = subprocess.run([str(exe), "-c", str(config)], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        out = "".join((x.decode(errors="replace") if isinstance(x, bytes) else x or "")[-3000:]
                      for x in (exc.stdout, exc.stderr))  # bytes here even with text=True
        pytest.fail(f"inference-perf ran past {RUN_TIMEOUT} s:\n{out}")
    log = f"{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    assert run.returncode == 0, log

    summaries = list(reports.rglob("summary_lifecycle_metrics.json"))
    assert summaries, f"no summary report under {reports}: {sorted(p.name for p in reports.rglob('*'))}\n{log}"
    summary = json.loads(summaries[0].read_text())
    successes, failures = summary["successes"], summary.get("failures") or {}
    assert successes["count"] >= 3, (successes["count"], failures, log)
    assert not failures.get("count"), failures
    latency = successes["latency"]
    for metric in ("time_to_first_token", "inter_token_latency", "time_per_output_token"):
        assert latency[metric] is not None and latency[metric]["mean"] > 0, (metric, latency)
    assert latency["time_to_first_token"]["max"] < latency["request_latency"]["max"], latency
    # Output tokens: the server's usage (every request, none counted by the client instead) is exactly what
    # was asked; output_len is the client's re-tokenization of the streamed text (BPE may merge or split a piece
    # or two: 15 and 18 seen).
    assert successes["output_tokens"]["min"] == successes["output_tokens"]["max"] == OUTPUT_TOKENS, successes
    assert successes["client_fallback_requests"]["output"] == 0, successes["client_fallback_requests"]
    lengths = successes["output_len"]
    assert OUTPUT_TOKENS - RETOKENIZED <= lengths["min"] <= lengths["max"] <= OUTPUT_TOKENS + RETOKENIZED, lengths
    assert successes["throughput"]["output_tokens_per_sec"] > 0, successes["throughput"]

    # Every request streamed: several chunks each, a first token before the end, all 16 tokens counted.
    per_request = json.loads(next(reports.rglob("per_request_lifecycle_metrics.json")).read_text())
    assert len(per_request) == successes["count"]
    for entry in per_request:
        assert entry["error"] is None, entry
        assert json.loads(entry["request"])["model"] == served, entry["request"]  # the name it found, unchanged
        computed = entry["computed_metrics"]
        # Per request, the server's usage is exact; output_tokens (in computed_metrics and response_metrics) is the
        # client's re-tokenization of the streamed text, which BPE may merge or split ("Son"+"to"+"ok" is one word
        # to it; 15, 17 and 18 seen): bounded as output_len is.
        usage = entry["info"]["response_metrics"]["server_usage"]
        assert usage["completion_tokens"] == OUTPUT_TOKENS, usage
        assert OUTPUT_TOKENS - RETOKENIZED <= computed["output_tokens"] <= OUTPUT_TOKENS + RETOKENIZED, computed
        assert 0 < computed["time_to_first_token"] < computed["request_latency"], computed
        assert len(computed["inter_token_latencies"]) >= OUTPUT_TOKENS // 2, computed
        assert len(entry["info"]["response_metrics"]["response_chunks"]) >= OUTPUT_TOKENS // 2, entry["info"]
