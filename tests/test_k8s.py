"""The Kubernetes manifests validate offline against the API schemas (kubernetes-validate)."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from tests.conftest import REPO

MANIFESTS = sorted((REPO / "deploy" / "k8s").glob("*.yaml"))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_deployment_probes_resources_and_non_root():
    dep = yaml.safe_load((REPO / "deploy" / "k8s" / "deployment.yaml").read_text())
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["readinessProbe"]["httpGet"]["path"] == c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert any(e["name"] == "KV_BACKEND" for e in c["env"])


def test_init_container_calibrates_into_the_servers_cache():
    """`kvserve calibrate` runs first with the server's backend and writes where the server reads."""
    pod = yaml.safe_load((REPO / "deploy" / "k8s" / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    (init,), (server,) = pod["initContainers"], pod["containers"]
    assert init["command"] == ["kvserve", "calibrate"] and init["image"] == server["image"]
    env = [{e["name"]: e["value"] for e in c["env"]} for c in (init, server)]
    assert env[0]["KV_BACKEND"] == env[1]["KV_BACKEND"]
    assert env[0]["KV_CALIBRATION_CACHE_DIR"] == env[1]["KV_CALIBRATION_CACHE_DIR"]
    mounts = [{m["name"]: m["mountPath"] for m in c["volumeMounts"]} for c in (init, server)]
    assert mounts[0] == mounts[1] and env[1]["KV_CALIBRATION_CACHE_DIR"].startswith(mounts[1]["calibration"] + "/")
    assert any(v["name"] == "calibration" for v in pod["volumes"])


def test_hpa_scales_on_requests_waiting():
    hpa = yaml.safe_load((REPO / "deploy" / "k8s" / "hpa.yaml").read_text())
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "kvserve_requests_waiting"
    adapter = yaml.safe_load((REPO / "deploy" / "k8s" / "prometheus-adapter.yaml").read_text())
    assert "kvserve_requests_waiting" in adapter["data"]["config.yaml"]


def test_termination_grace_covers_the_drain():
    """SIGTERM drains for SHUTDOWN_GRACE_SECONDS, then ends what is left: Kubernetes must not kill the pod first (#26)."""
    pod = yaml.safe_load((REPO / "deploy" / "k8s" / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert float(env["SHUTDOWN_GRACE_SECONDS"]) + 5 <= pod["terminationGracePeriodSeconds"]
