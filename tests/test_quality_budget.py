"""The quality budget (``KV_QUALITY_BUDGET``, :mod:`server.quality_budget`) on the reference model: the price is
KL divergence against ``full`` through the backend's cache path, with the top-1 agreement of the same pass beside
it, the search picks the most compressive setting within the budget (and ``KV_QUALITY_MIN_AGREEMENT``, when set),
an explicit setting is kept and priced, and the server reports all of it in ``/info`` and its start-up log. (The
same on the real pretrained model: tests/test_real_model.py.)"""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from cache_backends.geometry import ModelGeometry
from cache_backends.registry import create
from cache_backends.spec import format_spec
from server.config import ConfigError, load_settings
from server.quality_budget import SEARCH_HEADROOM, Choice, candidates, choose
from server.quality_price import PRICE_VERSION, Price, Scorer, ppl_increase, top1_agreement
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


def test_top1_agreement_is_the_share_of_positions_whose_argmax_is_the_references():
    reference = torch.randn(3, 40, 50)
    assert top1_agreement(reference, reference.clone()) == 1.0
    assert top1_agreement(reference, torch.log_softmax(reference, -1)) == 1.0  # logits or log-probabilities alike
    flipped = reference.clone()
    top = reference.argmax(-1)
    for w, pos in [(0, 0), (0, 39), (1, 7), (2, 20), (2, 21), (2, 22)]:  # 6 of 120 positions
        flipped[w, pos, (top[w, pos] + 1) % 50] = reference[w, pos].max() + 1.0
    assert top1_agreement(reference, flipped) == pytest.approx(1 - 6 / 120)
    assert top1_agreement(reference, -reference) == 0.0  # every argmax moved to the least likely token


def test_the_price_carries_the_agreement_of_its_own_pass(setup, monkeypatch):
    """The scorer holds both distributions: the agreement is counted from the same log-probabilities as the KL
    (no other forward pass), full agrees with itself, and a backend whose top token differs at known positions
    agrees on the rest."""
    model, geometry, ids, scorer = setup
    assert scorer.price(create("full", geometry)).agreement == 1.0
    int8 = scorer.price(create("int8", geometry))
    assert 0.99 <= int8.agreement <= 1.0
    ref_logp, _ = scorer.reference()
    flipped = ref_logp.clone()
    positions = [(0, 0), (0, 100), (1, 5), (1, 255)]
    for w, pos in positions:
        flipped[w, pos] = flipped[w, pos].roll(1)  # the top token moves one place along the vocabulary
    calls = []
    monkeypatch.setattr(scorer, "_logprobs", lambda backend: calls.append(backend) or flipped)
    price = scorer.price(create("int8", geometry))
    assert len(calls) == 1 and price.tokens == 2 * 256
    assert price.agreement == pytest.approx(1 - len(positions) / price.tokens)
    assert price.kl > 0


def test_the_agreement_bound_rejects_a_rank_and_the_search_takes_a_larger_one(setup):
    """At budget +0.5% the smallest rank within it flips some of full's top tokens (about 2% on this model); with
    KV_QUALITY_MIN_AGREEMENT at 1 the search goes on to the first larger rank that flips none, and every rank
    below it that it priced was within the price but under the agreement."""
    model, geometry, ids, scorer = setup
    loose, loose_choice = choose("mla", geometry, {}, set(), model, ids, fits(model), scorer, 0.5)
    assert loose_choice.price.agreement < 1.0 and loose_choice.within_budget  # no bound: reported, not held
    backend, choice = choose("mla", geometry, {}, set(), model, ids, fits(model), scorer, 0.5, min_agreement=1.0)
    chosen = backend.params()["rank"]
    assert chosen > loose.params()["rank"] and choice.price.agreement == 1.0
    assert choice.within_budget and choice.min_agreement == 1.0 and choice.as_dict()["min_agreement"] == 1.0
    tried = {int(t["spec"].split("rank=")[1]): t for t in choice.tried}
    below = [t for r, t in tried.items() if r < chosen]
    assert below and all(t["agreement"] < 1.0 for t in below)
    assert any(t["ppl_increase_pct"] <= 0.5 * SEARCH_HEADROOM for t in below)  # the price alone would take it
    assert "chosen by the quality budget of +0.5% and top-1 agreement 1:" in choice.message
    assert "top-1 agreement 1.000" in choice.message


@pytest.mark.parametrize("name,options,bound,missed", [
    ("int4", {"rotate": False}, 0.9999, "under the quality budget's top-1 agreement of 0.9999 (short by "),
    ("gqa", {"groups": 1, "method": "mean"}, 0.5,
     "over the quality budget of +1% and under its top-1 agreement of 0.5 (short by ")], ids=["int4", "gqa"])
def test_an_explicit_setting_under_the_agreement_bound_is_warned_about(setup, caplog, name, options, bound, missed):
    """int4 costs about +0.01% here but flips about 1% of full's top tokens: within the price, under the bound, it
    gets the warning a price over the budget gets; gqa at 1 group by mean pooling misses both."""
    model, geometry, ids, scorer = setup
    with caplog.at_level("INFO", logger="kvserve.budget"):
        backend, choice = choose(name, geometry, options, set(options), model, ids, fits(model), scorer, 1.0,
                                 min_agreement=bound)
    assert choice.explicit and choice.searched is None and not choice.within_budget
    assert choice.price.agreement < bound and missed in choice.message
    assert choice.agreement_shortfall == pytest.approx(bound - choice.price.agreement)
    assert f"(short by {choice.agreement_shortfall:.4f}) (explicit setting)" in choice.message
    assert f"top-1 agreement {choice.price.agreement:.3f}" in choice.message
    assert [r.levelname for r in caplog.records if r.name == "kvserve.budget"] == ["WARNING"]
    if name == "int4":
        assert choice.price.ppl_increase_pct <= 1.0 and choice.as_dict()["within_budget"] is False


def test_prices_are_cached_with_their_agreement(setup, tmp_path):
    """A cached price gives back the agreement it was measured with; an entry of the previous version, which has
    none, is not read back (the price is measured again)."""
    from cache_backends.calibration_cache import CalibrationCache

    model, geometry, ids, scorer = setup
    cached = Scorer(model, geometry, ids, CalibrationCache(tmp_path), windows=2, window=384, prefix=128)
    int4 = create("int4", geometry)
    old = {"kl": 9.0, "ppl_increase_pct": 900.0, "ppl_change_pct": 900.0, "tokens": 512}  # PRICE_VERSION 4's fields
    CalibrationCache(tmp_path).fetch("price", model, cached.ids, {"spec": format_spec("int4", int4.params()),
                                                                  "prefix": cached.prefix,
                                                                  "dtype": cached._dtype()},
                                     fit=lambda: ({"kl": torch.tensor([9.0])}, {"price": old}),
                                     load=lambda _, figures: figures, version=PRICE_VERSION - 1)
    first = cached.price(int4)
    assert first.ppl_increase_pct < 900 and first.agreement == scorer.price(int4).agreement < 1
    again = Scorer(model, geometry, ids, CalibrationCache(tmp_path), windows=2, window=384, prefix=128)
    assert again.price(int4) == first and [e.source for e in again.cache.events] == ["cache"]
    from cache_backends.calibration_cache import entries

    # the new entry records the dtype the model computed in (kvserve estimate shows it); the old one has none
    dtypes = sorted(str(e["figures"].get("dtype")) for e in entries(tmp_path, "price"))
    assert dtypes == sorted(["None", str(model.dtype).removeprefix("torch.")])


def test_a_cached_price_is_not_reused_for_other_windows_of_the_same_tokens(setup, tmp_path):
    """The windows' count and size are part of a price entry's key: 2 windows of 384 tokens and 3 of 256 hold the
    same 768 tokens of the calibration text's end with the same 128-token prefix, but score other positions (512
    and 384 tokens): the second is measured, not read back from the first's entry."""
    from cache_backends.calibration_cache import CalibrationCache

    model, geometry, ids, _ = setup
    two = Scorer(model, geometry, ids, CalibrationCache(tmp_path), windows=2, window=384, prefix=128)
    three = Scorer(model, geometry, ids, CalibrationCache(tmp_path), windows=3, window=256, prefix=128)
    assert two.ids == three.ids and two.prefix == three.prefix
    int8 = create("int8", geometry)
    assert two.price(int8).tokens == 512
    assert three.price(int8).tokens == 384 and [e.source for e in three.cache.events] == ["fitted"]


def test_a_cached_price_is_not_reused_in_another_dtype(setup, tmp_path):
    """The dtype the model computes in is part of a price entry's key: a price cached in float32 is measured again
    for the same weights in bfloat16 (whose KV and logits round differently), and each dtype's entry is read back
    by its own dtype only."""
    import copy

    from cache_backends.calibration_cache import CalibrationCache, entries

    model, geometry, ids, _ = setup
    half = copy.deepcopy(model).to(torch.bfloat16)
    half_geometry = ModelGeometry.from_config(half.config, torch.bfloat16)

    def scorer(m, g):
        return Scorer(m, g, ids, CalibrationCache(tmp_path), windows=1, window=256, prefix=128)

    full_precision = scorer(model, geometry)
    measured = full_precision.price(create("int4", geometry))
    bf16 = scorer(half, half_geometry)
    in_bf16 = bf16.price(create("int4", half_geometry))
    assert [e.source for e in bf16.cache.events] == ["fitted"]  # not float32's entry
    assert in_bf16 != measured
    assert sorted(e["figures"]["dtype"] for e in entries(tmp_path, "price")) == ["bfloat16", "float32"]
    for m, g, want in ((model, geometry, measured), (half, half_geometry, in_bf16)):
        again = scorer(m, g)
        assert again.price(create("int4", g)) == want and [e.source for e in again.cache.events] == ["cache"]


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
    price = Price(kl=0.0, ppl_increase_pct=0.0, ppl_change_pct=0.0, tokens=1, agreement=1.0)
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


@pytest.mark.parametrize("value,expected", [(None, None), ("", None), ("off", None), ("0.95", 0.95), ("1", 1.0)])
def test_the_agreement_bound_setting(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("KV_QUALITY_MIN_AGREEMENT", raising=False)
    else:
        monkeypatch.setenv("KV_QUALITY_MIN_AGREEMENT", value)
    assert load_settings().kv_quality_min_agreement == expected


@pytest.mark.parametrize("value", ["0", "1.01", "-0.5", "nan", "most"])
def test_a_bad_agreement_bound_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv("KV_QUALITY_MIN_AGREEMENT", value)
    with pytest.raises(ConfigError, match="invalid KV_QUALITY_MIN_AGREEMENT="):
        load_settings()


def test_an_agreement_bound_without_a_budget_is_refused(monkeypatch):
    monkeypatch.setenv("KV_QUALITY_MIN_AGREEMENT", "0.9")
    monkeypatch.setenv("KV_QUALITY_BUDGET", "off")
    with pytest.raises(ConfigError, match="KV_QUALITY_MIN_AGREEMENT bounds the quality budget's prices, and "
                                          "KV_QUALITY_BUDGET is off"):
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
    given, so it searched nothing (mla's rank and int4's rotation here; gqa's groups at +424% on SmolLM2). Each
    price carries its top-1 agreement, and the agreement bound reaches the core: gqa misses both bounds."""
    server = RunningServer({"KV_BACKEND": "gqa", "KV_BACKENDS": "full,int8,int4,mla", "KV_GQA_GROUPS": "1",
                            "KV_GQA_METHOD": "mean", "ENGINE_PROCESS": engine_process, "LOG_LEVEL": "info",
                            "KV_QUALITY_MIN_AGREEMENT": "0.5"})
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
    assert "WARNING kvserve.budget: gqa: gqa:groups=1,method=mean: over the quality budget of +1% and under its " \
           f"top-1 agreement of 0.5 (short by {quality['gqa']['agreement_shortfall']:.4f}) (explicit setting)" in log
    assert info["kv_quality_min_agreement"] == 0.5
    for name in ("gqa", "int8", "int4", "mla"):
        price = quality[name]["price"]
        assert quality[name]["min_agreement"] == 0.5 and 0 <= price["agreement"] <= 1
        assert f"+{price['ppl_increase_pct']:.2f}% perplexity, top-1 agreement {price['agreement']:.3f}" in log
        assert (price["agreement"] >= 0.5) == (name != "gqa")


class FixedScorer:
    """Prices each setting as ``table`` gives it by spec (``default`` otherwise): the search's choice, not a model's
    numbers, is what is checked."""

    def __init__(self, table: dict[str, tuple[float, float]], default: tuple[float, float]):
        self.table, self.default = table, default

    def price(self, backend) -> Price:
        pct, agreement = self.table.get(format_spec(backend.name, backend.params()), self.default)
        kl = math.log1p(pct / 100)
        return Price(kl=kl, ppl_increase_pct=pct, ppl_change_pct=pct, tokens=512, agreement=agreement)


def test_with_no_setting_within_the_agreement_bound_the_closest_to_it_is_served(setup, caplog):
    """int4 unrotated costs less but agrees less: with KV_QUALITY_MIN_AGREEMENT over both, the cheaper one was
    served, farther from the bound. The one with the highest agreement is, and the warning and /info say the bound is
    unmet and by how much. Without the bound, the cheaper one, as before."""
    model, geometry, ids, _ = setup
    plain = format_spec("int4", create("int4", geometry).params())
    rotated = format_spec("int4", create("int4", geometry, rotate=True).params())
    scorer = FixedScorer({plain: (0.1, 0.80), rotated: (0.2, 0.85)}, (0.0, 1.0))
    with caplog.at_level("INFO", logger="kvserve.budget"):
        backend, choice = choose("int4", geometry, {}, set(), model, ids, None, scorer, 1.0, min_agreement=0.9)
    assert choice.spec == rotated and not choice.within_budget
    assert choice.agreement_shortfall == pytest.approx(0.05) and choice.as_dict()["agreement_shortfall"] == 0.05
    assert "under the quality budget's top-1 agreement of 0.9 (short by 0.0500) (no setting within it; the highest " \
           "agreement of those tried: " in choice.message
    assert [r.levelname for r in caplog.records if r.name == "kvserve.budget"] == ["WARNING"]
    assert "(short by 0.0500)" in caplog.records[-1].getMessage()
    _, unbound = choose("int4", geometry, {}, set(), model, ids, None, scorer, 1.0)
    assert unbound.spec == plain and unbound.within_budget and unbound.as_dict()["agreement_shortfall"] is None


def test_a_bisection_with_no_setting_within_the_agreement_bound_serves_the_closest_tried(setup):
    """mla's bisection moved up at every step and served the last rank priced, whatever its agreement; with the
    bound set it serves the rank priced closest to it. Without the bound, still the last rank."""
    model, geometry, ids, _ = setup
    ranks = candidates("mla", "rank", geometry, {})
    spec = {r: format_spec("mla", create("mla", geometry, rank=r).params()) for r in ranks}
    # every rank within the price, none at the agreement bound; the one half way up the ladder closest to it
    scorer = FixedScorer({spec[ranks[(len(ranks) - 1) // 2]]: (0.1, 0.95)}, (0.1, 0.9))
    backend, choice = choose("mla", geometry, {}, set(), model, ids, fits(model), scorer, 1.0, min_agreement=0.99)
    tried = [t["spec"] for t in choice.tried]
    assert tried[0] == spec[ranks[(len(ranks) - 1) // 2]] and tried[-1] == spec[ranks[-1]]  # up at every step
    assert choice.spec == tried[0] and backend.params()["rank"] == ranks[(len(ranks) - 1) // 2]
    assert choice.as_dict()["agreement_shortfall"] == 0.04 and "(short by 0.0400)" in choice.message
    looser = FixedScorer({}, (5.0, 0.9))  # every rank over the price, no agreement bound: the last, as before
    backend, choice = choose("mla", geometry, {}, set(), model, ids, fits(model), looser, 1.0)
    assert backend.params()["rank"] == ranks[-1] and "over the quality budget of +1% (no setting within it)" \
        in choice.message


def test_a_boolean_spelled_either_way_is_one_spec_and_one_cached_price(setup, tmp_path):
    """``int4:rotate=TRUE`` and ``int4:rotate=true`` are one setting: echoed alike, in the spelling the docs and the
    ``KV_*`` settings use (``rotate=true``, never Python's ``True``), and priced once: the second is read back from
    the cache entry the first wrote, whose key is that canonical spec."""
    from cache_backends.calibration_cache import CalibrationCache, entries
    from cache_backends.spec import parse_spec

    model, geometry, ids, _ = setup
    upper, lower = (create(*parse_spec(s)[:1], geometry, **parse_spec(s)[1])
                    for s in ("int4:rotate=TRUE", "int4:rotate=true"))
    assert format_spec(upper.name, upper.params()) == format_spec(lower.name, lower.params()) \
        == "int4:group_size=32,residual=32,rotate=true"
    scorer = Scorer(model, geometry, ids, CalibrationCache(tmp_path), windows=2, window=384, prefix=128)
    first = scorer.price(upper)
    assert scorer.price(lower) == first and [e.source for e in scorer.cache.events] == ["fitted", "cache"]
    assert [e["params"]["spec"] for e in entries(str(tmp_path), "price")] == [format_spec("int4", lower.params())]
