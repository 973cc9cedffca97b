"""The quality budget (``KV_QUALITY_BUDGET``, :mod:`server.quality_budget`) on the reference model: the price is
KL divergence against ``full`` through the backend's cache path, the search picks the most compressive setting
within the budget, an explicit setting is kept and priced, and the server reports all of it in ``/info`` and its
start-up log. (The same on the real pretrained model: tests/test_real_model.py.)"""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from cache_backends.base import ModelGeometry
from cache_backends.registry import create
from server.config import ConfigError, load_settings
from server.quality_budget import SEARCH_HEADROOM, Choice, Price, Scorer, candidates, choose, ppl_increase
from tests.conftest import RunningServer, fits


@pytest.fixture(scope="module")
def setup(ref_model):
    from cache_backends.calibration import calibration_ids

    model, tok = ref_model
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    ids = calibration_ids(model, tok, max_tokens=4096)
    return model, geometry, ids, Scorer(model, geometry, ids, windows=2, window=384, prefix=128)


def test_full_costs_nothing_and_int8_almost_nothing(setup):
    model, geometry, ids, scorer = setup
    assert scorer.price(create("full", geometry)).kl == pytest.approx(0.0, abs=1e-9)
    int8 = scorer.price(create("int8", geometry))
    assert 0 < int8.kl < 1e-3 and int8.tokens == 2 * 256
    assert int8.ppl_increase_pct == pytest.approx(100 * math.expm1(int8.kl))


def test_the_search_takes_the_most_compressive_rank_within_the_budget(setup):
    model, geometry, ids, scorer = setup
    backend, choice = choose("mla", geometry, {}, set(), model, ids, fits(model), scorer, 0.5)
    assert choice.searched == "rank" and choice.within_budget and not choice.explicit
    ranks = candidates("mla", "rank", geometry, {})
    chosen = backend.params()["rank"]
    assert chosen in ranks
    priced = {int(t["spec"].split("rank=")[1]): t["ppl_increase_pct"] for t in choice.tried}
    assert priced[chosen] <= 0.5 * SEARCH_HEADROOM
    smaller = [r for r in ranks if r < chosen]
    if smaller:  # the next rank down was priced and is over the budget's searched share
        assert priced[smaller[-1]] > 0.5 * SEARCH_HEADROOM
    # a tighter budget never chooses fewer bytes
    tight, tight_choice = choose("mla", geometry, {}, set(), model, ids, fits(model), scorer, 0.01)
    assert tight.params()["rank"] >= chosen and tight_choice.within_budget


def test_dca_reuses_the_most_layers_its_budget_allows(setup):
    model, geometry, ids, scorer = setup
    backend, choice = choose("dca", geometry, {}, set(), model, ids, fits(model), scorer, 1.0)
    assert choice.searched == "threshold" and choice.within_budget
    assert backend.expected_reuse_layers() and backend.threshold in backend.served_similarity.values()
    lower = [t for t in choice.tried if float(t["spec"].split("threshold=")[1].split(",")[0]) < backend.threshold]
    assert all(t["ppl_increase_pct"] > SEARCH_HEADROOM for t in lower)  # every lower threshold tried: over


def test_an_explicit_setting_is_kept_and_warned_about_when_over(setup):
    model, geometry, ids, scorer = setup
    backend, choice = choose("gqa", geometry, {"groups": 1, "method": "mean"}, {"groups", "method"}, model, ids,
                             fits(model), scorer, 1.0)
    assert backend.params()["groups"] == 1 and choice.explicit and choice.searched is None
    assert not choice.within_budget and "over the quality budget of +1%" in choice.message
    assert f"+{choice.price.ppl_increase_pct:.2f}% perplexity" in choice.message


def test_no_budget_prices_nothing_and_keeps_the_defaults(setup):
    model, geometry, ids, _ = setup
    backend, choice = choose("mla", geometry, {}, set(), model, ids, fits(model), None, None)
    assert backend.params()["rank"] == 2 * geometry.num_key_value_heads * geometry.head_dim // 8  # the fixed default
    assert choice.price is None and choice.tried == [] and choice.within_budget


def test_saves_nothing_is_a_share_of_full():
    price = Price(kl=0.0, ppl_increase_pct=0.0, ppl_change_pct=0.0, tokens=1)
    assert Choice("gqa", "gqa:groups=8", 1.0, price, 16384, 16384, searched="groups").saves_nothing
    assert not Choice("mla", "mla:rank=448", 1.0, price, 14336, 16384, searched="rank").saves_nothing
    assert Choice("dca", "dca", 1.0, price, 16000, 16384).as_dict()["saves_nothing"] is True
    assert not Choice("elastic", "elastic", 1.0, price, 16384, 16384).saves_nothing  # its size is a range


def test_ppl_increase_is_exp_of_the_kl():
    assert ppl_increase(0.0) == 0.0 and ppl_increase(math.log(1.01)) == pytest.approx(1.0)


@pytest.mark.parametrize("value,expected", [("off", None), ("none", None), ("", None), ("2.5", 2.5), ("0", 0.0)])
def test_the_setting(monkeypatch, value, expected):
    monkeypatch.setenv("KV_QUALITY_BUDGET", value)
    assert load_settings().kv_quality_budget == expected


@pytest.mark.parametrize("value", ["-1", "lots", "nan"])
def test_a_bad_budget_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv("KV_QUALITY_BUDGET", value)
    with pytest.raises(ConfigError, match="KV_QUALITY_BUDGET"):
        load_settings()


def test_only_explicit_options_are_kept_from_the_search(monkeypatch):
    monkeypatch.setenv("KV_MLA_RANK", "32")
    monkeypatch.setenv("KV_INT4_ROTATE", "false")
    s = load_settings()
    assert s.explicit_options("mla+int4") == {"rank", "rotate"}
    assert s.explicit_options("gqa") == set()


@pytest.mark.parametrize("engine_process", ["true", "false"])
def test_the_server_reports_its_choice_and_a_setting_over_the_budget(engine_process):
    """In both engine modes: the core in its own process (the default) rebuilt its settings with every option
    given, so it searched nothing (mla's rank and int4's rotation here; gqa's groups at +424% on SmolLM2)."""
    server = RunningServer({"KV_BACKEND": "gqa", "KV_BACKENDS": "full,int8,int4,mla", "KV_GQA_GROUPS": "1",
                            "KV_GQA_METHOD": "mean", "ENGINE_PROCESS": engine_process, "LOG_LEVEL": "info"})
    try:
        info = httpx.get(server.url + "/info", timeout=10).json()
    finally:
        server.stop()
    log = server.proc.stdout.read()
    quality = info["kv_quality"]
    assert info["kv_quality_budget_pct"] == 1.0 and set(quality) == {"gqa", "full", "int8", "int4", "mla"}
    for name, axis in [("int4", "rotate"), ("mla", "rank")]:
        assert quality[name]["searched"] == axis and not quality[name]["explicit"], quality[name]
        assert quality[name]["within_budget"] is True
        assert f"kvserve.budget: {name}: {quality[name]['spec']}: chosen by the quality budget of +1%" in log
    assert quality["gqa"]["explicit"] and quality["gqa"]["within_budget"] is False
    assert "over the quality budget" in quality["gqa"]["message"]
    assert quality["int8"]["within_budget"] is True and quality["int8"]["price"]["kl"] < 1e-3
    assert quality["full"]["price"] is None
    assert "WARNING kvserve.budget: gqa: gqa:groups=1,method=mean: over the quality budget of +1%" in log
