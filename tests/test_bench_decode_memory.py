"""bench.decode_memory: one process per backend and context, each phase's resident set read from /proc."""

import json
import sys

import pytest

from bench import decode_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


def test_the_peak_is_reset_and_read_back():
    before = decode_memory.status()
    assert before["VmHWM"] >= before["VmRSS"] > 0
    block = bytearray(64 << 20)  # 64 MiB touched, then freed: the peak keeps it until it is reset
    del block
    assert decode_memory.status()["VmHWM"] >= before["VmRSS"] + (60 << 20)
    decode_memory.reset_peak()
    after = decode_memory.status()
    assert after["VmHWM"] < before["VmRSS"] + (60 << 20)


def test_rows_on_the_reference_model(tmp_path):
    out = tmp_path / "mem.json"
    assert decode_memory.main(["--model", "models/kjv-llama-mha", "--contexts", "300", "--backends", "full", "int8",
                               "--decode-steps", "3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["context"], r["decode_steps"]) for r in rows] == [("full", 300, 3), ("int8", 300, 3)]
    full, int8 = rows
    # 300 tokens x 8 layers x K and V of 8 heads x 32 fp32 (16 KiB a token), in 16-token pages: 19 pages
    assert full["kv_held_mib"] == pytest.approx(19 * 16 * 16384 / (1 << 20))
    assert int8["kv_held_mib"] < full["kv_held_mib"]
    for r in rows:
        assert r["runtime_mib"] < r["after_load_mib"] <= r["after_prefill_mib"] <= r["decode_peak_mib"]
        assert r["weights_mib"] > 0 and r["pool_mib"] >= r["kv_held_mib"]
        # the weights count by their bytes: a mapped file's pages are not resident until a forward reads them
        assert r["beyond_mib"] == pytest.approx(r["decode_peak_mib"] - r["runtime_mib"] - r["weights_mib"]
                                                - r["kv_held_mib"])
        assert r["peak_vs_weights_pool_pct"] == pytest.approx(
            100 * (r["decode_peak_mib"] - r["runtime_mib"]) / (r["weights_mib"] + r["pool_mib"]))


def test_a_bad_spec_is_refused_before_any_run(capsys):
    assert decode_memory.main(["--backends", "int8:bits"]) == 2
    assert "expected key=value" in capsys.readouterr().err

