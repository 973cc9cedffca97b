"""bench.decode_memory: one process per backend and context, each phase's resident set read from /proc."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import decode_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


PEAK_PROBE = """
import mmap
from bench import decode_memory
before = decode_memory.status()
assert before["VmHWM"] >= before["VmRSS"] > 0
block = mmap.mmap(-1, 64 << 20)  # 64 MiB touched, then unmapped: the peak keeps it until it is reset
block.write(b"\\1" * (64 << 20))
block.close()
assert decode_memory.status()["VmHWM"] >= before["VmRSS"] + (60 << 20)
decode_memory.reset_peak()
after = decode_memory.status()
assert after["VmHWM"] < before["VmRSS"] + (60 << 20), (before, after)
"""


def test_the_peak_is_reset_and_read_back():
    # in a process of its own: in a test worker, other threads (servers, engines of earlier tests) allocate
    # between the reads
    subprocess.run([sys.executable, "-c", PEAK_PROBE], check=True, timeout=120, cwd=Path(__file__).parent.parent)


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

