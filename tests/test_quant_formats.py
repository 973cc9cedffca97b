"""The code formats (:mod:`cache_backends.quant_formats`): a quantization width is one row of one table, and the
declarations, width checks, byte counts, page slabs, packing and the quality budget's ranks read it."""

from __future__ import annotations

import pytest
import torch

from cache_backends import catalog, quant, quant_formats
from cache_backends.geometry import ModelGeometry
from cache_backends.kv_spec import KVSpec, Quantization, StreamSpec, scale_bytes
from cache_backends.page_layout import PageLayout
from cache_backends.quant_formats import BITS, CodeFormat, code_format, width_multiple, width_refusal
from cache_backends.registry import create
from server.quality_budget import candidates, rank_multiple


def test_the_table_holds_int8_and_int4():
    assert BITS == (4, 8)
    eight, four = code_format(8), code_format(4)
    assert (eight.per_byte, eight.code_dtype, eight.code_min, eight.code_max) == (1, "int8", -128, 127)
    assert (four.per_byte, four.code_dtype, four.code_min, four.code_max) == (2, "uint8", 0, 15)
    assert [scale_bytes(8, b) for b in (4, 2)] == [4, 2] and [scale_bytes(4, b) for b in (4, 2)] == [2, 2]
    assert quant.scale_dtype(4, torch.float32) == torch.float16 and quant.scale_dtype(8, torch.float32) == torch.float32
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        code_format(3)


def test_the_declarations_take_their_bit_choices_from_the_table():
    for name, option in (("int8", "key_bits"), ("int8", "value_bits"), ("int4", "key_bits"), ("elastic", "bits")):
        assert catalog.get(name).option(option).choices == BITS, (name, option)


def test_the_width_rule_is_the_formats():
    assert width_multiple(8) == 1 and width_multiple(4) == width_multiple(8, 4) == 2 and width_multiple() == 1
    assert width_refusal(33, "a stream width of 33", 8) is None
    assert width_refusal(33, "rank=33", 8, 4) == "4-bit codes pack two channels per byte: rank=33 must be even"
    with pytest.raises(ValueError, match="two channels per byte: a stream width of 33 must be even"):
        KVSpec((StreamSpec(1, 33, "token"),), 2, 2, Quantization(32, 32, key_bits=8, value_bits=4))
    KVSpec((StreamSpec(1, 33, "channel"),), 2, 2, Quantization(32, 32, key_bits=8, value_bits=4))  # 8-bit keys
    with pytest.raises(ValueError, match="two channels per byte: a stream width of 33 must be even"):
        create("int4", ModelGeometry(2, 1, 1, 33, 4))
    with pytest.raises(ValueError, match="mla\\+int4: 4-bit codes pack two channels per byte: rank=7 must be even"):
        create("mla+int4", ModelGeometry(2, 2, 2, 16, 4), rank=7)


@pytest.mark.parametrize("bits", BITS)
def test_packing_round_trips_and_the_page_slab_is_the_formats(bits):
    fmt = code_format(bits)
    q, _, _ = quant.quantize(torch.randn(2, 3, 5, 16), -1, bits)
    packed = quant.pack(q, bits)
    assert packed.dtype == quant.code_dtype(bits) and packed.shape[-1] == 16 // fmt.per_byte
    assert torch.equal(quant.widen(packed, bits, torch.int16), q.to(torch.int16))
    spec = KVSpec((StreamSpec(2, 16, "channel"), StreamSpec(2, 16, "token")), 1, 4,
                  Quantization(8, 8, key_bits=bits, value_bits=bits))
    layout = PageLayout(spec, torch.float32, spec.block_bytes(16))
    codes, scale, _ = layout.q_slabs[0][0]
    assert codes.dtype == quant.code_dtype(bits) and codes.width == fmt.code_bytes(16)
    assert scale.dtype == quant.scale_dtype(bits, torch.float32)


def test_a_new_width_is_one_row(monkeypatch):
    """A 2-bit row (four codes a byte) packs, unpacks, counts its bytes and states its width rule with no other
    change: nothing else branches on the width."""
    monkeypatch.setitem(quant_formats.FORMATS, 2, CodeFormat(2, per_byte=4, code_dtype="uint8", code_min=0,
                                                             code_max=3, scale_max_bytes=2))
    q, scale, zero = quant.quantize(torch.randn(1, 2, 3, 8), -1, 2)
    assert int(q.min()) >= 0 and int(q.max()) <= 3
    packed = quant.pack(q, 2)
    assert packed.shape[-1] == 2 and torch.equal(quant.widen(packed, 2, torch.int16), q.to(torch.int16))
    assert KVSpec((StreamSpec(1, 8, "token"),), 1, 4, Quantization(1, 0, 2, 2)).q_bytes(1) == 2 + 2 * 2
    assert width_refusal(6, "width 6", 2) == "2-bit codes pack four channels per byte: width 6 must be a multiple of 4"
    with pytest.raises(ValueError, match="four channels per byte"):
        quant.pack(q[..., :6], 2)


def test_the_budgets_ranks_keep_the_tiers_width_rule():
    """The quality budget's rank ladder is rounded up to the tier's width multiple (int4, k8v4: even), from the
    declarations: the ranks it tries are ranks the composition can build."""
    geometry = ModelGeometry(2, 1, 1, 24, 4)  # 2 H d = 48: the ladder is 3, 6, 9, ... 48
    ladder = [3 * k for k in range(1, 17)]
    assert candidates("mla", "rank", geometry, {}) == ladder
    assert candidates("mla+int8", "rank", geometry, {}) == ladder
    even = [r + r % 2 for r in ladder]
    assert candidates("mla+int4", "rank", geometry, {}) == even
    assert candidates("mla+int8", "rank", geometry, {"value_bits": 4}) == even
    assert rank_multiple("mla+int4", {}) == 2 and rank_multiple("mla", {}) == 1
    for rank in candidates("mla+int4", "rank", geometry, {}):
        create("mla+int4", geometry, rank=rank)
