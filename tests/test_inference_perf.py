"""inference-perf (the Kubernetes Gateway API Inference Extension's benchmarking tool), unchanged, against a
real server on 127.0.0.1: its streaming run on ``/v1/completions`` reports TTFT, ITL and output tokens (#26).

inference-perf needs Python >= 3.12 (kvserve runs on 3.11), so it gets its own venv, made once under the
git-ignored ``.venv-clients/inference-perf`` with the first interpreter >= 3.12 found (``python3.12`` ...
on PATH, then pyenv's versions). Without one the test skips, saying so; the byte-level SSE framing test
(tests/test_vllm_compat.py) covers the framing this tool depends on everywhere.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_DIR, REPO, server_with

INFERENCE_PERF = "inference-perf==0.7.0"
VENV = REPO / ".venv-clients" / "inference-perf"
STAMP = VENV / ".kvserve-installed"
OUTPUT_TOKENS = 16
RETOKENIZED = 4  # tokens the client's re-tokenization of 16 sampled tokens may differ by (15..18 seen)
RUN_TIMEOUT = 170  # seconds: inference-perf's whole run (load ~10 s, report, tokenizer load)

server = server_with({"MAX_BATCH_SIZE": "8"})


def _version(python: str) -> tuple[int, int] | None:
    """The interpreter's (major, minor), or None when it does not run (a pyenv shim for a version that is
    not selected exits non-zero)."""
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    try:
        major, minor = map(int, out.stdout.split())
    except ValueError:
        return None
    return major, minor


def find_python() -> str | None:
    """The first interpreter >= 3.12 that runs and has ``venv``: on PATH, then under pyenv's versions."""
    candidates = [p for name in ("python3.12", "python3.13", "python3.14") if (p := shutil.which(name))]
    root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates += sorted(glob.glob(f"{root}/versions/*/bin/python3.1[2-9]"))
    for python in candidates:
        version = _version(python)
        if version and version >= (3, 12):
            return python
    return None


def inference_perf_bin() -> Path:
    """The ``inference-perf`` script of the cached venv, made (or remade, when the pin changed) here."""
    exe = VENV / "bin" / "inference-perf"
    if STAMP.exists() and STAMP.read_text().strip() == INFERENCE_PERF and exe.exists():
        return exe
    python = find_python()
    if python is None:
        pytest.skip("inference-perf needs Python >= 3.12: none found (python3.12/3.13 on PATH, ~/.pyenv/versions)")
    if VENV.exists():
        shutil.rmtree(VENV)
    subprocess.run([python, "-m", "venv", str(VENV)], check=True, timeout=300)
    pip = subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", INFERENCE_PERF],
                         capture_output=True, text=True, timeout=1200)
    if pip.returncode != 0:
        raise RuntimeError(f"pip install {INFERENCE_PERF} failed:\n{pip.stdout[-3000:]}\n{pip.stderr[-3000:]}")
    STAMP.write_text(INFERENCE_PERF + "\n")
    return exe


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
  model_name: {model}
  base_url: {url}
  ignore_eos: true
tokenizer:
  pretrained_model_name_or_path: {tokenizer}
report:
  request_lifecycle:
    summary: true
    per_stage: false
    per_request: true
    per_request_fields: {{request: false, response: false, info: true, response_chunks: true, computed_metrics: true}}
  prometheus:
    summary: false
    per_stage: false
storage:
  local_storage:
    path: {reports}
"""


def test_inference_perf_streaming_reports_ttft_itl_and_tokens(server, tmp_path):
    exe = inference_perf_bin()
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    reports = tmp_path / "reports"
    config = tmp_path / "config.yml"
    config.write_text(CONFIG.format(out=OUTPUT_TOKENS, model=json.dumps(model), url=server.url,
                                    tokenizer=json.dumps(str(MODEL_DIR)), reports=json.dumps(str(reports))))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VIRTUAL_ENV", None)
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
