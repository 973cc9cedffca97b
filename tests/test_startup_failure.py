"""A start-up that can never serve exits non-zero with one line naming the cause (#16): before, the process
stayed up answering /health 503 forever, which a container or pod cannot tell from slow loading."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.conftest import MODEL_DIR, free_port


def test_backend_that_cannot_calibrate_exits_1_with_one_line(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    env = {**os.environ, "MODEL_ID": str(MODEL_DIR), "KV_BACKEND": "gqa", "PORT": str(free_port()),
           "LOG_LEVEL": "error", "KV_CALIBRATION_FILE": str(tmp_path / "empty.txt"), "KV_CALIBRATION_CACHE_DIR": ""}
    proc = subprocess.run([sys.executable, "-m", "server.cli", "serve"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvserve: cannot serve: model failed to load:") and "empty.txt" in last, last
    assert last.count("model failed to load") == 1, last  # the engine core's message, not wrapped twice


def test_settings_found_wrong_before_the_load_exit_2_with_one_line(tmp_path):
    """A missing KV_CALIBRATION_FILE, a KV_CACHE_BUDGET_BYTES under two KV pages or over the machine's memory and
    window sinks wider than one KV page (whatever is served beside the window) are known from the settings and the
    model's config: exit 2 before the weights load, one line and no traceback, as every other bad setting (before:
    exit 1 after the load, a missing file with two tracebacks)."""
    for extra, said in [({"KV_BACKEND": "gqa", "KV_CALIBRATION_FILE": str(tmp_path / "missing.txt")},
                         f"invalid KV_CALIBRATION_FILE={str(tmp_path / 'missing.txt')!r}: no such file"),
                        ({"KV_CACHE_BUDGET_BYTES": "600000"}, "KV_CACHE_BUDGET_BYTES=600000 holds fewer than 2 KV"),
                        # int64's largest passed, then torch failed to allocate the pool after the load (exit 1)
                        ({"KV_CACHE_BUDGET_BYTES": str(2**63 - 1)}, f"invalid KV_CACHE_BUDGET_BYTES={2**63 - 1}: more "
                         "than this machine's memory"),
                        ({"KV_BACKEND": "window", "KV_WINDOW_SINKS": "20"},
                         "window: sinks=20 (KV_WINDOW_SINKS) must fit one page of its sink tier (16 tokens a page): "
                         "lower KV_WINDOW_SINKS or raise KV_BLOCK_SIZE (KV_BLOCK_SIZE is 16)"),
                        # dca beside it: its layout is calibrated, the sinks were checked after the load (exit 1)
                        ({"KV_BACKEND": "window", "KV_WINDOW_SINKS": "20", "KV_BACKENDS": "dca"},
                         "window: sinks=20 (KV_WINDOW_SINKS) must fit one page of its sink tier (16 tokens a page)"),
                        ({"KV_BACKEND": "window+int8", "KV_WINDOW_SINKS": "40", "KV_BACKENDS": ""},
                         "window+int8: sinks=40 (KV_WINDOW_SINKS) must fit one page of its sink tier (32 tokens")]:
        env = {**os.environ, "MODEL_ID": str(MODEL_DIR), "PORT": str(free_port()), **extra}
        proc = subprocess.run([sys.executable, "-m", "server.cli", "serve"], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and "Loading weights" not in proc.stderr, proc.stderr[-2000:]
        assert said in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


def test_model_folder_without_calibration_slice_calibrates_on_the_packaged_text(tmp_path, ref_model):
    """gqa/mla/dca used to need calib_slice.txt beside the model; now the packaged default (or
    KV_CALIBRATION_FILE, plain or jsonl) is used."""
    import json
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from cache_backends.geometry import ModelGeometry
    from cache_backends.calibration import DEFAULT_TEXT, calibration_file, calibration_ids
    from cache_backends.registry import create

    folder = tmp_path / "model"
    shutil.copytree(MODEL_DIR, folder, ignore=shutil.ignore_patterns("calib_slice.txt", "eval_slice.txt"))
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert calibration_file(model) == DEFAULT_TEXT
    tok = ref_model[1]
    ids = calibration_ids(model, tok, max_tokens=2048)
    assert len(ids) == 2048
    backend = create("mla", ModelGeometry.from_config(model.config, torch.float32), rank=32)
    backend.prepare(model, ids)
    assert backend.bases is not None
    jsonl = tmp_path / "calib.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in ["And God said", "Let there be light"]))
    assert calibration_ids(model, tok, path=jsonl) == tok.encode("And God said") + [tok.eos_token_id] + \
        tok.encode("Let there be light") + [tok.eos_token_id]


def test_health_says_when_the_model_is_loaded_and_the_backends_are_being_priced(held_pricing):
    """/health said "model is loading" for the minutes of calibration and pricing after the model had loaded: the
    engine core reports its stage (:class:`~server.engine.messages.Loading`) and /health says it."""
    import threading

    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.config import load_settings

    entered, release = held_pricing
    # the engine core in a thread of this process, so that it loads through the held prepare_backends (the core
    # process's stages: tests/test_engine_process.py)
    app = create_app(load_settings(model_id=str(MODEL_DIR), kv_backends="", kv_calibration_cache_dir="",
                                   engine_process=False))
    with TestClient(app) as client:
        try:
            assert entered.wait(120)
            # the core reports its stage just before it prices; the client reads that message a moment later (on
            # a loaded machine, after the hold began): poll while the hold keeps the stage where it is
            for path in ("/health", "/info", "/v1/models"):
                for _ in range(300):
                    r = client.get(path)
                    if "calibrating and pricing the KV backends" in r.text:
                        break
                    time.sleep(0.1)
                assert r.status_code == 503 and "calibrating and pricing the KV backends" in r.text, (path, r.text)
        finally:
            release.set()
        for _ in range(600):
            if client.get("/health").status_code == 200:
                break
            threading.Event().wait(0.2)
        assert client.get("/health").json() == {"status": "ok"}
