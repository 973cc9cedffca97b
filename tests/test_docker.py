"""The Docker image, built from the repository's Dockerfile and run as users run it.

Builds the image once (see tests/docker_helpers.py for where Docker and the torch index come from), then
runs it with two KV backends chosen by environment variables (`int8`, and `mla+int8` with `KV_MLA_RANK`),
and checks in each container: Docker's HEALTHCHECK state, `/health`, `/info`'s backend and KV bytes per
token (against `kvserve estimate`), a `/generate` and a streamed `/generate_stream` (greedy, so both give the
same text), that every `kvserve_*` series carries that backend's label, and that the server runs as the
image's non-root user. A bad `KV_BACKEND` must stop the container with exit status 2 and one line. The image
itself must hold a CPU-only torch and no compilers or pip caches.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL_DIR, REPO, free_port
from tests.docker_helpers import Container, build_image, docker, inspect

DOCKERFILE = (REPO / "Dockerfile").read_text()
PROMPT = "And God said"
NEW_TOKENS = 12
USER_ID = "10001"

# (KV_BACKEND, other env, the same spec for `kvserve estimate`)
BACKENDS = [
    ("int8", {}, "int8"),
    ("mla+int8", {"KV_MLA_RANK": "64"}, "mla+int8:rank=64"),
]


def dockerfile_arg(name: str) -> str:
    """The default of build argument `name` in the Dockerfile (its first ARG line)."""
    found = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.M)
    assert found, f"no ARG {name}=... in the Dockerfile"
    return found.group(1)


def test_plain_build_installs_the_cpu_torch_wheel():
    """Without build arguments, torch comes from PyTorch's CPU index (not PyPI's CUDA build)."""
    assert dockerfile_arg("TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"
    assert '--index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" torch' in DOCKERFILE


@pytest.fixture(scope="module")
def image() -> str:
    return build_image()[0]


def test_image_config_non_root_user_and_healthcheck(image):
    config = inspect(image)["Config"]
    assert config["User"].split(":")[0] == USER_ID
    assert "/health" in " ".join(config["Healthcheck"]["Test"])
    assert config["Env"] and "DEVICE=auto" in config["Env"]
    assert config["Cmd"] == ["kvserve", "serve"]


PROBE = r"""
import importlib.metadata as md, json, os, shutil, torch
print(json.dumps({
    "uid": os.getuid(), "cuda": torch.version.cuda, "torch": torch.__version__,
    "gpu_dists": sorted(d.metadata["Name"] for d in md.distributions()
                        if d.metadata["Name"].lower().startswith(("nvidia", "triton"))),
    "compilers": [c for c in ("gcc", "cc", "g++", "c++", "clang", "make") if shutil.which(c)],
    "pip_caches": [p for p in ("/root/.cache/pip", os.path.expanduser("~/.cache/pip"), "/tmp/pip-cache")
                   if os.path.exists(p)],
    "sources_in_image": os.path.exists("/src"),
}))
"""


def test_image_holds_cpu_torch_and_no_build_leftovers(image):
    r = docker("run", "--rm", "--network", "host", "--entrypoint", "python", image, "-c", PROBE, timeout=120)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["uid"] == int(USER_ID)
    assert got["cuda"] is None and got["gpu_dists"] == [], got
    assert got["torch"].startswith("2.13.0")  # constraints.txt's pin
    assert got["compilers"] == [] and got["pip_caches"] == [] and not got["sources_in_image"], got


def test_bad_backend_exits_2_with_one_line(image):
    r = docker("run", "--rm", "--network", "host", "-e", "KV_BACKEND=nope", "-e", f"PORT={free_port()}", image,
               timeout=120, check=False)
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(lines) == 1 and "KV_BACKEND" in lines[0] and "nope" in lines[0], lines


def expected_bytes_per_token(spec: str) -> float:
    """KV bytes per token over all layers for `spec`, from `kvserve estimate` on the bundled model (fp32)."""
    out = subprocess.run([sys.executable, "-m", "server.cli", "estimate", "--model", str(MODEL_DIR), "--seq-len", "1024",
                          "--batch", "1", "--dtype", "float32", "--json", spec], capture_output=True, text=True,
                         check=True, cwd=REPO, timeout=120).stdout
    (row,) = json.loads(out)
    layers = json.loads((MODEL_DIR / "config.json").read_text())["num_hidden_layers"]
    return row["bytes_per_token_per_layer"] * layers


@pytest.fixture(scope="module", params=BACKENDS, ids=[b[0] for b in BACKENDS])
def served(request, image):
    backend, env, spec = request.param
    c = Container(image, free_port(), {"KV_BACKEND": backend, "LOG_LEVEL": "warning", **env})
    try:
        state = c.wait_healthy()
        yield c, backend, spec, state
    finally:
        c.stop()


def test_healthcheck_healthy_and_health_ok(served):
    c, _, _, state = served
    assert state["Health"]["Status"] == "healthy"
    assert state["Health"]["Log"][-1]["ExitCode"] == 0
    r = httpx.get(c.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_info_names_the_backend_and_its_bytes_per_token(served):
    c, backend, spec, _ = served
    info = httpx.get(c.url + "/info", timeout=10).json()
    # KV_BACKENDS unset: full and int8 are served besides KV_BACKEND
    assert info["kv_backend"] == backend and info["kv_backends"] == list(dict.fromkeys([backend, "full", "int8"]))
    assert info["model_device_type"] == "cpu"
    assert info["kv_bytes_per_token"][backend] == pytest.approx(expected_bytes_per_token(spec), rel=1e-9)


def test_image_ships_the_fits_it_was_built_with(served):
    """Built with CALIBRATE=mla KV_MLA_RANK=64, the mla+int8 container loads mla's bases from the image's
    calibration cache instead of calibrating at start; int8 needs none."""
    c, backend, _, _ = served
    info = httpx.get(c.url + "/info", timeout=10).json()
    events = [(e["kind"], e["source"], e["path"].rsplit("/", 1)[0]) for e in info["kv_calibration"]]
    assert events == ([("mla", "cache", "/app/calibration")] if backend == "mla+int8" else [])


def stream_events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/generate_stream", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]


def test_generate_and_stream_agree(served):
    c, *_ = served
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
    r = httpx.post(c.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["generated_text"] and out["details"]["generated_tokens"] <= NEW_TOKENS
    events = stream_events(c.url, body)
    assert events and events[-1]["generated_text"] == out["generated_text"]  # greedy: the same text
    assert "".join(e["token"]["text"] for e in events) == out["generated_text"]
    assert len(events) == out["details"]["generated_tokens"]


def test_every_series_carries_the_backend_label(served):
    c, backend, *_ = served
    httpx.post(c.url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}},
               timeout=120).raise_for_status()
    samples = [s for family in text_string_to_metric_families(httpx.get(c.url + "/metrics", timeout=10).text)
               for s in family.samples if s.name.startswith("kvserve_")]
    assert samples
    served_backends = {backend, "full", "int8"}  # KV_BACKENDS unset: full and int8 besides KV_BACKEND
    # the one KV pool is shared by every served backend: its usage fraction is the pool's (vLLM's
    # kv_cache_usage_perc has no backend either), so its usage, its evictable cached blocks and the server-wide
    # request counts routers read carry none
    pool_wide = {"kvserve_kv_cache_usage_perc", "kvserve_prefix_cache_blocks", "kvserve_num_requests_running",
                 "kvserve_num_requests_waiting"}
    wrong = sorted({f"{s.name}{s.labels}" for s in samples
                    if s.name not in pool_wide and s.labels.get("backend") not in served_backends})
    assert {s.name for s in samples} >= pool_wide
    assert not wrong, wrong
    generated = sum(s.value for s in samples if s.name == "kvserve_generation_tokens_total"
                    and s.labels["backend"] == backend)
    assert generated >= 4


def test_server_process_runs_as_the_non_root_user(served):
    c, *_ = served
    assert c.exec("id", "-u") == USER_ID
    # PID 1 is the server itself (exec-form CMD): its owner is the image's user, not root.
    assert c.exec("stat", "-c", "%u", "/proc/1") == USER_ID
    assert "kvserve" in c.exec("cat", "/proc/1/cmdline")


def test_docker_tests_skip_when_no_torch_index_answers(monkeypatch):
    """A daemon that answers without a reachable torch index (one left running by an earlier `.ci/run`, whose
    local index is gone) is reported as unavailable with the index named, instead of a build that fails at
    `pip install torch` after minutes."""
    from tests import docker_helpers

    monkeypatch.setattr(docker_helpers, "_daemon_answers", lambda: True)
    monkeypatch.setattr(docker_helpers, "DOCKER_LOCAL", REPO / "no-such-docker-local.sh")
    monkeypatch.setenv("KVSERVE_TORCH_INDEX", f"http://127.0.0.1:{free_port()}/simple")
    docker_helpers._prepare.cache_clear()
    try:
        index, why = docker_helpers._prepare()
    finally:
        docker_helpers._prepare.cache_clear()
    assert index is None and "does not answer" in why and "/simple/torch/" in why
