"""bench.health_under_bodies: its latency summary (the run itself is a benchmark)."""

from bench.health_under_bodies import stats


def test_stats_in_milliseconds():
    assert stats([0.001, 0.003, 0.002, 0.1]) == {"n": 4, "p50_ms": 2.5, "p99_ms": 100.0, "max_ms": 100.0}


def test_bad_flags_are_refused_with_a_usage_line(capsys):
    import pytest

    from bench.health_under_bodies import main

    for argv in (["--every", "inf"], ["--every", "nan"], ["--max-tokens", "0"], ["--rounds", "100000000000"],
                 ["--ids", "100000000000"], ["--model", "/nonexistent"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        assert "error:" in capsys.readouterr().err
