"""The Grafana dashboard against a real Prometheus: every PromQL expression is valid and returns data.

Starts Debian's `prometheus` on 127.0.0.1 (installing the package when it is missing and this machine
allows it, else the test is skipped with the reason), scraping a kvserve that serves `full` and `dca`.
Also checks the shipped Prometheus config with `promtool check config`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, RunningServer, free_port

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "kvserve.json"


def find_or_install(binary: str) -> str:
    path = shutil.which(binary)
    if path:
        return path
    if shutil.which("apt-get") is None:
        pytest.skip(f"{binary} not found and apt-get is unavailable")
    try:
        subprocess.run(["apt-get", "install", "-y", "-qq", "prometheus"], check=True, capture_output=True, timeout=600,
                       env={"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"{binary} not found and 'apt-get install prometheus' failed: {exc}")
    path = shutil.which(binary)
    if not path:
        pytest.skip(f"{binary} still missing after installing the prometheus package")
    return path


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p["targets"]]


def test_every_declared_backend_metric_has_a_panel():
    """The dashboard's backend panels come from the declarations (nothing listed by hand): each metric a kvserve
    backend declares is drawn, under its declared title."""
    from cache_backends.catalog import declarations, origin

    panels = json.loads(DASHBOARD.read_text())["panels"]
    declared = [m for name, d in declarations().items() if origin(name).startswith("cache_backends/") for m in d.metrics]
    assert {m.name for m in declared} >= {"kvserve_dca_reuse_layers", "kvserve_elastic_compressed_blocks"}
    for m in declared:
        drawn = [p for p in panels if any(m.name in t["expr"] for t in p["targets"])]
        assert len(drawn) == 1, m.name
        assert drawn[0]["title"].startswith(m.panel_title), (m.name, drawn[0]["title"])


def test_every_panel_sets_a_unit():
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        assert p["fieldConfig"]["defaults"].get("unit"), p["title"]


def test_dashboard_json_is_generated_with_the_typed_sdk():
    """The committed JSON is exactly scripts/make_dashboard.py's output (built with grafana-foundation-sdk),
    and it reads back into the SDK's typed models: time-series panels with Prometheus queries."""
    r = subprocess.run([sys.executable, "scripts/make_dashboard.py", "--check"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.models import dashboard, prometheus

    plugins.register_default_plugins()
    model = dashboard.Dashboard.from_json(json.loads(DASHBOARD.read_text()))
    assert model.uid == "kvserve" and len(model.panels) == len(json.loads(DASHBOARD.read_text())["panels"]) > 0
    for p in model.panels:
        assert p.type_val == "timeseries" and p.targets
        assert all(isinstance(t, prometheus.Dataquery) and t.expr for t in p.targets), p.title


def test_promtool_checks_the_shipped_config():
    promtool = find_or_install("promtool")
    r = subprocess.run([promtool, "check", "config", str(REPO / "deploy" / "prometheus" / "prometheus.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture(scope="module")
def stack(starts_server):
    prometheus = find_or_install("prometheus")
    kv = RunningServer({"KV_BACKEND": "full", "KV_BACKENDS": "full,dca,elastic", "KV_DCA_THRESHOLD": "0.5",
                        "KV_DCA_PROBE_INTERVAL": "4"})
    tmp = tempfile.mkdtemp(prefix="kvserve-prom-")
    cfg = Path(tmp) / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                   f"  - job_name: kvserve\n    static_configs:\n      - targets: ['127.0.0.1:{kv.port}']\n")
    port = free_port()
    proc = subprocess.Popen([prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={tmp}/data",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("prometheus did not become ready")
        yield kv, url
    finally:
        proc.terminate()
        proc.wait(20)
        kv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_dashboard_queries_return_data(stack):
    kv, prom = stack
    for i in range(6):  # traffic on both backends, spread over a few scrapes
        for backend in ("full", "dca"):
            httpx.post(kv.url + "/generate", json={"inputs": f"And God said {i}", "parameters": {
                "max_new_tokens": 24, "kv_backend": backend}}, timeout=60).raise_for_status()
        time.sleep(0.5)
    time.sleep(4)
    for expr in dashboard_exprs():
        r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        assert body["data"]["result"], f"no data for {expr}"
