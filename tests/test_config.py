"""Start-up configuration: bad values stop the server with one line naming the variable."""

import os
import subprocess
import sys

import pytest

from server.config import ConfigError, load_settings
from tests.conftest import REPO


@pytest.mark.parametrize("env,var", [({"KV_BACKEND": "nope"}, "KV_BACKEND"), ({"DEVICE": "tpu"}, "DEVICE"),
                                     ({"PORT": "http"}, "PORT"), ({"MAX_BATCH_SIZE": "0"}, "MAX_BATCH_SIZE"),
                                     ({"DTYPE": "float8"}, "DTYPE"), ({"KV_DCA_WINDOW": "-1"}, "KV_DCA_WINDOW"),
                                     # nan/inf were accepted, then every GET /info failed to encode them (500)
                                     ({"KV_DCA_THRESHOLD": "nan"}, "KV_DCA_THRESHOLD"),
                                     ({"KV_DCA_THRESHOLD": "inf"}, "KV_DCA_THRESHOLD")])
def test_bad_value_names_the_variable(monkeypatch, env, var):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=var):
        load_settings()


def test_unknown_backend_lists_allowed_values(monkeypatch):
    monkeypatch.setenv("KV_BACKEND", "nope")
    with pytest.raises(ConfigError, match="allowed: .*full"):
        load_settings()


def test_serve_exits_nonzero_with_one_line():
    env = {**os.environ, "KV_BACKEND": "nope"}
    p = subprocess.run([sys.executable, "-m", "server.cli", "serve"], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "KV_BACKEND" in lines[0] and "full" in lines[0]


def test_defaults_derive_token_limits_from_the_model():
    s = load_settings()
    assert s.kv_backend == "full" and s.port == 8000
    assert s.token_limits(1024) == (1023, 1024)
