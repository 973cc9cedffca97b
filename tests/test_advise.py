"""`kvserve advise`: fits the budget, ranks by measured quality then TPOT, says why."""

import argparse
import json

import pytest

from server.advise_cli import advise, parse_bytes, rows_from_estimate


def row(spec, bpt, ppl, tpot):
    return {"spec": spec, "backend": spec.split(":")[0], "bytes_per_token": bpt, "ppl_change_pct": ppl,
            "tpot": {1024: tpot}, "agreement": None}


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("512M") == 512 * 2**20 and parse_bytes("1000") == 1000


@pytest.mark.parametrize("text", ["infGiB", "1e400", "nanGiB", "-5GiB", "abc", "0"])
def test_a_size_that_is_not_a_finite_positive_number_is_refused_in_one_line(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected a size"):
        parse_bytes(text)


def test_ranks_fitting_settings_by_quality_then_latency():
    rows = [row("full", 1000, 0.0, 0.010), row("int8", 400, 0.2, 0.012), row("mla:rank=64", 150, 0.5, 0.011),
            row("gqa:groups=2", 250, 30.0, 0.009)]
    ranked = advise(rows, context=1000, concurrency=2, budget=1_000_000, tpot_target=None)
    assert [r["spec"] for r in ranked if r["fits"]] == ["int8", "mla:rank=64", "gqa:groups=2"]
    assert not ranked[-1]["fits"] and ranked[-1]["spec"] == "full"
    assert all(r["reason"] for r in ranked)
    slow = advise(rows, context=1000, concurrency=2, budget=1_000_000, tpot_target=0.0115)
    assert [r["spec"] for r in slow if r["fits"]] == ["mla:rank=64", "gqa:groups=2", "int8"]


def test_estimator_only_mode_uses_the_sums():
    rows = rows_from_estimate("llama-2-7b", "fp16", 4096, ["full", "mla:rank=512,rope_dim=64"])
    assert rows[0]["bytes_per_token"] == 16384 * 32 and rows[1]["bytes_per_token"] == 1152 * 32
    ranked = advise(rows, context=4096, concurrency=1, budget=2**30, tpot_target=None)
    assert [r["fits"] for r in ranked] == [True, False]
    assert "latent" in ranked[0]["reason"]
    json.dumps([{k: v for k, v in r.items() if k != "rank_key"} for r in ranked])


def test_int4_backends_have_a_reason():
    """int4 and its compositions get advise's reason like int8's (they printed an empty one)."""
    from server.advise_cli import why

    assert "4-bit" in why("int4", 1024, 1, 0.5, False)
    assert why("gqa+int4", 1024, 1, 0.5, False) == why("gqa+int8", 1024, 1, 0.5, False) != ""
    assert why("dca+int4", 1024, 1, 0.5, False).startswith("two savings")


def measured(spec, bpt, ppl, agreement, tpot=0.010):
    return {**row(spec, bpt, ppl, tpot), "agreement": agreement}


def test_settings_outside_the_quality_bound_rank_after_those_within():
    """mla+int8 ranked first at a greedy agreement of 0.675 (perplexity +0.01%), its agreement never weighed:
    a setting under --min-agreement or over --max-ppl-increase comes after every fitting one within both."""
    rows = [measured("mla+int8:rank=64", 100, 0.01, 0.675), measured("int8", 400, 0.2, 1.0),
            measured("dca+int8", 300, -0.1, 0.988), measured("int4", 200, 1.5, 0.97),
            measured("full", 1000, 0.0, 1.0)]
    ranked = advise(rows, context=1000, concurrency=1, budget=500_000, tpot_target=None)
    assert [r["spec"] for r in ranked if r["fits"]] == ["dca+int8", "int8", "mla+int8:rank=64", "int4"]
    quality = {r["spec"]: r["quality_ok"] for r in ranked}
    assert quality == {"dca+int8": True, "int8": True, "mla+int8:rank=64": False, "int4": False, "full": True}
    reasons = {r["spec"]: r["reason"] for r in ranked}
    assert "greedy agreement 0.675 (under the bound, 0.9)" in reasons["mla+int8:rank=64"]
    assert "perplexity +1.50% (over the bound, +1%)" in reasons["int4"]
    assert "greedy agreement 1.000," in reasons["int8"] and "bound" not in reasons["int8"]
    # looser bounds: ranked by perplexity change again
    loose = advise(rows, context=1000, concurrency=1, budget=500_000, tpot_target=None, max_ppl_increase=2.0,
                   min_agreement=0.5)
    assert [r["spec"] for r in loose if r["fits"]] == ["dca+int8", "mla+int8:rank=64", "int8", "int4"]


def test_unmeasured_quality_is_not_held_against_a_setting():
    rows = rows_from_estimate("llama-2-7b", "fp16", 4096, ["full", "int8"])
    assert all(r["quality_ok"] for r in advise(rows, context=4096, concurrency=1, budget=2**31, tpot_target=None))


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "0", "-1", "abc"])
def test_a_tpot_target_that_is_not_a_finite_positive_number_is_refused(text):
    """``--tpot-target nan`` was taken: nan compares false with every TPOT, so no setting was ever over it."""
    from server.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["advise", "--context", "512", "--memory-budget", "1GiB", "--tpot-target", text])
    assert exit_.value.code == 2
    args = build_parser().parse_args(["advise", "--context", "512", "--memory-budget", "1GiB", "--tpot-target", "0.05"])
    assert args.tpot_target == 0.05


def test_without_a_bench_each_setting_says_its_price_or_not_priced(model_dir, tmp_path, monkeypatch, capsys):
    """Sizes alone made mla's 8x look attractive: without --bench each line gives the quality budget's price from
    the calibration cache, or "not priced"; a price over --max-ppl-increase is outside the quality bound."""
    from cache_backends.estimate import Shape, default_params
    from server.cli import main
    from tests.test_estimate import write_price

    rank = default_params(Shape.from_config(json.loads((model_dir / "config.json").read_text())), "mla")["rank"]
    write_price(tmp_path, model_dir, "int8:group_size=32,residual=32", 0.02)
    write_price(tmp_path, model_dir, f"mla:rank={rank}", 240.0)
    monkeypatch.setenv("KV_CALIBRATION_CACHE_DIR", str(tmp_path))
    rows = rows_from_estimate(str(model_dir), "fp32", 512, ["full", "int8", "mla", "gqa"])
    assert [r["price_pct"] for r in rows] == [0.0, 0.02, 240.0, None]
    ranked = {r["spec"]: r for r in advise(rows, context=512, concurrency=1, budget=2**30, tpot_target=None)}
    assert "price +0.02% perplexity" in ranked["int8"]["reason"]
    assert not ranked["mla"]["quality_ok"]
    assert "price +240.00% perplexity (over the bound, +1%)" in ranked["mla"]["reason"]
    assert ranked["gqa"]["reason"].endswith("not priced") and ranked["gqa"]["quality_ok"]
    assert main(["advise", "--model", str(model_dir), "--context", "512", "--memory-budget", "1GiB", "--backends",
                 "int8", "mla"]) == 0
    out = capsys.readouterr().out
    assert "quality priced from the calibration cache" in out.splitlines()[0]
    assert " mla (outside the quality bound): " in out


def test_without_a_bench_the_budgets_agreement_is_held_to_min_agreement(model_dir, tmp_path, monkeypatch):
    """The quality budget's second figure, its top-1 agreement with full, comes from the calibration cache with
    the price and is held to --min-agreement as the price is to --max-ppl-increase: int4 within the price but
    under the agreement bound is outside the quality bound; an entry written before the agreement was measured
    gives none, and nothing is held against it."""
    from tests.test_estimate import write_price

    write_price(tmp_path, model_dir, "int8:group_size=32,residual=32", 0.02, agreement=0.998)
    write_price(tmp_path, model_dir, "int4:group_size=32,residual=32", 0.4, agreement=0.85)
    write_price(tmp_path, model_dir, "int8:group_size=32,residual=32,value_bits=4", 0.2)  # no agreement
    monkeypatch.setenv("KV_CALIBRATION_CACHE_DIR", str(tmp_path))
    rows = rows_from_estimate(str(model_dir), "fp32", 512, ["full", "int8", "int4", "int8:value_bits=4"])
    assert [(r["price_pct"], r["price_agreement"]) for r in rows] == [(0.0, 1.0), (0.02, 0.998), (0.4, 0.85),
                                                                        (0.2, None)]
    ranked = {r["spec"]: r for r in advise(rows, context=512, concurrency=1, budget=2**30, tpot_target=None)}
    assert ranked["int8"]["reason"].endswith("price +0.02% perplexity, top-1 agreement 0.998")
    assert ranked["int8"]["quality_ok"]
    assert not ranked["int4"]["quality_ok"]
    assert "price +0.40% perplexity, top-1 agreement 0.850 (under the bound, 0.9)" in ranked["int4"]["reason"]
    k8v4 = next(r for s, r in ranked.items() if s.startswith("int8:") and "value_bits=4" in s)
    assert k8v4["quality_ok"] and "agreement" not in k8v4["reason"]
    looser = {r["spec"]: r for r in advise(rows, 512, 1, 2**30, None, min_agreement=0.8)}
    assert looser["int4"]["quality_ok"] and "bound" not in looser["int4"]["reason"]


def test_min_agreement_flags_the_setting_whose_own_price_misses_it(model_dir, tmp_path, monkeypatch, capsys):
    """int4 with and without its rotation size alike: the unrotated int4 was given the rotated one's price and
    agreement (the lowest price of the size), so --min-agreement flagged neither and int4:rotate=true was not priced.
    Each now gets its own, and the one under the bound is the one flagged."""
    from server.cli import main
    from tests.test_estimate import write_price

    write_price(tmp_path, model_dir, "int4:group_size=32,residual=32", 0.9, agreement=0.85)
    write_price(tmp_path, model_dir, "int4:group_size=32,residual=32,rotate=True", 0.5, agreement=0.95)
    monkeypatch.setenv("KV_CALIBRATION_CACHE_DIR", str(tmp_path))
    rows = rows_from_estimate(str(model_dir), "fp32", 512, ["int4", "int4:rotate=true"])
    assert [(r["price_pct"], r["price_agreement"]) for r in rows] == [(0.9, 0.85), (0.5, 0.95)]
    assert main(["advise", "--model", str(model_dir), "--dtype", "fp32", "--context", "512", "--memory-budget",
                 "1GiB", "--backends", "int4", "int4:rotate=true"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(" 1. int4:rotate=true: ") and lines[1].endswith("top-1 agreement 0.950")
    assert lines[2].startswith(" 2. int4 (outside the quality bound): ")
    assert lines[2].endswith("price +0.90% perplexity, top-1 agreement 0.850 (under the bound, 0.9)")


def test_min_agreement_off_holds_no_agreement_against_a_setting():
    """--min-agreement off (as KV_QUALITY_MIN_AGREEMENT's off): no agreement bound, measured or priced."""
    rows = [{**row("int4", 100, 0.5, 0.02), "agreement": 0.5},
            {**row("mla", 50, None, 0.02), "price_pct": 0.5, "price_agreement": 0.4}]
    ranked = {r["spec"]: r for r in advise(rows, 1024, 1, 2**30, None, min_agreement=None)}
    assert ranked["int4"]["quality_ok"] and ranked["mla"]["quality_ok"]
    assert "bound" not in ranked["int4"]["reason"] + ranked["mla"]["reason"]
    assert not any(r["quality_ok"] for r in advise(rows, 1024, 1, 2**30, None))  # the default bound, 0.9


def test_a_recorded_spec_is_echoed_with_the_server_s_booleans():
    """A results.json recorded before specs echoed ``true``/``false`` names ``int4:...,rotate=True``; advise, the
    tables rendered from recorded rows and the docs print it as the server echoes it, ``rotate=true``."""
    import re
    from argparse import Namespace

    from bench.budget import table
    from cache_backends.spec import echo_recorded, format_spec, parse_spec
    from server.advise_cli import rows_from_bench
    from tests.conftest import REPO

    recorded = "int4:group_size=32,residual=32,rotate=True"
    assert echo_recorded(recorded) == format_spec(*parse_spec(recorded)) == "int4:group_size=32,residual=32,rotate=true"
    assert echo_recorded("int8:rotate=False (every token kept)") == "int8:rotate=false (every token kept)"
    specs = [r["spec"] for r in rows_from_bench(str(REPO / "docs" / "bench" / "real" / "results.json"))]
    assert "int4:group_size=32,residual=32,rotate=true" in specs and not any("True" in s for s in specs)
    row = {"spec": "int4:rotate=True", "budget_bytes": 1, "output_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0,
           "ttft_p50_s": 0.0, "ttft_p95_s": 0.0, "tpot_p50_s": 0.0, "tpot_p95_s": 0.0, "most_running": 1,
           "preemptions": 0, "peak_kv_allocated_bytes": 1}
    args = Namespace(streams=1, prompt_tokens=1, new_tokens=1, budget_seqs=1, context=1)
    assert "| int4:rotate=true |" in table([row], args)
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    python_booleans = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in pages
                       for m in re.finditer(r"\b[a-z_]+=(True|False)\b", p.read_text())]
    assert not python_booleans
