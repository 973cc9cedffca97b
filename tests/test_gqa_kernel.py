"""``gqa``'s layers through the attention kernel: each group of heads encoded into its shared head and written in one
op (:func:`kernels.grouped_write`), and the attention with each query head's key and value read-backs around it in
one op (:func:`kernels.mapped_attention`), against the torch path's encode, write and attention over the same pages
gathered."""

from __future__ import annotations

import pytest
import torch

from cache_backends import kernels
from cache_backends.geometry import ModelGeometry
from cache_backends.gqa.backend import GQABackend, GroupCodec
from cache_backends.page_plan import SeqBlocks
from cache_backends.paged import in_place_layer, read_layer
from tests.test_kernels import FOUR_BIT, KERNEL_DTYPES, TIERS, CountOps, Pool, _grow

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"the attention kernel is not available: "
                                                           f"{kernels.status()['reason']}")


def _backend(heads: int, groups: int, rep: int, width: int, tier: str, seed: int) -> GQABackend:
    """A gqa backend of ``heads`` K/V heads shared as ``groups``, with random encoders and decoders per layer."""
    gen = torch.Generator().manual_seed(seed)
    backend = GQABackend(ModelGeometry(2, heads * rep, heads, width, 4), groups=groups, method="mean",
                         quantization=TIERS[tier])
    m = heads // groups

    def codec():
        return GroupCodec(torch.randn(groups, m * width, width, generator=gen) * (m * width) ** -0.5,
                          torch.randn(groups, width, m * width, generator=gen) * width ** -0.5)

    backend.codecs = [(codec(), codec()) for _ in range(2)]
    return backend


@pytest.mark.parametrize("tier", ["exact", "int8", "int4-rotated"])
@pytest.mark.parametrize("heads,groups,rep", [(4, 2, 2), (6, 3, 1)], ids=["h4g2-gqa", "h6g3-mha"])
@pytest.mark.parametrize("dtype", [d for d in KERNEL_DTYPES if d != torch.float16], ids=str)
def test_gqa_through_the_kernel_matches_the_torch_path(tier, heads, groups, rep, dtype):
    """A decode and a prefill chunk: the pages the fused write leaves equal the torch path's encode-then-write (within
    the pool dtype's rounding of fp32 sums), and the attention with the read-backs inside the op equals the torch
    path's over the same pages gathered."""
    backend = _backend(heads, groups, rep, 64, tier, seed=heads + groups)
    pool = Pool(tier, groups, 64, dtype, tokens_per_page=16, seed=3)
    rows = [SeqBlocks() for _ in range(3)]
    _grow(pool, rows, [20, 50, 90], chunk=40)
    gen = torch.Generator().manual_seed(11)
    for n in (1, 29):
        meta = pool.write(rows, [n] * 3, commit=False)
        key, value = (torch.randn(3, heads, n, 64, generator=gen).to(dtype) for _ in range(2))
        query = torch.randn(3, heads * rep, n, 64, generator=gen).to(dtype)
        out, stored = {}, {}
        for mode in ("torch", "kernel"):
            with kernels.using(mode), kernels.exact_sums(tier in FOUR_BIT):
                backend.write_paged(pool.views, 0, 0, meta, key, value)
                stored[mode] = [pool.views.exact[0][s][:, meta.write_pages, meta.write_slots].float() for s in (0, 1)]
                reads = in_place_layer(pool.views, 0) or read_layer(pool.views, 0, meta)
                out[mode] = backend.attend_paged(0, query, reads, meta, 0.125).float()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        for s in (0, 1):
            torch.testing.assert_close(stored["kernel"][s], stored["torch"][s], rtol=tol, atol=tol)
        torch.testing.assert_close(out["kernel"], out["torch"], rtol=10 * tol, atol=10 * tol)
        pool.commit()


def test_a_gqa_decode_steps_kv_path_is_two_ops_per_layer():
    """With the kernel a gqa decode step encodes and writes a layer's K/V in one op and attends, read-backs
    included, in one; the torch path takes reshapes, matmuls, a gather and the attention's ops."""
    backend = _backend(4, 2, 2, 64, "int8", seed=1)
    pool = Pool("int8", 2, 64, torch.float32, tokens_per_page=16, seed=5)
    rows = [SeqBlocks() for _ in range(4)]
    _grow(pool, rows, [50, 60, 70, 80], chunk=64)
    backend._folded(0)  # the read-backs per query head: made once
    counts = {}
    for mode in ("kernel", "torch"):
        with kernels.using(mode):
            meta = pool.write(rows, [1] * 4, commit=False)
            key, value, query = torch.randn(4, 4, 1, 64), torch.randn(4, 4, 1, 64), torch.randn(4, 8, 1, 64)
            with CountOps() as counter:
                backend.write_paged(pool.views, 0, 0, meta, key, value)
                reads = in_place_layer(pool.views, 0) or read_layer(pool.views, 0, meta)
                backend.attend_paged(0, query, reads, meta, 0.125)
            pool.commit()
            counts[mode] = counter.ops
    assert counts["kernel"] == ["paged_grouped_write", "paged_mapped_attention"], counts["kernel"]
    assert len(counts["torch"]) > 8
