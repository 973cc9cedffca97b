"""The calibration cache (#16): gqa codecs, mla bases and dca maps fitted once, saved under
KV_CALIBRATION_CACHE_DIR and reused; `kvserve calibrate` fills it ahead of serving.

Before it, every prepare() ran the calibration forward pass and the fits again: the reuse tests below count
the calls of `collect_kv` (each fit makes exactly one) and find one more per prepare.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest
import torch

import cache_backends.calibration as calibration
from cache_backends.geometry import ModelGeometry
from cache_backends.calibration_cache import CalibrationCache
from cache_backends.registry import create
from tests.conftest import MODEL_DIR, REPO, RunningServer
from tests.precision import LOGIT_FACTOR
from tests.test_backends import TEXT, cache_path_logits


@pytest.fixture(scope="module")
def geometry(ref_model):
    return ModelGeometry.from_config(ref_model[0].config, torch.float32)


@pytest.fixture(scope="module")
def calib(ref_model):
    return calibration.calibration_ids(ref_model[0], ref_model[1], max_tokens=2048)


@pytest.fixture
def fits(monkeypatch):
    """Counts calibration forward passes (one per fit: a fit starts with `collect_kv`; a cached load never calls it)."""
    calls = []
    real = calibration.collect_kv

    def counting(*args, **kwargs):
        calls.append(kwargs.get("desc"))
        return real(*args, **kwargs)

    monkeypatch.setattr(calibration, "collect_kv", counting)
    return calls


def prepared(name, geometry, model, calib, cache, **options):
    backend = create(name, geometry, **options)
    backend.prepare(model, calib, cache)
    return backend


# dca at threshold -1 reuses every other layer, so its maps serve the decode steps being compared
CASES = [("gqa", {"groups": 2}), ("mla", {"rank": 32}), ("dca", {"threshold": -1.0}),
         ("dca+mla", {"threshold": -1.0, "rank": 32})]


@pytest.mark.parametrize("name,options", CASES, ids=[c[0] for c in CASES])
def test_second_prepare_loads_the_fit_and_serves_identical_logits(ref_model, geometry, calib, tmp_path, fits, name,
                                                                   options):
    model, tok = ref_model
    first_cache = CalibrationCache(tmp_path)
    first = prepared(name, geometry, model, calib, first_cache, **options)
    artefacts = len(name.split("+"))
    assert len(fits) == artefacts and [e.source for e in first_cache.events] == ["fitted"] * artefacts
    entries = sorted(tmp_path.glob("*.safetensors"))
    assert len(entries) == artefacts and all(p.with_suffix(".json").is_file() for p in entries)
    written = {p: p.read_bytes() for p in entries}

    second_cache = CalibrationCache(tmp_path)
    second = prepared(name, geometry, model, calib, second_cache, **options)
    assert len(fits) == artefacts  # no fit the second time
    assert [e.source for e in second_cache.events] == ["cache"] * artefacts
    assert [e.path for e in second_cache.events] == [e.path for e in first_cache.events]
    assert {p: p.read_bytes() for p in entries} == written  # read, not rewritten
    assert second.details() == first.details()

    ids = tok.encode(TEXT)
    logits_first, store_first = cache_path_logits(model, first, ids, 8)
    logits_second, store_second = cache_path_logits(model, second, ids, 8)
    # the same fit, computed twice: equal to fp32 rounding (bitwise alone; a loaded machine's threads may split a
    # reduction differently, seen once in a full run as 1e-4 on a logit of 5.4)
    scale = float(logits_first.abs().max())
    assert torch.allclose(logits_first, logits_second, rtol=0, atol=LOGIT_FACTOR * torch.finfo(torch.float32).eps * scale)
    assert store_first.nbytes() == store_second.nbytes()
    if name.startswith("dca"):
        assert store_second.reuse_layers() > 0  # the loaded maps did serve


def test_the_key_follows_what_changes_the_fit(ref_model, geometry, calib, tmp_path, fits):
    """A new rank or calibration text fits again; parameters that only read a fit (dca's threshold and align,
    int8's quantization) reuse the entry."""
    model, _ = ref_model
    cache = CalibrationCache(tmp_path)
    run = lambda name, ids=calib, **opts: prepared(name, geometry, model, ids, cache, **opts)  # noqa: E731
    run("mla", rank=32)
    run("mla", rank=16)
    run("mla", ids=calib[:1024], rank=32)
    assert [e.source for e in cache.events] == ["fitted"] * 3 and len(fits) == 3
    run("mla+int8", rank=32, group_size=64)
    run("gqa", groups=2)
    run("gqa+int8", groups=2)
    run("gqa", groups=4)
    assert [e.source for e in cache.events[3:]] == ["cache", "fitted", "cache", "fitted"]
    run("dca", threshold=0.9)
    run("dca", threshold=0.5, align="none", probe_interval=4)
    assert [e.source for e in cache.events[7:]] == ["fitted", "cache"]
    assert len(set(tmp_path.glob("*.safetensors"))) == 6


def fake_model(folder, config):
    return SimpleNamespace(name_or_path=str(folder), config=config)


def test_model_identity_is_config_and_weight_files(ref_model, calib, tmp_path):
    """A copy keeping mtimes (docker COPY, cp -p) matches; rewritten weights or another config do not;
    a hub snapshot is identified by its content-addressed blobs; no weight files, no key."""
    model, _ = ref_model
    key = lambda m: CalibrationCache(tmp_path / "cache").key("mla", m, calib, {"rank": 32})  # noqa: E731
    original = key(fake_model(MODEL_DIR, model.config))
    copy = tmp_path / "copy"
    shutil.copytree(MODEL_DIR, copy)  # copy2: mtimes kept
    assert key(fake_model(copy, model.config)) == original
    os.utime(copy / "model.safetensors", ns=(1, 1))  # as a new save would: same size, new mtime
    assert key(fake_model(copy, model.config)) != original
    other = type(model.config).from_dict({**model.config.to_dict(), "rms_norm_eps": 1e-6})
    assert key(fake_model(MODEL_DIR, other)) != original
    assert key(fake_model(MODEL_DIR, type(model.config).from_dict({**model.config.to_dict(), "dtype": "bfloat16"}))) \
        == original  # the dtype is not part of the fit's identity

    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    blob = blobs / ("0123456789abcdef" * 4)
    shutil.copy(MODEL_DIR / "model.safetensors", blob)
    (snapshot / "model.safetensors").symlink_to(blob)
    hub_key = key(fake_model(snapshot, model.config))
    os.utime(blob, ns=(1, 1))
    assert key(fake_model(snapshot, model.config)) == hub_key  # content-addressed: the mtime does not matter

    empty = tmp_path / "no-weights"
    empty.mkdir()
    assert key(fake_model(empty, model.config)) is None


def test_a_model_without_weight_files_is_fitted_without_the_cache(ref_model, geometry, calib, tmp_path, fits, caplog):
    model, _ = ref_model
    empty = tmp_path / "no-weights"
    empty.mkdir()
    cache = CalibrationCache(tmp_path / "cache")
    backend = create("mla", geometry, rank=16)
    real = model.name_or_path
    model.name_or_path = str(empty)
    try:
        with caplog.at_level(logging.WARNING, "kvserve.calibration"):
            backend.prepare(model, calib, cache)
    finally:
        model.name_or_path = real
    assert backend.bases is not None and len(fits) == 1 and cache.events[0].path is None
    assert "no weight files" in caplog.text and not (tmp_path / "cache").exists()


def _garbage(path, _):
    path.write_bytes(b"\x00not a safetensors file" * 10)


def _truncated(path, _):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _wrong_shape(path, _):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["0.basis"] = tensors["0.basis"][:, :3].contiguous()
    save_file(tensors, str(path), metadata=meta)


def _other_key(path, other):
    shutil.copy(other, path)  # a valid entry, but of another rank


@pytest.mark.parametrize("corrupt", [_garbage, _truncated, _wrong_shape, _other_key],
                         ids=["garbage", "truncated", "wrong-shape", "other-key"])
def test_an_unusable_entry_is_fitted_again_with_a_warning(ref_model, geometry, calib, tmp_path, fits, caplog, corrupt):
    model, _ = ref_model
    other = CalibrationCache(tmp_path / "other")
    prepared("mla", geometry, model, calib, other, rank=8)
    first = prepared("mla", geometry, model, calib, CalibrationCache(tmp_path), rank=16)
    (entry,) = tmp_path.glob("*.safetensors")
    corrupt(entry, other.events[0].path)
    cache = CalibrationCache(tmp_path)
    with caplog.at_level(logging.WARNING, "kvserve.calibration"):
        again = prepared("mla", geometry, model, calib, cache, rank=16)
    assert "unusable" in caplog.text and str(entry) in caplog.text
    assert cache.events[0].source == "fitted" and len(fits) == 3
    assert all(torch.equal(a.basis, b.basis) for a, b in zip(first.bases, again.bases))
    reread = CalibrationCache(tmp_path)
    prepared("mla", geometry, model, calib, reread, rank=16)
    assert reread.events[0].source == "cache"  # the refit replaced the bad entry


IN_PLACE_OF_AN_ENTRY = r"""
import logging, os, sys, types
from pathlib import Path
import torch
from cache_backends.calibration_cache import CalibrationCache

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
root, what = Path(sys.argv[1]), sys.argv[2]
(root / "model").mkdir()
(root / "model" / "model.safetensors").write_bytes(b"weights")
model = types.SimpleNamespace(name_or_path=str(root / "model"), config=types.SimpleNamespace(to_dict=lambda: {"x": 1}))
cache = CalibrationCache(root / "cache")
entry = cache.path("mla", cache.key("mla", model, [1, 2, 3], {"rank": 2}))
entry.parent.mkdir()
os.mkfifo(entry) if what == "fifo" else entry.mkdir()
fit = lambda: ({"basis": torch.ones(2, 2)}, {"price": 0.5})
out = cache.fetch("mla", model, [1, 2, 3], {"rank": 2}, fit, lambda tensors, figures: tensors["basis"])
print(cache.events[0].source, out.sum().item(), entry.is_file())
"""


@pytest.mark.parametrize("what", ["fifo", "directory"])
def test_a_named_pipe_or_a_directory_in_place_of_an_entry_is_fitted_again(tmp_path, what):
    """Only a regular file is opened: a named pipe in place of an entry held the start, silently, until the ready
    timeout (30 minutes), and its core could not end with its server (the open held the interpreter's lock)."""
    run = subprocess.run([sys.executable, "-c", IN_PLACE_OF_AN_ENTRY, str(tmp_path), what], capture_output=True,
                         text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-3000:]
    kind = "a named pipe" if what == "fifo" else "a directory"
    assert f"is unusable (it is {kind}, not a regular file); fitting again" in run.stderr
    # a refit replaces a pipe with the entry; a directory cannot be replaced, and costs only the reuse
    assert run.stdout.split() == ["fitted", "4.0", "True" if what == "fifo" else "False"]
    assert what == "fifo" or "cannot write the calibration cache entry" in run.stderr


def test_an_entry_that_does_not_open_in_time_is_fitted_again(tmp_path, monkeypatch):
    """A file system that does not answer costs the open's time bound, not the start."""
    import threading

    import cache_backends.calibration_cache as cc

    release = threading.Event()
    real_open = os.open

    def stuck(path, *args, **kwargs):
        if str(path).endswith(".safetensors"):
            release.wait(30)
        return real_open(path, *args, **kwargs)

    entry = tmp_path / "mla-entry.safetensors"
    entry.write_bytes(b"x")
    monkeypatch.setattr(cc.os, "open", stuck)
    try:
        with pytest.raises(ValueError, match="did not open within 0.2 s"):
            cc.open_regular(entry, 0.2)
    finally:
        release.set()


def test_an_unwritable_cache_costs_only_the_reuse(ref_model, geometry, calib, tmp_path, caplog):
    model, _ = ref_model
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = CalibrationCache(blocker / "cache")
    with caplog.at_level(logging.WARNING, "kvserve.calibration"):
        backend = prepared("mla", geometry, model, calib, cache, rank=16)
    assert backend.bases is not None and cache.events[0].path is None
    assert "cannot write" in caplog.text
    assert not list(tmp_path.glob(".*.tmp"))


def test_cache_dir_setting_follows_xdg_and_empty_turns_it_off(monkeypatch, tmp_path):
    from pathlib import Path

    from server.config import load_settings

    monkeypatch.delenv("KV_CALIBRATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert load_settings().kv_calibration_cache_dir == str(tmp_path / "kvserve" / "calibration")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert load_settings().kv_calibration_cache_dir == str(Path.home() / ".cache" / "kvserve" / "calibration")
    monkeypatch.setenv("KV_CALIBRATION_CACHE_DIR", "")
    assert load_settings().kv_calibration_cache_dir is None


def test_backend_flag_takes_repeats_lists_and_comma_lists():
    from server.calibrate_cli import backend_names

    assert backend_names(["gqa", "mla,dca", "gqa", " int8 ,"]) == ["gqa", "mla", "dca", "int8"]
    assert backend_names(None) == []


def calibrate(env, *args):
    return subprocess.run([sys.executable, "-m", "server.cli", "calibrate", *args], env={**os.environ, **env},
                          cwd=REPO, capture_output=True, text=True, timeout=600)


def test_calibrate_fills_the_cache_and_the_server_starts_from_it(tmp_path):
    text = (MODEL_DIR / "calib_slice.txt").read_text(encoding="utf-8")
    (tmp_path / "calib.txt").write_text(text[:6000], encoding="utf-8")  # a short slice keeps the test fast
    env = {"MODEL_ID": str(MODEL_DIR), "KV_CALIBRATION_CACHE_DIR": str(tmp_path / "cache"), "KV_MLA_RANK": "32",
           "KV_CALIBRATION_FILE": str(tmp_path / "calib.txt"), "KV_BACKEND": "full", "KV_BACKENDS": "",
           "KV_QUALITY_BUDGET": "off"}  # the fixed settings: the budget's prices are tests/test_quality_budget.py's
    r = calibrate(env, "--backend", "mla,dca", "--backend", "int8")
    assert r.returncode == 0, r.stderr[-3000:]
    entries = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").glob("*.safetensors"))
    assert entries == ["dca", "mla"]
    out = r.stdout
    assert "mla: fitted in" in out and "dca: fitted in" in out and "explained variance (layers 0-7)" in out
    assert "similarity linear (layers 1-7)" in out and "reuse layers at threshold 0.95" in out
    assert "int8 (group_size=32, residual=32): nothing to fit" in out
    assert f"cache: {tmp_path / 'cache'}" in out.splitlines()[-1] and out.splitlines()[-1].startswith("total ")
    assert "calibrate: 100%" in r.stderr  # the progress bar
    meta = json.loads(next((tmp_path / "cache").glob("mla-*.json")).read_text())
    assert meta["params"] == {"rank": 32} and len(meta["figures"]["explained_variance"]) == 8

    again = calibrate(env, "--backend", "mla")
    assert again.returncode == 0 and "mla: loaded from the cache in" in again.stdout

    server = RunningServer({**env, "KV_BACKEND": "mla+int8", "KV_BACKENDS": "dca+mla"})
    try:
        info = httpx.get(server.url + "/info", timeout=10).json()
    finally:
        server.stop()
    assert [(e["kind"], e["source"]) for e in info["kv_calibration"]] == [("mla", "cache"), ("mla", "cache"),
                                                                           ("dca", "cache")]


def test_calibrate_refuses_a_bad_backend_with_one_line(tmp_path):
    r = calibrate({"KV_CALIBRATION_CACHE_DIR": str(tmp_path)}, "--backend", "gqa,nope")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "nope" in r.stderr, r.stderr
    assert "invalid --backend='nope'" in r.stderr and "KV_BACKEND" not in r.stderr  # the flag given, not the variable
    r = calibrate({"KV_CALIBRATION_CACHE_DIR": ""}, "--backend", "mla")
    assert r.returncode == 2 and "KV_CALIBRATION_CACHE_DIR" in r.stderr


def test_a_killed_writes_tmp_file_is_removed_at_the_next_start(tmp_path):
    """A start killed while writing leaves `.<entry>.*.tmp` (0 bytes); the next cache opened removes it once it is
    stale, and leaves a write in progress (a fresh file) alone (#26)."""
    stale, fresh = tmp_path / ".dca-0123.safetensors.abc.tmp", tmp_path / ".dca-0123.safetensors.def.tmp"
    stale.write_bytes(b"")
    fresh.write_bytes(b"")
    old = stale.stat().st_mtime - 3600
    os.utime(stale, (old, old))
    CalibrationCache(tmp_path)
    assert not stale.exists() and fresh.exists()


def test_dca_measuring_pass_counts_in_the_calibration_time_and_logs_progress(ref_model, geometry, calib, tmp_path,
                                                                            caplog):
    cache = CalibrationCache(tmp_path)
    with caplog.at_level(logging.INFO, logger="kvserve.dca"):
        prepared("dca", geometry, ref_model[0], calib, cache)
    event = [e for e in cache.events if e.kind == "dca"][-1]
    assert event.start_seconds > 0 and event.seconds >= event.start_seconds
    assert any("calibration windows" in r.getMessage() and "/" in r.getMessage() for r in caplog.records)


def test_calibration_draws_no_progress_bar_off_a_terminal(ref_model, capsys):
    """The server's log (a pipe or a file, never a terminal under Docker, systemd or Kubernetes) got the
    calibration's progress bars between its access-log lines: they are drawn on a terminal only."""
    model, tokenizer = ref_model
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    ids = tokenizer.encode(TEXT)[:96]
    calibration._LAST = None  # a fresh forward pass, not the one a test before made
    create("mla", geometry, rank=8)._fit(model, ids)  # calibration windows, then one basis per layer
    assert capsys.readouterr().err == ""
