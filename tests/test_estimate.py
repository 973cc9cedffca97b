"""`kvserve estimate` reproduces the known KV sums."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from cache_backends.estimate import PRESETS, estimate_rows
from server.quality_price import PRICE_VERSION
from tests.conftest import REPO

GiB, KiB = 2**30, 2**10


@pytest.mark.parametrize("seq_len,expected_gib", [(4096, (2, 16, 32)), (8192, (4, 32, 64)), (32768, (16, 128, 256))])
def test_llama2_7b_full_fp16(seq_len, expected_gib):
    rows = estimate_rows(PRESETS["llama-2-7b"], [("full", {})], [seq_len], [1, 8, 16], 2)
    assert all(r["bytes_per_token_per_layer"] == 16 * KiB for r in rows)
    assert [r["total_bytes"] / GiB for r in rows] == list(expected_gib)


def test_llama2_7b_gqa_and_mla():
    (gqa,) = estimate_rows(PRESETS["llama-2-7b"], [("gqa", {"groups": 8})], [4096], [1], 2)
    assert gqa["bytes_per_token_per_layer"] == 4 * KiB and gqa["total_bytes"] == 0.5 * GiB
    mla = estimate_rows(PRESETS["llama-2-7b"], [("mla", {"rank": 512, "rope_dim": 64})], [4096, 32768], [1], 2)
    assert all(r["bytes_per_token_per_layer"] == 1152 for r in mla)
    assert abs(mla[0]["total_bytes"] / GiB - 0.14) < 0.01 and abs(mla[1]["total_bytes"] / GiB - 1.1) < 0.05


def test_int8_counts_scales_and_residual_window():
    (row,) = estimate_rows(PRESETS["llama-2-7b"], [("int8", {"group_size": 32, "residual": 32})], [4096], [1], 2)
    hd = 32 * 128
    # 4096 = 32 residual + 127 groups of 32 + 32 more residual... r = 32 + (4096 - 32) % 32 = 32
    q = 4096 - 32
    expected = (2 * q * hd + (q // 32) * hd * 2 * 2 + q * 32 * 2 * 2 + 32 * 2 * hd * 2) / 4096
    assert row["bytes_per_token_per_layer"] == pytest.approx(expected)
    assert 0.5 * 16 * KiB < row["bytes_per_token_per_layer"] < 0.6 * 16 * KiB


def test_llama3_8b_and_deepseek_presets():
    (l3,) = estimate_rows(PRESETS["llama-3-8b"], [("full", {})], [4096], [1], 2)
    assert l3["bytes_per_token_per_layer"] == 4 * KiB
    (ds,) = estimate_rows(PRESETS["deepseek-v3"], [("mla", {})], [4096], [1], 2)
    assert ds["bytes_per_token_per_layer"] == (512 + 64) * 2


def test_cli_json_rows_and_config_path(model_dir):
    out = subprocess.run([sys.executable, "-m", "server.cli", "estimate", "--model", str(model_dir), "--dtype", "fp32",
                          "--seq-len", "1024", "--batch", "1", "--json", "full", "gqa:groups=2"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    rows = json.loads(out)
    assert set(rows[0]) == {"backend", "params", "seq_len", "batch", "bytes_per_token_per_layer", "total_bytes",
                            "price_pct", "price_dtype"}
    assert rows[0]["bytes_per_token_per_layer"] == 2 * 8 * 32 * 4
    assert rows[1]["bytes_per_token_per_layer"] == 2 * 2 * 32 * 4
    assert rows[0]["total_bytes"] == 2 * 8 * 32 * 4 * 1024 * 8


def test_compositions_in_the_estimator():
    shape = PRESETS["llama-2-7b"]
    (gi,) = estimate_rows(shape, [("gqa+int8", {"groups": 8})], [4096], [1], 2)
    (g,) = estimate_rows(shape, [("gqa", {"groups": 8})], [4096], [1], 2)
    assert 0.5 * g["bytes_per_token_per_layer"] < gi["bytes_per_token_per_layer"] < 0.6 * g["bytes_per_token_per_layer"]
    (mi,) = estimate_rows(shape, [("mla+int8", {"rank": 512, "rope_dim": 64})], [32768], [1], 2)
    assert 576 < mi["bytes_per_token_per_layer"] < 0.6 * 1152
    (d,) = estimate_rows(shape, [("dca+mla", {"reuse_fraction": 0.5, "rank": 512, "rope_dim": 64})], [4096], [1], 2)
    assert d["bytes_per_token_per_layer"] == 576 + 0.5 * 1152 * 32 / 4096  # + the reuse layers' 32-token window
    (d0,) = estimate_rows(shape, [("dca+mla", {"reuse_fraction": 0.5, "window": 0, "rank": 512, "rope_dim": 64})],
                          [4096], [1], 2)
    assert d0["bytes_per_token_per_layer"] == 576


def test_cli_without_specs_lists_every_backend_at_the_models_defaults():
    out = subprocess.run([sys.executable, "-m", "server.cli", "estimate", "--model", "deepseek-v3", "--seq-len", "4096",
                          "--batch", "1", "--json"], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    rows = {r["backend"]: r for r in json.loads(out.stdout)}
    # a natively-MLA model is served with full, mla or mla+int8 only (it hands its cache a latent)
    assert list(rows) == ["full", "mla", "mla+int8"]
    assert rows["mla"]["params"] == {"rank": 512, "rope_dim": 64} and rows["mla"]["bytes_per_token_per_layer"] == 1152
    assert rows["full"]["total_bytes"] == 128 * (192 + 128) * 2 * 4096 * 61


def test_cli_without_specs_lists_the_quantized_widths_and_elastic_too():
    out = subprocess.run([sys.executable, "-m", "server.cli", "estimate", "--model", "llama-2-7b", "--seq-len", "4096",
                          "--batch", "1", "--json"], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    rows = [(r["backend"], r["params"]) for r in json.loads(out.stdout)]
    assert [name for name, _ in rows] == ["full", "gqa", "mla", "int8", "int8", "int4", "elastic", "dca", "window",
                                          "snapkv", "gqa+int8", "mla+int8"]
    assert rows[4][1]["value_bits"] == 4 and rows[3][1].get("value_bits", 8) == 8
    assert rows[8][1] == {"sinks": 4, "window": 1024}  # the server's defaults (KV_WINDOW_SINKS, KV_WINDOW_SIZE)


@pytest.mark.parametrize("spec, options", [("window+int8:window=40", {"window": 40}),
                                           ("window+int4:window=63", {"window": 63}),
                                           ("window:sinks=8,window=4", {"sinks": 8, "window": 4})])
def test_estimate_refuses_what_the_server_refuses_with_its_message(model_dir, capsys, spec, options):
    """``window+int8:window=40`` (a window narrower than the residual window and the forming group) and window sinks
    wider than one KV page were sized, where ``kvserve serve`` refuses them: estimate now exits 2 with the server's
    own line (the backend's construction check; the pool's layout at ``--block-size``, KV_BLOCK_SIZE's default)."""
    import torch
    from transformers import AutoConfig

    from cache_backends.geometry import ModelGeometry
    from cache_backends.registry import create
    from server.backend_check import check_pool
    from server.cli import build_parser
    from server.config import ConfigError

    name = spec.split(":")[0]
    try:
        backend = create(name, ModelGeometry.from_config(AutoConfig.from_pretrained(model_dir), torch.float32),
                         **options)
        check_pool({name: backend}, torch.float32, 16, None)
        pytest.fail(f"{spec} is served")
    except (ValueError, ConfigError) as exc:
        served = str(exc)
    args = build_parser().parse_args(["estimate", "--model", str(model_dir), "--dtype", "fp32", spec])
    assert args.func(args) == 2
    assert capsys.readouterr().err == f"kvserve estimate: {served}\n"


def test_sinks_wider_than_a_page_are_refused_naming_the_commands_own_options(model_dir, capsys):
    """The server's line ("lower KV_WINDOW_SINKS or raise KV_BLOCK_SIZE (KV_BLOCK_SIZE is 16)") named variables
    estimate and advise do not read: estimate names the spec's option and its --block-size, advise (no block size
    option) the default block it checks at."""
    from server.cli import main

    assert main(["estimate", "--model", str(model_dir), "--dtype", "fp32", "window:sinks=40"]) == 2
    assert capsys.readouterr().err == ("kvserve estimate: window:sinks=40: sinks=40 must fit one page of its sink tier "
                                       "(16 tokens a page at --block-size 16): lower sinks or raise --block-size\n")
    assert main(["advise", "--model", str(model_dir), "--context", "512", "--memory-budget", "1GiB", "--backends",
                 "window:sinks=40"]) == 2
    err = capsys.readouterr().err
    assert err == ("kvserve advise: window:sinks=40: sinks=40 must fit one page of its sink tier (16 tokens a page at "
                   "the default block of 16): lower sinks or check a larger block with kvserve estimate --block-size\n")
    assert "KV_" not in err


def test_estimate_checks_window_sinks_at_the_block_size_given(model_dir, capsys):
    """Sinks wider than a page at the default block size fit a page of 64-token blocks, as the server takes them."""
    from server.cli import build_parser

    for block, status in (("16", 2), ("64", 0)):
        args = build_parser().parse_args(["estimate", "--model", str(model_dir), "--block-size", block, "--json",
                                          "--seq-len", "1024", "--batch", "1", "window:sinks=40"])
        assert args.func(args) == status
    assert json.loads(capsys.readouterr().out)[0]["params"] == {"sinks": 40, "window": 1024}


def test_a_per_head_spec_named_on_deepseek_sizes_its_expanded_k_and_v_heads():
    """Named, int8 sizes the K (192) and V (128) heads DeepSeek's attention expands: keys per channel, values per
    token (the sums refused unequal widths)."""
    (row,) = estimate_rows(PRESETS["deepseek-v3"], [("int8", {})], [4096], [1], 2)
    h, dk, dv, t, g = 128, 192, 128, 4096, 32
    q, exact = t - 32, 32  # a residual window of 32 and no forming group at 4096
    int8 = q * h * (dk + dv) + 2 * 2 * (q // g) * h * dk + 2 * 2 * q * h + exact * h * (dk + dv) * 2
    assert row["bytes_per_token_per_layer"] == int8 / t


def test_a_context_over_the_models_positions_is_sized_with_a_warning(model_dir, capsys):
    """--seq-len past the model's max_position_embeddings was sized silently: the rows stay (sums of what the cache
    would cost: the default --seq-len is longer than small models hold), with one warning line naming the limit; a
    preset has no limit of its own."""
    from server.cli import build_parser

    def estimate(*argv):
        args = build_parser().parse_args(["estimate", *argv, "--batch", "1", "--json", "full"])
        assert args.func(args) == 0
        out = capsys.readouterr()
        return [r["seq_len"] for r in json.loads(out.out)], out.err

    assert estimate("--model", str(model_dir), "--seq-len", "512,1024,2048,4096") == ([512, 1024, 2048, 4096], (
        f"kvserve estimate: warning: --seq-len 2048,4096 is more than {model_dir}'s 1024 positions "
        "(max_position_embeddings): the model cannot hold that context; those rows show what the cache would cost "
        "if it could\n"))
    assert estimate("--model", str(model_dir), "--seq-len", "1024") == ([1024], "")
    assert estimate("--model", "llama-2-7b", "--seq-len", "32768") == ([32768], "")


@pytest.mark.parametrize("name", ["int8+mla", "int8+int4", "mla+gqa", "elastic+int8", "dca+dca"])
def test_a_combination_kvserve_does_not_serve_is_refused(name):
    """The estimator sized some unsupported names as one of their parts (``int8+mla`` as ``full``)."""
    from cache_backends.estimate import bytes_per_token_per_layer

    with pytest.raises(ValueError, match="unsupported combination"):
        bytes_per_token_per_layer(PRESETS["llama-2-7b"], name, {}, 2, 1024)
    out = subprocess.run([sys.executable, "-m", "server.cli", "estimate", name], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "unsupported combination" in out.stderr and "Traceback" not in out.stderr


def test_an_option_given_twice_is_refused():
    """``mla:rank=8,rank=16`` was sized at rank 16, the last one silently winning."""
    from cache_backends.spec import parse_spec

    with pytest.raises(ValueError, match="mla:rank=8,rank=16: rank is given twice"):
        parse_spec("mla:rank=8,rank=16")
    assert parse_spec("mla:rank=8,rope_dim=0") == ("mla", {"rank": 8, "rope_dim": 0})


@pytest.mark.parametrize("name, options", [("mla", {"rank": 100000}), ("mla", {"rank": 513}), ("mla", {"rank": 512}),
                                           ("mla", {"rank": 1}), ("int4", {"group_size": 3}),
                                           ("int8", {"group_size": 3, "residual": 5}), ("gqa", {"groups": 3}),
                                           ("mla+int8", {"rank": 600})])
def test_estimate_takes_a_setting_exactly_when_the_server_does(model_dir, name, options):
    """An ``mla`` rank above full's width per token (2 x heads x head_dim: a latent that wide saves nothing) was
    sized, where the server refuses it. ``int4:group_size=3`` is served (its groups of 3 tokens give full's greedy
    text on the reference model), so it is sized too."""
    import torch
    from transformers import AutoConfig

    from cache_backends.geometry import ModelGeometry
    from cache_backends.estimate import Shape, bytes_per_token_per_layer
    from cache_backends.registry import create

    def served() -> bool:
        try:
            create(name, ModelGeometry.from_config(AutoConfig.from_pretrained(model_dir), torch.float32), **options)
        except ValueError:
            return False
        return True

    def sized() -> bool:
        try:
            bytes_per_token_per_layer(Shape.from_config(json.loads((model_dir / "config.json").read_text())), name,
                                      options, 4, 512)
        except ValueError:
            return False
        return True

    assert sized() == served()


def test_a_bench_budget_spec_is_named_as_benchs(capsys):
    """``mla@budget:rank=3`` (the README's bench command has ``mla@budget``) was only "unknown backend"."""
    from server.cli import build_parser

    args = build_parser().parse_args(["estimate", "mla@budget:rank=3"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve estimate: unknown backend 'mla@budget'") and "'@budget' is kvserve bench's alone" \
        in err and "give a setting to size, 'mla'" in err


def write_price(directory, folder, spec: str, pct: float, agreement: float | None = None,
                dtype: str | None = "float32") -> None:
    """A price entry as a server leaves it in its calibration cache (kind ``price``) for the model in ``folder``,
    measured with the model in ``dtype``; without ``agreement``, as a server before :data:`PRICE_VERSION` 5 left it
    (no agreement measured); without ``dtype``, as one before the dtype was recorded."""
    import torch
    from transformers import AutoConfig

    from cache_backends.calibration_cache import CalibrationCache

    model = SimpleNamespace(name_or_path=str(folder), config=AutoConfig.from_pretrained(str(folder)))
    price = {"kl": pct / 100, "ppl_increase_pct": pct, "ppl_change_pct": pct, "tokens": 768}
    if agreement is not None:
        price["agreement"] = agreement
    figures = {"price": price, **({"dtype": dtype} if dtype else {})}
    key = {"spec": spec, "prefix": 256, **({"dtype": dtype} if dtype else {})}  # as the Scorer keys it
    CalibrationCache(directory).fetch("price", model, [1, 2, 3], key,
                                      fit=lambda: ({"kl": torch.tensor([pct / 100])}, figures),
                                      load=lambda _, figures: figures,
                                      version=PRICE_VERSION if agreement is not None else 4)


def test_each_row_carries_the_price_the_calibration_cache_holds(model_dir, tmp_path, monkeypatch, capsys):
    """A size never stands alone: each row gets the quality budget's price of its own setting from the calibration
    cache (int4's unrotated one: the rotation costs no byte but is part of the setting), full's is 0, and the rest
    say "not priced"; a preset, or another cache, prices nothing but full."""
    from cache_backends.estimate import Shape, default_params
    from server.cli import main

    rank = default_params(Shape.from_config(json.loads((model_dir / "config.json").read_text())), "mla")["rank"]
    write_price(tmp_path, model_dir, "int8:group_size=32,residual=32", 0.02)
    write_price(tmp_path, model_dir, "int4:group_size=32,residual=32", 0.9)
    write_price(tmp_path, model_dir, "int4:group_size=32,residual=32,rotate=true", 0.5)
    write_price(tmp_path, model_dir, f"mla:rank={rank}", 240.0)
    write_price(tmp_path, model_dir, "int8:group_size=64,residual=64", 0.01)  # a size no default row has
    os.mkfifo(tmp_path / "price-0.safetensors")  # passed over, never waited on
    (tmp_path / "price-1.safetensors").write_text("not an entry")
    monkeypatch.setenv("KV_CALIBRATION_CACHE_DIR", str(tmp_path))
    assert main(["estimate", "--model", str(model_dir), "--seq-len", "1024", "--batch", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    prices = {(r["backend"], r["params"].get("value_bits")): r["price_pct"] for r in rows}
    assert prices[("full", None)] == 0.0 and prices[("int8", None)] == 0.02 and prices[("int4", 4)] == 0.9
    assert prices[("mla", None)] == 240.0 and prices[("int8", 4)] is None and prices[("gqa", None)] is None
    assert main(["estimate", "--model", str(model_dir), "--seq-len", "1024", "--batch", "1", "int8", "gqa"]) == 0
    table = capsys.readouterr().out
    assert "price" in table.splitlines()[2] and "+0.02%" in table and "not priced" in table
    assert main(["estimate", "--model", "llama-2-7b", "--seq-len", "1024", "--batch", "1", "--json"]) == 0
    assert {r["backend"]: r["price_pct"] for r in json.loads(capsys.readouterr().out)}["int8"] is None
    monkeypatch.setenv("KV_CALIBRATION_CACHE_DIR", str(tmp_path / "empty"))
    assert main(["estimate", "--model", str(model_dir), "--seq-len", "1024", "--batch", "1", "--json", "int8"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["price_pct"] is None


def test_a_setting_that_sizes_as_another_gets_its_own_price(model_dir, tmp_path, monkeypatch, capsys):
    """int4 with and without its rotation size alike: each row gets its own setting's price and agreement (the
    unrotated int4 was shown the rotated one's, and int4:rotate=true was not priced); likewise gqa's method. An
    entry's spec names the rotation only when on, so one without it is the unrotated setting's."""
    from server.cli import main

    write_price(tmp_path, model_dir, "int4:group_size=32,residual=32", 0.9, agreement=0.85)
    write_price(tmp_path, model_dir, "int4:group_size=32,residual=32,rotate=True", 0.5, agreement=0.95)
    write_price(tmp_path, model_dir, "gqa:groups=2,method=mean", 30.0, agreement=0.6)
    monkeypatch.setenv("KV_CALIBRATION_CACHE_DIR", str(tmp_path))
    assert main(["estimate", "--model", str(model_dir), "--dtype", "fp32", "--seq-len", "1024", "--batch", "1",
                 "--json", "int4", "int4:rotate=true", "int4:rotate=false", "gqa:groups=2",
                 "gqa:groups=2,method=mean"]) == 0
    assert [r["price_pct"] for r in json.loads(capsys.readouterr().out)] == [0.9, 0.5, 0.9, None, 30.0]


def test_a_price_measured_in_another_dtype_says_which(model_dir, tmp_path, monkeypatch, capsys):
    """Prices measured with the model in fp32 are shown for --dtype fp16 with the dtype they were measured in, not
    as if they were fp16's; an entry that recorded no dtype says so; in the dtype asked for, the price alone."""
    from server.cli import main

    write_price(tmp_path, model_dir, "int8:group_size=32,residual=32", 0.02)
    write_price(tmp_path, model_dir, "int4:group_size=32,residual=32", 0.9, dtype=None)
    monkeypatch.setenv("KV_CALIBRATION_CACHE_DIR", str(tmp_path))
    args = ["estimate", "--model", str(model_dir), "--seq-len", "1024", "--batch", "1", "full", "int8", "int4"]
    assert main([*args, "--json", "--dtype", "fp16"]) == 0
    assert [(r["price_pct"], r["price_dtype"]) for r in json.loads(capsys.readouterr().out)] == [
        (0.0, "fp16"), (0.02, "fp32"), (0.9, None)]
    assert main([*args, "--dtype", "fp16"]) == 0
    table = " ".join(capsys.readouterr().out.split())  # the price column may wrap
    assert "+0.02% (measured in fp32)" in table and "+0.90% (dtype not recorded)" in table
    assert "+0.00% (measured" not in table
    assert main([*args, "--dtype", "float32"]) == 0
    table = " ".join(capsys.readouterr().out.split())
    assert "+0.02% │" in table and "+0.02% (measured" not in table


def test_quantized_tiers_keep_only_the_window_of_a_hybrid_models_sliding_layers():
    """A Gemma 3 270M shape (18 layers, every sixth global, the others sliding through 512 tokens; 1 K/V head of
    256 channels): ``int8`` and ``int4`` hold the sliding layers' newest 511 tokens (their residual window and
    forming group exact, the rest codes), so at 8K they cost less than ``full`` with its windows kept; before, they
    held every token there and int8 cost more than ``full``. ``elastic`` (its tier fills on demand) and the
    compositions keep every token."""
    from cache_backends.estimate import Shape, bytes_per_token_per_layer, kv_spec

    windows = tuple(None if i % 6 == 5 else 512 for i in range(18))
    shape = Shape(num_layers=18, num_key_value_heads=1, k_head_dim=256, v_head_dim=256, layer_windows=windows)
    per = {name: bytes_per_token_per_layer(shape, name, {}, 2, 8192) for name in ("full", "int8", "int4")}
    assert per["int4"] < per["int8"] < per["full"]
    spec = kv_spec(shape, "int8", {}, 2)
    exact = 32  # the residual window; 8192 - 32 is whole groups of 32
    sliding = spec.with_layers(15).stored_bytes(exact, 511 - exact)
    every = spec.with_layers(3).bytes_at(8192)
    assert per["int8"] * 8192 * 18 == pytest.approx(sliding + every, rel=1e-12)
    assert per["int8"] < spec.bytes_per_token_per_layer(8192) / 4  # every token kept in every layer: over 4x more
    assert bytes_per_token_per_layer(shape, "elastic", {}, 2, 8192) == kv_spec(shape, "elastic", {}, 2).bytes_at(
        8192) / (8192 * 18)
