"""bench.steady_arrivals: its arrival plan and its summary of the TTFTs (the run itself is a benchmark)."""

from bench import steady_arrivals as sa


def test_arrivals_are_planned_open_loop_in_time_order():
    plan = sa.arrivals(duration=10, short_every=2, long_every=5)
    assert plan == [(0, "long"), (1.0, "short"), (3.0, "short"), (5, "long"), (5.0, "short"), (7.0, "short"),
                    (9.0, "short")]


def test_summary_counts_timeouts_and_refusals_apart():
    s = sa.summary([0.1, 0.3, None, 0.2, "400 too long"])
    assert s == {"n": 5, "missing": 2, "p50_s": 0.2, "p95_s": 0.3, "max_s": 0.3, "errors": ["400 too long"]}
    assert sa.summary([None]) == {"n": 1, "missing": 1, "errors": []}


def test_bad_flags_are_refused_with_a_usage_line(capsys):
    import pytest

    for argv in (["--duration", "nan"], ["--short-tokens", "0"], ["--long-tokens", "100000000"],
                 ["--model", "/nonexistent"], ["--out", "/nonexistent/x.json"]):
        with pytest.raises(SystemExit) as e:
            sa.main(argv)
        assert e.value.code == 2, argv
        assert "error:" in capsys.readouterr().err
