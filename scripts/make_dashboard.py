"""Write deploy/grafana/dashboards/kvserve.json (the Grafana dashboard) from the panel list below and
the metrics kvserve's backends declare (`BackendDecl.metrics`).

    python scripts/make_dashboard.py           # write the JSON
    python scripts/make_dashboard.py --check   # exit 1 when the committed JSON differs from the generated one

The dashboard is built with Grafana's typed SDK (`grafana-foundation-sdk`, pinned in constraints.txt to
the release for the Grafana version in deploy/docker-compose.yml), so its JSON follows Grafana's schema
rather than a hand-written dict. Every panel sets its unit; every expression is checked against a real
Prometheus by tests/test_prometheus.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
from grafana_foundation_sdk.models.dashboard import DataSourceRef

from cache_backends.catalog import declarations, origin

OUT = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dashboards" / "kvserve.json"
# The data source provisioned by deploy/grafana/provisioning/datasources/prometheus.yml.
DATASOURCE = DataSourceRef(type_val="prometheus", uid="prometheus")


def quantiles(metric: str, qs=(0.5, 0.95, 0.99)) -> list[tuple[str, str]]:
    """(PromQL, legend) per quantile of histogram `metric`, split by backend."""
    return [(f"histogram_quantile({q}, sum by (le, backend) (rate({metric}_bucket[1m])))", f"p{int(q * 100)} {{{{backend}}}}")
            for q in qs]


# (title, Grafana unit id, [(PromQL expression, legend format)]), laid out two per row.
PANELS = [
    ("Time to first token (p50/p95/p99)", "s", quantiles("kvserve_time_to_first_token_seconds")),
    ("Time per output token (p50/p95/p99)", "s", quantiles("kvserve_time_per_output_token_seconds")),
    ("Inter-token latency (p50/p95/p99)", "s", quantiles("kvserve_inter_token_latency_seconds")),
    ("Generated tokens / s", "suffix: tok/s", [("sum by (backend) (rate(kvserve_generation_tokens_total[1m]))",
                                                 "{{backend}}")]),
    ("Requests running / waiting", "short", [("sum by (backend) (kvserve_requests_running)", "running {{backend}}"),
                                             ("sum by (backend) (kvserve_requests_waiting)", "waiting {{backend}}")]),
    ("KV cache bytes (live sequences)", "bytes", [("sum by (backend) (kvserve_kv_cache_bytes)", "{{backend}}")]),
    ("KV cache bytes per token", "bytes", [("max by (backend) (kvserve_kv_cache_bytes_per_token)", "{{backend}}")]),
    ("Per-request KV bytes at peak (p50/p95)", "bytes", quantiles("kvserve_request_kv_cache_bytes", (0.5, 0.95))),
    ("Request outcomes by finish reason", "reqps", [(
        "sum by (backend, finish_reason) (rate(kvserve_requests_total[1m]))", "{{finish_reason}} {{backend}}")]),
    ("End-to-end latency and queue time (p95)", "s", [
        ("histogram_quantile(0.95, sum by (le, backend) (rate(kvserve_e2e_request_latency_seconds_bucket[1m])))",
         "e2e p95 {{backend}}"),
        ("histogram_quantile(0.95, sum by (le, backend) (rate(kvserve_request_queue_time_seconds_bucket[1m])))",
         "queue p95 {{backend}}")]),
]




def backend_panels() -> list[tuple[str, str, list[tuple[str, str]]]]:
    """A panel per metric that kvserve's own backends declare (:attr:`cache_backends.declaration.BackendDecl.metrics`,
    plug-ins left out so the committed JSON does not depend on what is installed): a gauge summed by backend, a
    counter's rate per second over 5 minutes."""
    found = []
    for name, decl in declarations().items():
        if not origin(name).startswith("cache_backends/"):
            continue
        for m in decl.metrics:
            if m.kind == "gauge":
                found.append((m.panel_title, "short", [(f"sum by (backend) ({m.name})", "{{backend}}")]))
            else:
                found.append((f"{m.panel_title} / s", "suffix: /s",
                              [(f"sum by (backend) (rate({m.name}_total[5m]))", "{{backend}}")]))
    return found


def panel(i: int, title: str, unit: str, targets: list[tuple[str, str]]) -> timeseries.Panel:
    """Time-series panel `i` (0-based) in a grid of 12-wide, 8-high cells, two per row."""
    p = (timeseries.Panel().id(i + 1).title(title).unit(unit).datasource(DATASOURCE).height(8).span(12)
         .legend(common.VizLegendOptions().display_mode(LegendDisplayMode.LIST)
                 .placement(LegendPlacement.BOTTOM).show_legend(True)))
    for j, (expr, legend) in enumerate(targets):
        p = p.with_target(prometheus.Dataquery().ref_id(chr(65 + j)).expr(expr).legend_format(legend)
                          .datasource(DATASOURCE))
    return p


def dashboard_json() -> dict:
    """The dashboard as Grafana's JSON model (a dict): :data:`PANELS`, then :func:`backend_panels`."""
    d = (dashboard.Dashboard("kvserve").uid("kvserve").tags(["kvserve", "llm", "kv-cache"]).refresh("5s")
         .time("now-15m", "now"))
    for i, p in enumerate(PANELS + backend_panels()):
        d = d.with_panel(panel(i, *p))
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(d.build()))


def render() -> str:
    return json.dumps(dashboard_json(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    text = render()
    if sys.argv[1:] == ["--check"]:
        same = OUT.exists() and OUT.read_text() == text
        print(f"{OUT} is {'up to date' if same else 'stale: run python scripts/make_dashboard.py'}")
        sys.exit(0 if same else 1)
    OUT.write_text(text)
    print(f"wrote {OUT}")
