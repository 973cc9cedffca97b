"""Write deploy/grafana/dashboards/kvserve.json (the Grafana dashboard) from the panel list below.

    python scripts/make_dashboard.py

Every panel sets its unit; every expression is checked against a real Prometheus by
tests/test_prometheus.py.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dashboards" / "kvserve.json"


def quantiles(metric: str, qs=(0.5, 0.95, 0.99)) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le, backend) (rate({metric}_bucket[1m])))", f"p{int(q * 100)} {{{{backend}}}}")
            for q in qs]


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
    ("dca: reuse layers (live sequences)", "short", [("sum by (backend) (kvserve_dca_reuse_layers)", "{{backend}}")]),
    ("dca: fall-backs / s", "suffix: /s", [("sum by (backend) (rate(kvserve_dca_fallbacks_total[5m]))",
                                             "{{backend}}")]),
]


def panel(i: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    return {
        "id": i + 1, "type": "timeseries", "title": title,
        "datasource": {"type": "prometheus", "uid": "prometheus"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [{"refId": chr(65 + j), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "prometheus"}} for j, (expr, legend) in enumerate(targets)],
    }


def dashboard() -> dict:
    return {"uid": "kvserve", "title": "kvserve", "schemaVersion": 39, "version": 1, "refresh": "5s",
            "time": {"from": "now-15m", "to": "now"}, "tags": ["kvserve", "llm", "kv-cache"],
            "panels": [panel(i, *p) for i, p in enumerate(PANELS)]}


if __name__ == "__main__":
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {OUT}")
