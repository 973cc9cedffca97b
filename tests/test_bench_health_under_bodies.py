"""bench.health_under_bodies: its latency summary (the run itself is a benchmark)."""

from bench.health_under_bodies import stats


def test_stats_in_milliseconds():
    assert stats([0.001, 0.003, 0.002, 0.1]) == {"n": 4, "p50_ms": 2.5, "p99_ms": 100.0, "max_ms": 100.0}
