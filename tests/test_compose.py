"""deploy/docker-compose.yml and the Prometheus config it ships.

- `docker compose config` (or `docker-compose config`) accepts the file, with and without the `compare`
  profile, and the profile alone adds the second replica (skipped with the reason where neither compose
  command exists; required under KVSERVE_REQUIRE_DOCKER=1).
- Prometheus discovers exactly the kvserve services of the compose file (by DNS name and port).
- For real: Prometheus with the shipped config, in a container on a Docker network beside kvserve
  containers named as in compose, scrapes `kvserve` alone while only it runs, and both replicas once
  `kvserve-b` runs too. (Needs Docker and the image; Prometheus is Debian's binary, mounted into a
  container of the Python base image, since no registry image is needed for that.)
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest
import yaml

from tests.conftest import REPO
from tests.docker_helpers import Container, build_image, compose_command, docker
from tests.test_prometheus import find_or_install

COMPOSE = REPO / "deploy" / "docker-compose.yml"
PROMETHEUS_YML = REPO / "deploy" / "prometheus" / "prometheus.yml"


def compose_config(*extra: str) -> dict:
    cmd = compose_command()
    if cmd is None:
        if os.environ.get("KVSERVE_REQUIRE_DOCKER") == "1":
            pytest.fail("KVSERVE_REQUIRE_DOCKER=1 but neither `docker compose` nor `docker-compose` works")
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    r = subprocess.run([*cmd, "-f", str(COMPOSE), *extra, "config"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "KV_BACKEND": "int8", "KV_BACKEND_B": "mla"})
    assert r.returncode == 0, r.stdout + r.stderr
    return yaml.safe_load(r.stdout)


def kvserve_services(config: dict) -> dict[str, dict]:
    return {name: s for name, s in config["services"].items() if s.get("image", "").startswith("kvserve")}


def started(config: dict, *profiles: str) -> set[str]:
    """Services `up` starts with `profiles` active (compose v1's `config` lists them all, v2's only these)."""
    return {name for name, s in config["services"].items()
            if not s.get("profiles") or set(s["profiles"]) & set(profiles)}


def test_compose_config_validates_and_compare_adds_the_second_replica():
    plain, compare = compose_config(), compose_config("--profile", "compare")
    assert started(plain) == {"kvserve", "prometheus", "grafana"}
    assert started(compare, "compare") == {"kvserve", "kvserve-b", "prometheus", "grafana"}
    assert compare["services"]["kvserve"]["environment"]["KV_BACKEND"] == "int8"
    assert compare["services"]["kvserve-b"]["environment"]["KV_BACKEND"] == "mla"
    mounts = " ".join(str(v) for v in plain["services"]["prometheus"]["volumes"])
    assert "prometheus.yml" in mounts


def test_prometheus_discovers_exactly_the_compose_replicas_by_dns():
    (job,) = yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]
    assert "static_configs" not in job  # a static target for a replica that is not running is always down
    (sd,) = job["dns_sd_configs"]
    compose = yaml.safe_load(COMPOSE.read_text())
    services = kvserve_services(compose)
    assert set(sd["names"]) == set(services) == {"kvserve", "kvserve-b"}
    assert sd["type"] == "A" and sd["port"] == 8000
    for s in services.values():
        assert any(str(p).endswith(":8000") for p in s["ports"])


def active_targets(prom: str) -> list[dict]:
    """Prometheus's active targets, asked from inside its container."""
    out = docker("exec", prom, "python", "-c", "import urllib.request; print(urllib.request.urlopen("
                 "'http://127.0.0.1:9090/api/v1/targets?state=active', timeout=5).read().decode())", check=False)
    if out.returncode != 0:
        return []
    return json.loads(out.stdout)["data"]["activeTargets"]


def wait_targets(prom: str, want: dict[str, str], timeout_s: float = 90) -> list[dict]:
    """Wait until the active targets are `want` ({replica: health}); return them, or fail with the last seen."""
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        seen = active_targets(prom)
        if {t["labels"].get("replica"): t["health"] for t in seen} == want:
            return seen
        time.sleep(2)
    pytest.fail(f"targets never became {want}: {[(t['labels'], t['health'], t['lastError']) for t in seen]}")


def test_prometheus_scrapes_only_the_replicas_that_run():
    image = build_image()[0]
    prometheus = find_or_install("prometheus")
    net = f"kvserve-test-{uuid.uuid4().hex[:8]}"
    docker("network", "create", net)
    prom = f"{net}-prometheus"
    replicas: list[Container] = []
    try:
        docker("run", "-d", "--name", prom, "--network", net, "--entrypoint", "/usr/local/bin/prometheus",
               "-v", f"{prometheus}:/usr/local/bin/prometheus:ro",
               "-v", f"{PROMETHEUS_YML}:/etc/prometheus/prometheus.yml:ro", "python:3.11-slim",
               "--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/tmp/prometheus",
               "--web.listen-address=127.0.0.1:9090")
        for name in ("kvserve", "kvserve-b"):
            c = Container(image, 8000, {"KV_BACKEND": "full", "HOST": "0.0.0.0", "LOG_LEVEL": "warning"},
                          network=net, alias=name)
            replicas.append(c)
            c.wait_healthy()
            if name == "kvserve":  # kvserve-b not started yet: one target, up
                wait_targets(prom, {"kvserve": "up"})
        targets = wait_targets(prom, {"kvserve": "up", "kvserve-b": "up"})
        assert len(targets) == 2
    finally:
        for c in replicas:
            c.stop()
        docker("rm", "-f", prom, check=False)
        docker("network", "rm", net, check=False)
