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
                                     ({"KV_DCA_THRESHOLD": "inf"}, "KV_DCA_THRESHOLD"),
                                     ({"KV_INT8_VALUE_BITS": "3"}, "KV_INT8_VALUE_BITS"),
                                     ({"KV_INT4_KEY_BITS": "four"}, "KV_INT4_KEY_BITS"),
                                     ({"KV_INT4_ROTATE": "maybe"}, "KV_INT4_ROTATE"),
                                     ({"KV_INT4_RESIDUAL": "-1"}, "KV_INT4_RESIDUAL")])
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


def test_bit_widths_from_the_environment_are_numbers(monkeypatch):
    """KV_*_BITS arrive as strings: "4" is 4 (a Literal[4, 8] field refused it: the k8v4 server did not start)."""
    monkeypatch.setenv("KV_INT8_VALUE_BITS", "4")
    monkeypatch.setenv("KV_INT4_KEY_BITS", "8")
    s = load_settings()
    assert s.backend_options("int8")["value_bits"] == 4 and s.backend_options("int4")["key_bits"] == 8


def test_defaults_derive_token_limits_from_the_model():
    s = load_settings()
    assert s.kv_backend == "full" and s.port == 8000
    assert s.token_limits(1024) == (1023, 1024)


def test_default_serves_full_and_int8_per_request(monkeypatch):
    """Out of the box a request (and the built-in page) can compare `full` and `int8`: neither needs
    calibration, so they are served besides KV_BACKEND while KV_BACKENDS is unset."""
    monkeypatch.delenv("KV_BACKENDS", raising=False)
    assert load_settings().served_backends() == ["full", "int8"]
    monkeypatch.setenv("KV_BACKEND", "mla")
    s = load_settings()
    assert s.served_backends() == ["mla", "full", "int8"] and s.optional_backends() == {"full", "int8"}
    monkeypatch.setenv("KV_BACKENDS", "")  # empty: KV_BACKEND alone
    assert load_settings().served_backends() == ["mla"] and load_settings().optional_backends() == set()
    monkeypatch.setenv("KV_BACKENDS", "int8,dca")
    assert load_settings().served_backends() == ["mla", "int8", "dca"]


def test_default_extras_the_model_cannot_take_are_left_out(monkeypatch):
    """On a native-MLA model int8 is refused: from the default it is dropped, asked for it stops start-up."""
    from cache_backends import ModelGeometry
    from server.state import create_backends

    import transformers

    config = transformers.AutoConfig.from_pretrained(REPO / "models" / "kjv-llama-mla")
    geometry = ModelGeometry.from_config(config, __import__("torch").float32)
    monkeypatch.setenv("KV_BACKEND", "mla")
    monkeypatch.delenv("KV_BACKENDS", raising=False)
    assert list(create_backends(load_settings(), geometry)) == ["mla", "full"]
    monkeypatch.setenv("KV_BACKENDS", "int8")
    with pytest.raises(ValueError):
        create_backends(load_settings(), geometry)
