"""The Kubernetes manifests validate offline against the API schemas (kubernetes-validate), and the Gateway API
Inference Extension example (deploy/k8s/inference-pool/) against a schema of its InferencePool written here."""

from __future__ import annotations

import copy
import json
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.conftest import REPO

K8S = REPO / "deploy" / "k8s"
POOL_DIR = K8S / "inference-pool"
MANIFESTS = sorted(K8S.glob("*.yaml")) + sorted(POOL_DIR.glob("*.yaml"))
# CRDs kubernetes-validate does not know, each checked against its schema in tests/k8s_schemas/
CRD_SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"):
               REPO / "tests" / "k8s_schemas" / "inferencepool-v1.json"}


def _docs(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _crd_validator(doc):
    schema = json.loads(CRD_SCHEMAS[doc["apiVersion"], doc["kind"]].read_text())
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates(path):
    docs = _docs(path)
    assert docs
    for doc in docs:
        if (doc.get("apiVersion"), doc.get("kind")) in CRD_SCHEMAS:
            _crd_validator(doc).validate(doc)
        else:
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


# --- Gateway API Inference Extension: InferencePool + endpoint picker (deploy/k8s/inference-pool/) ---------------

def _kind(docs, kind):
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _pool():
    return _kind(_docs(POOL_DIR / "inferencepool.yaml"), "InferencePool")


def _epp_args():
    """The picker's flags as {name: value} (``--name=value``; a repeated flag would be a mistake: refused)."""
    (c,) = _kind(_docs(POOL_DIR / "epp.yaml"), "Deployment")["spec"]["template"]["spec"]["containers"]
    args = {}
    for arg in c["args"]:
        name, eq, value = arg.removeprefix("--").partition("=")
        assert arg.startswith("--") and eq and name not in args, arg
        args[name] = value
    return args


def _metric_spec(spec):
    """A picker metric spec ``name`` or ``name{label=value,...}`` (v1.3's syntax: values unquoted) as (name, labels)."""
    m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^{}]+)\})?", spec)
    assert m, f"not a metric spec: {spec!r}"
    labels = dict(pair.split("=", 1) for pair in m[2].split(",")) if m[2] else {}
    assert all(re.fullmatch(r"[a-zA-Z0-9_.+-]+", v) for v in labels.values()), f"quoted or empty value in {spec!r}"
    return m[1], labels


def _exported():
    """kvserve's metric names (prometheus-client's, counters without ``_total``) -> (type, label names), from the
    registry the server builds: a rename in server/metrics.py fails the tests below."""
    from server.metrics import Metrics

    m = Metrics()
    return {c._name: (c._type, set(c._labelnames)) for c in vars(m).values() if hasattr(c, "_labelnames")}


@pytest.mark.parametrize("mutate", [
    lambda p: p["spec"].pop("selector"),
    lambda p: p["spec"]["selector"].update(matchLabels={}),
    lambda p: p["spec"]["selector"].update(matchExpressions=[]),
    lambda p: p["spec"].update(targetPorts=[]),
    lambda p: p["spec"]["targetPorts"].append({"number": 8000}),
    lambda p: p["spec"]["targetPorts"][0].update(number=0),
    lambda p: p["spec"]["targetPorts"][0].update(number="8000"),
    lambda p: p["spec"]["endpointPickerRef"].pop("port"),
    lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Maybe"),
    lambda p: p["spec"]["endpointPickerRef"].update(extensionRef="kvserve-epp"),
    lambda p: p["spec"].update(appProtocol="grpc"),
    lambda p: p.update(apiVersion="inference.networking.x-k8s.io/v1alpha2"),
], ids=["no-selector", "empty-labels", "expressions", "no-ports", "same-port-twice", "port-0", "port-string",
        "service-without-port", "failure-mode", "unknown-field", "app-protocol", "other-version"])
def test_pool_schema_refuses_a_broken_pool(mutate):
    """The hand-written schema is no rubber stamp: each of these is an InferencePool the API server refuses."""
    pool = copy.deepcopy(_pool())
    validator = _crd_validator(pool)
    validator.validate(pool)
    mutate(pool)
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(pool)


def test_pool_selects_the_kvserve_pods_on_their_port():
    dep = yaml.safe_load((K8S / "deployment.yaml").read_text())
    pod = dep["spec"]["template"]
    (server,) = pod["spec"]["containers"]
    spec = _pool()["spec"]
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert [p["number"] for p in spec["targetPorts"]] == [p["containerPort"] for p in server["ports"]]
    assert _epp_args()["pool-name"] == _pool()["metadata"]["name"]


def test_pool_names_the_pickers_service_and_port():
    docs = _docs(POOL_DIR / "epp.yaml")
    ref = _pool()["spec"]["endpointPickerRef"]
    svc, dep = _kind(docs, "Service"), _kind(docs, "Deployment")
    assert ref.get("kind", "Service") == "Service" and ref["name"] == svc["metadata"]["name"]
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    (epp,) = dep["spec"]["template"]["spec"]["containers"]
    assert port["targetPort"] in {p["name"] for p in epp["ports"]}
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == _kind(docs, "ServiceAccount")["metadata"]["name"]
    ref_role = _kind(docs, "RoleBinding")["roleRef"]["name"]
    rules = {(g, r) for rule in _kind(docs, "Role")["rules"] if _kind(docs, "Role")["metadata"]["name"] == ref_role
             for g in rule["apiGroups"] for r in rule["resources"] if "watch" in rule["verbs"]}
    assert {("inference.networking.k8s.io", "inferencepools"), ("", "pods")} <= rules


METRIC_FLAGS = ["total-queued-requests-metric", "total-running-requests-metric", "kv-cache-usage-percentage-metric",
                "cache-info-metric"]


@pytest.mark.parametrize("flag", METRIC_FLAGS)
def test_picker_reads_gauges_kvserve_exports(flag):
    """Each of the picker's metrics names a kvserve gauge by labels the gauge has; a `backend` selector names the
    Deployment's KV_BACKEND (the picker reads one series: that backend's)."""
    name, labels = _metric_spec(_epp_args()[flag])
    exported = _exported()
    assert name in exported, f"{flag}: {name} is not a metric of server/metrics.py"
    kind, label_names = exported[name]
    assert kind == "gauge" and set(labels) <= label_names, (flag, kind, label_names)
    (server,) = yaml.safe_load((K8S / "deployment.yaml").read_text())["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in server["env"]}
    if "backend" in label_names:  # summed over the backend label by no one: the selector must name the served one
        assert labels.get("backend") == env["KV_BACKEND"], (flag, labels)


@pytest.fixture(scope="module")
def deployment_scrape():
    """/metrics of an in-process kvserve with the Deployment's KV_BACKEND, MAX_BATCH_SIZE and MAX_CONCURRENT_REQUESTS
    on the bundled model, as the picker parses it: {name: [(labels, value)]} (counters with ``_total``)."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from server.app import create_app
    from server.config import load_settings
    from tests.conftest import MODEL_DIR

    (server,) = yaml.safe_load((K8S / "deployment.yaml").read_text())["spec"]["template"]["spec"]["containers"]
    env = {e["name"].lower(): e["value"] for e in server["env"]
           if e["name"] in ("KV_BACKEND", "KV_BACKENDS", "KV_BLOCK_SIZE", "MAX_BATCH_SIZE", "MAX_CONCURRENT_REQUESTS")}
    app = create_app(load_settings(model_id=str(MODEL_DIR), **env), load_in_background=False)
    with TestClient(app) as client:
        text = client.get("/metrics").text
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


@pytest.mark.parametrize("flag", METRIC_FLAGS)
def test_each_picker_spec_selects_one_series_of_a_live_scrape(deployment_scrape, flag):
    """What the picker will read: exactly one series of a real kvserve's /metrics matches each spec (more would
    leave the choice to the order of the exposition)."""
    name, labels = _metric_spec(_epp_args()[flag])
    matching = [(lab, v) for lab, v in deployment_scrape.get(name, []) if labels.items() <= lab.items()]
    assert len(matching) == 1, (flag, deployment_scrape.get(name))
    if flag == "cache-info-metric":
        (lab, value), = matching
        assert value == 1 and int(lab["block_size"]) > 0 and lab["prefix_caching"] == "true", lab


def test_prefix_scorer_block_size_is_kvserves(deployment_scrape):
    """The prefix scorer's fall-back block (characters, 4 per token) is the block size the picker will read from
    the cache-info series, so that it hashes alike before and after its first scrape."""
    cm = _kind(_docs(POOL_DIR / "epp.yaml"), "ConfigMap")
    config_file = _epp_args()["config-file"]
    assert config_file.startswith("/config/")
    cfg = yaml.safe_load(cm["data"][config_file.removeprefix("/config/")])
    plugins = {p.get("name", p["type"]): p for p in cfg["plugins"]}
    for profile in cfg["schedulingProfiles"]:
        assert {r["pluginRef"] for r in profile["plugins"]} <= plugins.keys()
    name, labels = _metric_spec(_epp_args()["cache-info-metric"])
    (lab, _), = [(lab, v) for lab, v in deployment_scrape[name] if labels.items() <= lab.items()]
    params = plugins["prefix-cache-scorer"]["parameters"]
    assert params["autoTune"] is True and params["blockSize"] == 4 * int(lab["block_size"])
