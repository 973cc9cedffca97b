"""``kvserve::skinny_linear`` (a decode step's few rows times a weight) against ``torch.nn.functional.linear``, and
:mod:`server.engine.decode_linear`, which gives the engine's model that forward (#42: on SmolLM2-135M, one thread, a
batch-6 decode step's linear layers took 1.9x a batch-1 step's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cache_backends import kernels
from server.engine import decode_linear
from server.engine.decode_linear import MAX_ROWS, MIN_ROWS, DecodeLinear

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"the kernels are not available: "
                                                           f"{kernels.status()['reason']}")


@pytest.mark.parametrize("rows,k,n,bias", [(1, 576, 1536, False), (3, 576, 192, True), (6, 1536, 576, False),
                                           (5, 13, 7, True), (12, 64, 1, False), (7, 8, 3, True), (16, 256, 33, False)])
@pytest.mark.parametrize("lead", [(), (1,), (2,)])
def test_the_op_is_linear_within_fp32_rounding(rows, k, n, bias, lead):
    """Every row count (the op takes any; the module sends it 3-12), widths that are not a multiple of 8, an odd
    number of output features, a bias, leading dimensions: within the rounding of fp32 sums in another order."""
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(*lead, rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = torch.ops.kvserve.skinny_linear(x, w, b)
    want = F.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_other_dtypes_and_layouts_go_through_linear():
    """bf16 input, a transposed (non-contiguous) weight and a bias of the wrong dtype are handed to ``at::linear``:
    the same result as ``F.linear`` to the bit."""
    x = torch.randn(4, 32)
    w = torch.randn(48, 32)
    assert torch.equal(torch.ops.kvserve.skinny_linear(x.bfloat16(), w.bfloat16(), None),
                       F.linear(x.bfloat16(), w.bfloat16()))
    wt = torch.randn(32, 48).t()
    assert torch.equal(torch.ops.kvserve.skinny_linear(x, wt, None), F.linear(x, wt))


def test_the_module_sends_only_a_decode_step_s_rows_to_the_op(monkeypatch):
    """One or two rows (``generate()`` at batch 1), a prefill chunk, and anything autograd must see keep
    ``F.linear``; 3-12 fp32 rows take the op."""
    layer = nn.Linear(32, 48)
    layer.__class__ = DecodeLinear
    calls = []
    real = torch.ops.kvserve.skinny_linear

    class Ops:
        @staticmethod
        def skinny_linear(*args):
            calls.append(args[0].shape)
            return real(*args)

    monkeypatch.setattr(torch.ops, "kvserve", Ops)
    with torch.no_grad():
        for rows in (1, 2, MIN_ROWS, 6, MAX_ROWS, MAX_ROWS + 1, 256):
            x = torch.randn(1, rows, 32)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert [s[1] for s in calls] == [MIN_ROWS, 6, MAX_ROWS]
    calls.clear()
    layer(torch.randn(6, 32)).sum().backward()  # the weight requires grad: F.linear, and a gradient
    assert calls == [] and layer.weight.grad is not None
    with torch.no_grad(), kernels.using("torch"):  # the reference path, though installed before
        layer(torch.randn(6, 32))
    assert calls == []


def test_install_turns_fp32_cpu_linears_only_where_the_kernels_serve():
    """The engine's model gets the forward on the CPU in fp32 with the kernels serving; ``KV_ATTENTION=torch`` (the
    reference path) and bf16 weights keep every ``nn.Linear`` as it is."""
    def model(dtype=torch.float32):
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).to(dtype)

    m = model()
    assert decode_linear.install(m) == 2 and all(type(x) is DecodeLinear for x in (m[0], m[2]))
    with kernels.using("torch"):
        m = model()
        assert decode_linear.install(m) == 0 and type(m[0]) is nn.Linear
    m = model(torch.bfloat16)
    assert decode_linear.install(m) == 0 and type(m[0]) is nn.Linear


def test_the_engine_s_batched_greedy_tokens_match_each_prompt_alone(ref_model):
    """Six prompts decoded together (every linear layer through the op at 6 rows) give each prompt's greedy
    tokens alone (1 row: ``F.linear``), on the reference model."""
    from tests.engine_helpers import make_engine, make_seq, run_all

    model, tok = ref_model
    prompts = ["In the beginning", "And God said", "The LORD is my shepherd", "Blessed are the meek",
               "And it came to pass", "Let there be light"]
    together = [make_seq(tok, p, 24) for p in prompts]
    run_all(make_engine(model, tok, max_batch_size=8), together)
    for i, p in enumerate(prompts):
        alone = make_seq(tok, p, 24)
        run_all(make_engine(model, tok, max_batch_size=1), [alone])
        assert together[i].output_ids == alone.output_ids, p
    assert any(type(x) is DecodeLinear for x in model.modules())
