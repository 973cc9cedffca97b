"""bench.longctx: the streams of one context take turns step by step, and its rows carry the ratios to `full`."""

import json

from bench import longctx


class Recorded:
    """A stand-in stream: ``prefill`` steps until its first token, each step taking ``cost`` seconds."""

    def __init__(self, name, prefill, cost, order):
        self.name, self.left, self.cost, self.order = name, prefill, cost, order
        self.seq = type("Seq", (), {"output_ids": [], "kv_stored_bytes": 0})()
        self.kv_bytes = 0
        self.prefill_s, self.step_s, self.closed = 0.0, [], False

    def step(self):
        self.order.append(self.name)
        self.left -= 1
        self.seq.kv_stored_bytes += 10
        if self.left <= 0:
            self.seq.output_ids.append(0)
        return self.cost

    def close(self):
        self.closed = True


def test_streams_take_turns_and_count_their_own_steps():
    order = []
    a, b = Recorded("a", 3, 0.5, order), Recorded("b", 1, 2.0, order)
    rows = longctx.interleave([a, b], steps=2)
    # b's prompt is one chunk: it waits (is not stepped) while a finishes prefill, then both decode in turn
    assert order == ["a", "b", "a", "a", "a", "b", "a", "b"]
    assert rows == [{"ttft_s": 1.5, "tpot_ms": 500.0, "kv_bytes_at_context": 30},
                    {"ttft_s": 2.0, "tpot_ms": 2000.0, "kv_bytes_at_context": 10}]  # held at the first token
    assert a.closed and b.closed


def test_rows_on_the_reference_model(tmp_path):
    out = tmp_path / "longctx.json"
    assert longctx.main(["--model", "models/kjv-llama-mha", "--contexts", "128", "--backends", "full", "int8",
                         "--paths", "kernel", "torch", "--chunk", "32", "--decode-steps", "2",
                         "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["path"]) for r in rows] == [("full", "kernel"), ("full", "torch"),
                                                         ("int8", "kernel"), ("int8", "torch")]
    assert all(r["ttft_s"] > 0 and r["tpot_ms"] > 0 for r in rows)
    full, int8 = rows[0], rows[2]
    assert full["ttft_vs_full"] == full["tpot_vs_full"] == 1.0
    # what the sequence holds once its 128 prompt tokens are cached, as the engine measures it
    assert full["kv_bytes_at_context"] == 128 * 8 * 2 * 8 * 32 * 4  # 8 layers, K and V, 8 K/V heads of 32, fp32
    assert int8["kv_bytes_at_context"] < full["kv_bytes_at_context"]
    assert int8["byte_bound_vs_full"] < 1.0
