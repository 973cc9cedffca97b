"""The KV sums against the stores, for every backend and composition on the reference model.

What ``/info`` and ``kvserve estimate`` print (one function: ``KVBackend.bytes_per_token_per_layer``, the
estimator's sums of the backend's own spec) must be what a store filled by a prompt holds: within 1% at
1024 tokens, and exactly at short lengths, where int8-family backends hold their newest tokens in full
precision. ``dca`` reuses a number of layers that depends on the input: the reported figure takes the
share calibration reuses (the prompts here are calibration text, where it is the share the store
reuses), a live store's figure (``live_bytes_per_token_per_layer``) the store's own reuse and fall-backs.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from cache_backends.geometry import ModelGeometry
from cache_backends.registry import create
from cache_backends.store_path import StorePath
from server.estimate_cli import add_arguments
from server.estimate_cli import main as estimate_main
from server.engine_loading import kv_sizes
from tests.conftest import MODEL_DIR, fits

SPECS = [("full", {}), ("gqa", {"groups": 2, "method": "mean"}), ("gqa", {"groups": 2, "method": "pca"}),
         ("mla", {"rank": 64}), ("int8", {}), ("dca", {}), ("gqa+int8", {"groups": 2}), ("mla+int8", {"rank": 64}),
         ("dca+int8", {}), ("dca+mla", {"rank": 128}), ("int4", {}), ("int4", {"rotate": True}),
         ("int8", {"value_bits": 4}), ("gqa+int4", {"groups": 2}), ("mla+int4", {"rank": 64}), ("dca+int4", {})]
IDS = [name + "".join(f":{k}={v}" for k, v in options.items()) for name, options in SPECS]
CHUNK = 256  # the engine's default prefill chunk (MAX_NUM_BATCHED_TOKENS)


@pytest.fixture(scope="module")
def calib(ref_model):
    from cache_backends.calibration import calibration_ids

    return calibration_ids(ref_model[0], ref_model[1], max_tokens=4096)


@pytest.fixture(scope="module")
def backends(ref_model, calib) -> dict:
    """Every spec, created and calibrated once for the module."""
    model, _ = ref_model
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    out = {}
    for key, (name, options) in zip(IDS, SPECS):
        out[key] = create(name, geometry, **options)
        out[key].prepare(model, calib, fits(model))
    return out


def filled(model, backend, ids: list[int]):
    """A store holding ``ids``, prefilled as the engine does: reserved to the prompt, in chunks of
    :data:`CHUNK` tokens, or whole where the store decides once per prompt (dca)."""
    runner = StorePath(model, backend.geometry.num_layers)
    store = backend.new_store()
    store.reserve(len(ids))
    step = CHUNK if store.supports_chunked_prefill else len(ids)
    for start in range(0, len(ids), step):
        runner.prefill(ids[start : start + step], store)
    assert store.num_tokens() == len(ids)
    return store


def reported(backend, seq_len: int) -> float:
    """Bytes per token over all layers as /info reports them."""
    return backend.bytes_per_token_per_layer(seq_len) * backend.geometry.num_layers


@pytest.mark.parametrize("key", IDS)
def test_reported_bytes_per_token_are_the_stores_at_1024(ref_model, calib, backends, key):
    backend = backends[key]
    store = filled(ref_model[0], backend, calib[:1024])
    measured = store.nbytes() / 1024
    assert abs(reported(backend, 1024) - measured) / measured < 0.01, (reported(backend, 1024), measured)
    assert reported(backend, 1024) == pytest.approx(measured, rel=1e-9)  # the sums are exact, not only within 1%
    assert backend.live_bytes_per_token_per_layer(store) * backend.geometry.num_layers == pytest.approx(measured,
                                                                                                         rel=1e-9)
    store.release()


@pytest.mark.parametrize("seq_len", [64, 128, 300])  # 128: a length /info reports
@pytest.mark.parametrize("key", IDS)
def test_short_sequences_cost_what_the_sums_say_at_their_length(ref_model, calib, backends, key, seq_len):
    backend = backends[key]
    store = filled(ref_model[0], backend, calib[:seq_len])
    assert reported(backend, seq_len) == pytest.approx(store.nbytes() / seq_len, rel=1e-9)
    store.release()
    if "int" in key or key.startswith("dca"):  # int8/int4's full-precision window and dca's residual window are a
        assert reported(backend, seq_len) > reported(backend, 1024)  # larger share of a short sequence
    else:
        assert reported(backend, seq_len) == reported(backend, 1024)


def test_int8_at_64_tokens_holds_half_its_tokens_in_full_precision(backends):
    """64 = residual 32 + one group of 32: 32 tokens as codes and scales, 32 in fp32 (8 layers, 8 heads x 32)."""
    hd, layers = 8 * 32, 8
    codes_and_scales = 2 * hd + 2 * hd * 4 / 32 + 2 * 8 * 4  # per quantized token and layer: 640 bytes
    window = 2 * hd * 4  # per full-precision token and layer: 2048 bytes
    assert reported(backends["int8"], 64) == (32 * codes_and_scales + 32 * window) / 64 * layers == 10752


@pytest.mark.parametrize("key", ["dca", "dca+int8", "dca+mla:rank=128"])
def test_dca_live_figure_counts_the_sequences_own_reuse_and_fall_backs(ref_model, model_dir, backends, key):
    """On other text the store may reuse other layers than calibration; after a fall-back a layer stores its
    own K/V from that position on. The live figure counts both; the reported one keeps the calibrated share."""
    model, tok = ref_model
    backend = backends[key]
    ids = tok.encode((model_dir / "eval_slice.txt").read_text())[:317]
    store = filled(model, backend, ids[:300])
    reused = [layer for layer in store.layers if layer.mode == "reuse"]
    for layer in store.layers:
        layer.threshold_for = lambda tokens: 2.0  # every probe fails: each reuse layer falls back at its first probe (step 16)
    runner = StorePath(model, backend.geometry.num_layers)
    for t in ids[300:]:
        runner.decode([t], [store])
    assert [layer.fallback_at for layer in reused] == [300 + 15] * len(reused)  # the 16th decode step's position
    measured = store.nbytes() / store.num_tokens()
    assert backend.live_bytes_per_token_per_layer(store) * backend.geometry.num_layers == pytest.approx(measured,
                                                                                                         rel=1e-9)
    store.release()


def test_info_and_kvserve_estimate_give_the_same_numbers(backends, capsys):
    info = kv_sizes(backends, 8, 1024)
    assert set(info["kv_bytes_per_token_by_seq_len"]["int8"]) == {"128", "1024"}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    specs = [info["kv_estimate_spec"][key] for key in IDS]
    args = parser.parse_args(["--model", str(MODEL_DIR), "--dtype", "float32", "--seq-len", "128,1024", "--batch", "1",
                              "--json", *specs])
    assert estimate_main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * len(IDS)
    for key, (short, long) in zip(IDS, zip(rows[::2], rows[1::2])):
        by_len = info["kv_bytes_per_token_by_seq_len"][key]
        assert short["bytes_per_token_per_layer"] * 8 == pytest.approx(by_len["128"], rel=1e-12), key
        assert long["bytes_per_token_per_layer"] * 8 == pytest.approx(by_len["1024"], rel=1e-12), key
        assert info["kv_bytes_per_token"][key] == by_len["1024"]
    assert info["kv_estimate_spec"]["dca+int8"].startswith("dca+int8:reuse_fraction=")
