"""The engine core's messages (server/engine/messages.py): each kind survives msgpack encoding with its values, and
bytes that are not a message of the right direction are refused."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from server.engine import messages as m


def test_every_input_round_trips():
    add = m.AddRequest("r1", [1, 2, 3], 7, m.Sampling(do_sample=True, temperature=0.5, logit_bias=[(4, -1.5)],
                                                        top_n=2, seed=11), "full", group="g", cache_salt="s",
                       want_prompt_logprobs=True)
    for msg in (add, m.Abort(["r1", "r2"]), m.Drain()):
        back = m.decode_input(m.encode(msg))
        assert back == msg and type(back) is type(msg)
    assert m.decode_input(m.encode(add)).sampling.logit_bias == [(4, -1.5)]


def test_every_output_round_trips():
    step = m.StepOutput(
        new=[m.NewToken("r1", 42, -0.25, [(42, -0.25), (7, -2.0)]), m.NewToken("r2", 3, -1.0)],
        finished=[m.Finished("r2", "length", cached_tokens=16, kv_stored_bytes=4096, peak_kv_stored_bytes=8192,
                             kv_stats={"dca_fallbacks": 1, "compressed_fraction": 0.5},
                             prompt_logprobs=[None, -1.5], prompt_top_logprobs=[None, [(5, -0.5)]],
                             timings=m.Timings(1.0, 2.0, 3.0))],
        accepted=["r3"], rejected=[m.Rejected("r4", "overloaded", "full")],
        stats=m.CoreStats(running=1, waiting=2, kv_held_bytes=10, kv_stored_bytes=5, kv_usage=0.25, evictable_blocks=3))
    for msg in (step, m.Ready([0, 2], ["full", "int8"], 2048, {"kv_block_size": 16}), m.Failed("no model", True),
                m.Loading("model loaded; calibrating")):
        back = m.decode_output(m.encode(msg))
        assert back == msg and type(back) is type(msg)


def test_sampling_carries_every_field_of_sampling_params():
    from server.engine.sampling import SamplingParams  # the test may import torch; messages.py does not

    params = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(m.Sampling.__struct_fields__) == params


def test_a_message_of_the_other_direction_or_garbage_is_refused():
    with pytest.raises(msgspec.DecodeError):
        m.decode_input(m.encode(m.StepOutput()))
    with pytest.raises(msgspec.DecodeError):
        m.decode_output(m.encode(m.Abort(["x"])))
    with pytest.raises(msgspec.DecodeError):
        m.decode_input(b"\xc1")
    with pytest.raises(msgspec.ValidationError):
        m.decode_input(msgspec.msgpack.encode({"type": "AddRequest", "request_id": "r"}))  # fields missing
