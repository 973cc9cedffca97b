"""Shared fixtures: the shipped reference model (fp32, and in each precision under test), and a real server
on a free port."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads sleep, not spin (#26)

import httpx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tests.precision import Precision, selected

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = Path(os.environ.get("KVSERVE_TEST_MODEL", REPO / "models" / "kjv-llama-mha"))
PRECISIONS: list[Precision] = []
"""The device and dtypes of the value tests (``DEVICE``, ``DTYPE``: :mod:`tests.precision`)."""

if "OMP_NUM_THREADS" not in os.environ:  # an explicit thread count wins (1 on a shared machine: two spinning
    torch.set_num_threads(2)             # intra-op threads on a loaded CPU ran the value tests 20x slower)


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: a test on the real pretrained model (SmolLM2-135M-Instruct, "
                                       "`kvserve fetch-model`); `pytest -m real_model` runs the group")
    config.addinivalue_line("markers", "value: a value test, run once per selected precision (DEVICE, DTYPE); "
                                       "`make test-gpu` runs these on CUDA")
    try:
        PRECISIONS[:] = selected(os.environ.get("DEVICE"), os.environ.get("DTYPE"))
    except ValueError as exc:  # e.g. DEVICE=cuda without a CUDA device: one line, exit status 4
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config):
    return f"value tests in: {', '.join(map(str, PRECISIONS))} (DEVICE, DTYPE)"


def pytest_generate_tests(metafunc):
    """A test that takes ``precision`` (itself or through a fixture) runs once per selected precision."""
    if "precision" in metafunc.fixturenames:
        metafunc.parametrize("precision", PRECISIONS, ids=str, scope="session")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "precision" in item.fixturenames:
            item.add_marker(pytest.mark.value)


@pytest.fixture(scope="session", autouse=True)
def calibration_cache_dir(tmp_path_factory) -> Path:
    """Every server and ``kvserve calibrate`` the tests start keep their calibration cache here (one per
    run, shared by the tests), never in the user's home."""
    path = tmp_path_factory.mktemp("calibration-cache")
    before = os.environ.get("KV_CALIBRATION_CACHE_DIR")
    os.environ["KV_CALIBRATION_CACHE_DIR"] = str(path)
    yield path
    if before is None:
        os.environ.pop("KV_CALIBRATION_CACHE_DIR", None)
    else:
        os.environ["KV_CALIBRATION_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return MODEL_DIR


@pytest.fixture(scope="session")
def ref_model():
    """The shipped reference model and tokenizer (fp32, CPU, eval mode)."""
    from server.model_loading import load_model

    return load_model(str(MODEL_DIR), torch.device("cpu"), torch.float32)


@functools.cache
def _model_in(precision: Precision):
    from server.model_loading import load_model

    return load_model(str(MODEL_DIR), precision.device, precision.dtype)


@pytest.fixture(scope="session")
def value_model(precision):
    """The shipped reference model and tokenizer on the device and in the dtype under test (eval mode;
    loaded through the server's loader; each kept for the session, so no two share an ``id``)."""
    return _model_in(precision)


@pytest.fixture
def held_pricing(monkeypatch):
    """``(entered, release)``: the engine core's loading waits where the KV backends are calibrated and priced
    (:func:`server.engine_loading.prepare_backends`) until ``release`` is set; ``entered`` is set when it gets
    there. A core in a thread of this process (``ENGINE_PROCESS=false``) loads through the patch."""
    import threading

    import server.engine_loading

    entered, release = threading.Event(), threading.Event()
    prepare = server.engine_loading.prepare_backends

    def held(*args, **kwargs):
        entered.set()
        release.wait(120)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(server.engine_loading, "prepare_backends", held)
    yield entered, release
    release.set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_DEFAULTS = {"ENGINE_PROCESS": "false"}
"""What a test's server runs with unless the environment or the test says otherwise: the engine core in a thread
of the server's process (the same core and messages as in its own process, which costs seconds more per start;
tests/test_engine_process_server.py, tests/test_shutdown.py and tests/test_engine_process.py run the process)."""


class RunningServer:
    """A real ``kvserve serve`` process on 127.0.0.1 (stopped by the fixture).

    Args:
        env: its settings, over :data:`SERVER_DEFAULTS` and this process's environment; ``None`` unsets one.
        argv: the command (default ``python -m server.cli serve``).
    """

    def __init__(self, env: dict[str, str | None], argv: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**SERVER_DEFAULTS, **os.environ, "HOST": "127.0.0.1", "PORT": str(self.port),
                    "MODEL_ID": str(MODEL_DIR), "LOG_LEVEL": "warning", **env}
        full_env = {k: v for k, v in full_env.items() if v is not None}
        self.proc = subprocess.Popen(argv or [sys.executable, "-m", "server.cli", "serve"], env=full_env, cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 300  # calibration at start-up; slow when the machine is shared
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not become healthy in 300 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def metrics(self) -> dict[str, float]:
        """Scrape /metrics into {'name{k="v",...}' (labels sorted): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=5).text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
        return out


def server_with(env: dict[str, str]):
    """A module-scoped fixture running ``kvserve serve`` with ``env`` (stopped after the module)."""

    @pytest.fixture(scope="module")
    def fixture():
        srv = RunningServer(env)
        yield srv
        srv.stop()

    return fixture


server = server_with({"MAX_BATCH_SIZE": "8"})
