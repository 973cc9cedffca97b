"""Docker for the tests: find a working daemon (or prepare one), build the image once, run containers.

Where Docker comes from, in order:
1. a daemon that already answers `docker info` (CI's `.ci/run` starts one with ../shared/tools/docker-local.sh);
2. on machines that carry ../shared/tools/docker-local.sh, that script (Debian's docker.io, a local stand-in for
   `python:3.11-slim`, and a local index serving the machine's CPU torch wheel);
3. neither, or no torch index answering (a daemon left running without the local index): the Docker tests are
   skipped with the reason, unless KVSERVE_REQUIRE_DOCKER=1 (set by .ci/run), where they fail instead.

Builds and containers use the host network (`--network host`): it works both on a normal Docker host and on
a daemon started without iptables, whose bridge containers have no way out. The torch index for the build
is $KVSERVE_TORCH_INDEX when set (docker-local.sh prints it), else the Dockerfile's default (PyTorch's CPU
index); the base image is whatever `python:3.11-slim` the daemon has or pulls.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from functools import lru_cache
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCKER_LOCAL = REPO.parent / "shared" / "tools" / "docker-local.sh"
IMAGE = os.environ.get("KVSERVE_TEST_IMAGE", "kvserve:test")
BUILD_TIMEOUT_S = 1800
DEFAULT_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # the Dockerfile's TORCH_INDEX_URL default
# the image ships mla's rank-64 fit (the Dockerfile's optional calibration step), which the mla+int8 container uses
BUILD_ARGS = ("CALIBRATE=mla", "KV_MLA_RANK=64")


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """Run `docker ARGS`; raise with its output when `check` and it fails."""
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def _daemon_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except subprocess.SubprocessError:
        return False


def _unavailable(reason: str):
    if os.environ.get("KVSERVE_REQUIRE_DOCKER") == "1":
        pytest.fail(f"KVSERVE_REQUIRE_DOCKER=1 but {reason}")
    pytest.skip(reason)


@lru_cache(maxsize=1)
def _prepare() -> tuple[str | None, str | None]:
    """(torch index or None for the Dockerfile default, None) when Docker works, else (None, why not)."""
    index = os.environ.get("KVSERVE_TORCH_INDEX") or None
    if DOCKER_LOCAL.exists() and (index is None or not _daemon_answers()):
        r = subprocess.run(["bash", str(DOCKER_LOCAL)], capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            return None, f"{DOCKER_LOCAL} failed ({r.returncode}): {r.stderr.strip()[-2000:]}"
        found = re.search(r"KVSERVE_TORCH_INDEX=(\S+)", r.stdout)
        index = index or (found.group(1) if found else None)
    if not _daemon_answers():
        why = "no docker client on PATH" if shutil.which("docker") is None else "`docker info` fails (no daemon)"
        return None, f"{why}, and {DOCKER_LOCAL} is not there to start one"
    torch_index = (index or DEFAULT_TORCH_INDEX).rstrip("/") + "/torch/"
    if not _answers(torch_index):  # the build would fail at `pip install torch` after minutes of work
        return None, (f"the torch index {torch_index} does not answer (set KVSERVE_TORCH_INDEX, or run .ci/run, "
                      "which serves the machine's CPU wheel)")
    return index, None


def _answers(url: str, timeout: float = 10) -> bool:
    """Whether an HTTP GET of ``url`` succeeds within ``timeout`` seconds."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status < 400
    except (OSError, ValueError):
        return False


def require_docker() -> str | None:
    """Skip (or fail under KVSERVE_REQUIRE_DOCKER=1) unless Docker works; return the torch index to build with."""
    index, why = _prepare()
    if why:
        _unavailable(why)
    return index


def compose_command() -> list[str] | None:
    """`docker compose` (v2 plugin) or `docker-compose` (v1), whichever works; None when neither does."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        try:
            if subprocess.run([*cmd, "version"], capture_output=True, timeout=60).returncode == 0:
                return cmd
        except subprocess.SubprocessError:
            continue
    return None


_BUILD: dict[str, object] = {}  # the one build's result, or its failure (not retried by every test)


def build_image() -> tuple[str, float]:
    """Build the repository's Dockerfile as IMAGE once per session; returns (image, build seconds).

    Builds of pytest-xdist workers take turns (a lock file beside the run's temporary folders): the second finds
    every layer in Docker's cache.

    Raises:
        RuntimeError / subprocess.TimeoutExpired: the build failed (the same error for every later call).
    """
    index = require_docker()
    if "error" in _BUILD:
        raise _BUILD["error"]
    if "result" not in _BUILD:
        args = ["build", "--network", "host", "-t", IMAGE, *(f"--build-arg={a}" for a in BUILD_ARGS)]
        if index:
            args += ["--build-arg", f"TORCH_INDEX_URL={index}"]
        lock = Path(tempfile.gettempdir()) / f"kvserve-test-build-{re.sub(r'[^A-Za-z0-9]', '_', IMAGE)}.lock"
        with lock.open("a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            start = time.monotonic()
            try:
                docker(*args, str(REPO), timeout=BUILD_TIMEOUT_S)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                _BUILD["error"] = exc
                raise
        _BUILD["result"] = (IMAGE, time.monotonic() - start)
    return _BUILD["result"]


def inspect(ref: str) -> dict:
    return json.loads(docker("inspect", ref).stdout)[0]


class Container:
    """A detached container of `image` serving on `port` (removed by stop()).

    On the host network by default, listening on 127.0.0.1 (`url` reaches it); on a named Docker `network`
    it is reachable from that network's containers under `alias`.
    """

    def __init__(self, image: str, port: int, env: dict[str, str], health_interval_s: int = 2,
                 network: str = "host", alias: str | None = None):
        self.name = f"kvserve-test-{uuid.uuid4().hex[:10]}"
        self.url = f"http://127.0.0.1:{port}"
        env = {"HOST": "127.0.0.1", "PORT": str(port), **env}
        where = ["--network", network] + (["--network-alias", alias] if alias else [])
        # --health-interval only shortens the wait: the check itself is the image's HEALTHCHECK.
        docker("run", "-d", "--name", self.name, *where, f"--health-interval={health_interval_s}s",
               *[a for k, v in env.items() for a in ("-e", f"{k}={v}")], image)

    def state(self) -> dict:
        return inspect(self.name)["State"]

    def wait_healthy(self, timeout_s: float = 400) -> dict:
        """Wait until Docker reports the HEALTHCHECK healthy; raise with the logs if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.state()
            if state["Status"] != "running":
                raise RuntimeError(f"container {state['Status']} (exit {state['ExitCode']}):\n{self.logs()}")
            if state.get("Health", {}).get("Status") == "healthy":
                return state
            time.sleep(1)
        raise RuntimeError(f"not healthy after {timeout_s:.0f} s:\n{self.logs()}")

    def logs(self) -> str:
        r = docker("logs", "--tail", "50", self.name, check=False)
        return r.stdout + r.stderr

    def exec(self, *cmd: str) -> str:
        return docker("exec", self.name, *cmd).stdout.strip()

    def stop(self) -> None:
        docker("rm", "-f", self.name, check=False)
