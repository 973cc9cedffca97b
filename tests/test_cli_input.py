"""Bad command-line input to `kvserve estimate` and `kvserve advise`: exit 2 and one line naming the problem,
never a traceback, a default silently put in its place, or nonsense printed with exit 0."""

import json
import os
import re
import subprocess
import sys

import pytest

from cache_backends.spec import parse_spec
from tests.conftest import REPO


@pytest.mark.parametrize("spec, message", [
    ("mla:rank=abc", "rank must be an integer, got 'abc'"),
    ("mla:rank=1.5", "rank must be an integer"),
    ("gqa:groups=0", "groups must be >= 1, got 0"),
    ("int8:residual=-1", "residual must be >= 0"),
    ("gqa:method=foo", "method must be one of pca, mean"),
    ("dca:align=foo", "align must be one of linear, none"),
    ("gqa:groups", "expected key=value"),
    ("dca:threshold=nan", "threshold must be a finite number, got 'nan'"),
    ("dca:reuse_fraction=1e400", "reuse_fraction must be a finite number"),
    ("dca:window=-1", "window must be >= 0, got -1"),
    ("int4:rotate=maybe", "rotate must be true or false (or 1/0, yes/no, on/off), got 'maybe'"),
    ("int8:key_bits=3", "key_bits must be one of 4, 8, got '3'"),
    ("int4:value_bits=4.0", "value_bits must be one of 4, 8"),
])
def test_spec_values_are_typed_and_bounded(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_spec(spec)


def test_spec_values_convert():
    assert parse_spec("dca:threshold=0.9,probe_interval=8,align=none") == (
        "dca", {"threshold": 0.9, "probe_interval": 8, "align": "none"})
    assert parse_spec("int8:residual=0") == ("int8", {"residual": 0})


@pytest.mark.parametrize("text, value", [("yes", True), ("1", True), ("ON", True), ("True", True), ("no", False),
                                         ("0", False), ("off", False), ("F", False)])
def test_a_spec_reads_a_boolean_as_the_settings_do(text, value):
    """``KV_INT8_ROTATE=yes`` is accepted (pydantic's booleans): ``int8:rotate=yes`` in estimate and advise too, and
    it echoes as ``true``/``false``."""
    from cache_backends.spec import format_spec

    assert parse_spec(f"int8:rotate={text}") == ("int8", {"rotate": value})
    assert format_spec("int8", {"rotate": value}) == f"int8:rotate={str(value).lower()}"
    assert parse_spec("int4:rotate=true,key_bits=8") == ("int4", {"rotate": True, "key_bits": 8})
    assert parse_spec("int8:value_bits=4,rotate=False") == ("int8", {"value_bits": 4, "rotate": False})


@pytest.mark.parametrize("spelling, no", [("TRUE", "FALSE"), ("True", "False"), ("true", "false")])
def test_a_boolean_is_echoed_in_one_spelling(spelling, no):
    """However the user writes a boolean, ``kvserve estimate`` echoes it as the docs and ``KV_*`` settings spell it
    (``format_spec`` is also the key of a price in the calibration cache: one setting, one key)."""
    from cache_backends.spec import format_spec

    assert format_spec(*parse_spec(f"int8:rotate={spelling},value_bits=4")) == "int8:rotate=true,value_bits=4"
    assert format_spec(*parse_spec(f"int8:rotate={no}")) == "int8:rotate=false"
    p = kvserve("estimate", f"int8:rotate={spelling}", "--seq-len", "1024", "--batch", "1")
    assert p.returncode == 0 and "rotate=true" in p.stdout and "True" not in p.stdout, p.stdout + p.stderr


def kvserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, message", [
    (["estimate", "gqa:groups=0"], "groups must be >= 1"),
    (["estimate", "mla:rank=abc"], "rank must be an integer"),
    (["estimate", "full:foo=1"], "full takes no option foo"),
    (["estimate", "int4:rotate=maybe"], "rotate must be true or false"),
    (["estimate", "mla+int4:key_bits=2"], "key_bits must be one of 4, 8"),
    (["estimate", "gqa:rotate=true"], "gqa takes no option rotate"),
    (["estimate", "--seq-len", "-5"], "whole numbers >= 1"),
    (["estimate", "--batch", "abc"], "whole numbers >= 1"),
    (["estimate", "--model", "EMPTY_CONFIG"], "no usable attention shape"),
    (["advise", "--context", "1024", "--memory-budget", "0"], "expected a size"),
    (["advise", "--context", "1024", "--memory-budget", "10XB"], "expected a size"),
    (["advise", "--context", "0", "--memory-budget", "1GiB"], "--context: expected a number > 0"),
    (["advise", "--context", "1024", "--concurrency", "-3", "--memory-budget", "1GiB"], "expected a number > 0"),
    (["advise", "--context", "1024", "--memory-budget", "1GiB", "--bench", "LIST_JSON"], "not a results.json"),
    (["advise", "--context", "1024", "--memory-budget", "1GiB", "--min-agreement", "1.5"],
     "--min-agreement: expected a share above 0 and at most 1, or off (no agreement bound), got '1.5'"),
    (["advise", "--context", "1024", "--memory-budget", "1GiB", "--min-agreement", "0"], "got '0'"),
    (["advise", "--context", "1024", "--memory-budget", "1GiB", "--min-agreement", "-0.5"], "above 0 and at most 1"),
    (["advise", "--context", "1024", "--memory-budget", "1GiB", "--min-agreement", "nan"], "above 0 and at most 1"),
    (["advise", "--context", "1024", "--memory-budget", "1GiB", "--bench", "NOT_JSON"],
     "--bench NOT_JSON: not JSON (Expecting value at line 1, column 1)"),
    (["advise", "--context", "1024", "--memory-budget", "1GiB", "--bench", "BINARY"],
     "--bench BINARY: not a results.json written by kvserve bench (byte 0 is not UTF-8 text)"),
    (["advise", "--context", "1024", "--memory-budget", "1GiB", "--bench", "BAD_ROW"],
     "--bench BAD_ROW: not a results.json written by kvserve bench (rows[0].bytes_per_token is \"x\": expected a "
     "number above 0)"),
    (["advise", "--context", "1024", "--memory-budget", "1GiB", "--bench", "BAD_TPOT"],
     "(rows[0].tpot_s is missing or not seconds by context length)"),
    (["advise", "--context", "1024", "--memory-budget", "1GiB", "--max-ppl-increase", "-1"], "expected a number >= 0"),
    (["advise", "--context", "2048", "--memory-budget", "1GiB", "--model", "models/kjv-llama-mha"],
     "kvserve advise: --context 2048 is more than models/kjv-llama-mha's 1024 positions (max_position_embeddings)"),
    (["advise", "--context", "1024", "--memory-budget", "1GiB", "--bench", "/nonexistent.json"],
     "--bench /nonexistent.json: No such file or directory"),
    (["advise", "--context", "1024", "--memory-budget", "1GiB", "--bench", "docs/bench/results.json", "--model",
      "llama-3-8b"], "--model applies only without --bench"),
])
def test_bad_input_exits_2_with_a_message(args, message, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "NOT_JSON").write_text("results")
    (tmp_path / "BINARY").write_bytes(b"\x89PNG\r\n")
    row = {"spec": "full", "backend": "full", "bytes_per_token": "x", "perplexity_change_pct": 0.0,
           "tpot_s": {"512": 0.02}, "greedy_agreement": 1.0}
    (tmp_path / "BAD_ROW").write_text(json.dumps({"rows": [row]}))
    (tmp_path / "BAD_TPOT").write_text(json.dumps({"rows": [{**row, "bytes_per_token": 8.0, "tpot_s": [0.02]}]}))
    files = {"EMPTY_CONFIG": tmp_path, "LIST_JSON": tmp_path / "list.json"} | {
        name: tmp_path / name for name in ("NOT_JSON", "BINARY", "BAD_ROW", "BAD_TPOT")}
    args = [str(files.get(a, a)) for a in args]
    message = message.replace("NOT_JSON", str(files["NOT_JSON"])).replace("BINARY", str(files["BINARY"])).replace(
        "BAD_ROW", str(files["BAD_ROW"]))
    p = kvserve(*args)
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stderr and "Traceback" not in p.stderr and p.stdout == ""


def test_advise_default_settings_follow_the_model(model_dir):
    """Without --bench, each backend at the estimator's defaults for *this* model (mla rank 64 here, not a
    llama-2-7b number), and settings kvserve cannot serve on a model left out (on DeepSeek, natively MLA, every
    per-head backend: it hands its cache a latent)."""
    p = kvserve("advise", "--context", "1024", "--memory-budget", "64MiB", "--model", str(model_dir), "--dtype", "fp32",
                "--json")
    rows = {r["spec"]: r for r in json.loads(p.stdout)}
    assert set(rows) == {"full", "gqa", "mla", "int8", "int4", "int8:value_bits=4", "elastic", "dca", "window",
                         "snapkv", "mla+int8", "gqa+int8"}
    assert rows["mla"]["bytes_per_token"] == 64 * 4 * 8 and rows["full"]["bytes_per_token"] == 2 * 8 * 32 * 4 * 8
    ds = kvserve("advise", "--context", "4096", "--memory-budget", "1GiB", "--model", "deepseek-v3", "--json")
    assert ds.returncode == 0 and {r["spec"] for r in json.loads(ds.stdout)} == {"full", "mla", "mla+int8"}


def test_advise_names_the_model_its_bench_file_measured():
    """The reference model's bench and the real model's give opposite advice: the first line says whose it is."""
    p = kvserve("advise", "--context", "1024", "--memory-budget", "1GiB", "--bench", "docs/bench/real/results.json")
    assert p.returncode == 0, p.stderr
    assert "measured by docs/bench/real/results.json on smollm2-135m-instruct" in p.stdout.splitlines()[0]


def test_a_reader_that_closes_early_ends_the_output_quietly():
    """`kvserve advise ... | head -1` printed a BrokenPipeError traceback: a closed pipe ends the command quietly,
    with 141 (128 + SIGPIPE). The pipe's reading end is closed before the command writes, so every write fails."""
    read, write = os.pipe()
    os.close(read)
    try:
        p = subprocess.run([sys.executable, "-m", "server.cli", "advise", "--context", "1024", "--memory-budget",
                            "1GiB"], cwd=REPO, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert (p.returncode, p.stderr) == (141, "")
