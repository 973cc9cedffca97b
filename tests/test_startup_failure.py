"""A start-up that can never serve exits non-zero with one line naming the cause (#16): before, the process
stayed up answering /health 503 forever, which a container or pod cannot tell from slow loading."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.conftest import MODEL_DIR, free_port


def test_backend_that_cannot_calibrate_exits_1_with_one_line(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(MODEL_DIR, model, ignore=shutil.ignore_patterns("calib_slice.txt"))
    env = {**os.environ, "MODEL_ID": str(model), "KV_BACKEND": "gqa", "PORT": str(free_port()),
           "LOG_LEVEL": "error"}
    proc = subprocess.run([sys.executable, "-m", "server.cli", "serve"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvserve: cannot serve: model failed to load:") and "calib_slice.txt" in last, last
