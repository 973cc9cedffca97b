"""The attention kernel's post-hoc latent form (``torch.ops.kvserve.paged_latent_attention``: ``mla`` on an MHA/GQA
model, keys rebuilt block by block inside the op, values absorbed) against the torch path it replaces
(:meth:`cache_backends.mla.MLABackend.attend_paged` over gathered pages): the same pool, the same step, the same
queries, for the latent's stored forms (exact fp32/bf16/fp16, ``mla+int8``, ``mla+int4``, rotated), GQA ratios 1/3/8,
head_dim 64/128, ranks that fill or leave a register block, page sizes that end rows on and off a page boundary,
shuffled block tables, ragged decode batches, prefill chunks, work split over KV blocks and the portable path."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
import torch

from cache_backends import kernels
from cache_backends.geometry import ModelGeometry
from cache_backends.mla.backend import LatentBasis, MLABackend
from cache_backends.page_layout import PageLayout
from cache_backends.page_plan import SeqBlocks
from cache_backends.paged import InPlaceRead, in_place_layer, read_layer
from cache_backends.pool import KVPool
from cache_backends.rope import RopeTable
from tests.test_kernels import (KERNEL_DTYPES, TIERS, TOLERANCE, Pool, _fp32, _grow, chunk_after_history,
                                ragged_decode)

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"the attention kernel is not available: "
                                                           f"{kernels.status()['reason']}")

# a post-hoc latent's stored forms: exact pages (``mla``), ``mla+int8`` and ``mla+int4`` (per channel over groups of
# 8 tokens, the newest 8 exact), and ``mla+int4:rotate=true`` (codes of the Hadamard-rotated latent)
POSTHOC_TIERS = ["exact", "int8", "int4", "int4-rotated"]
# (KV heads, GQA ratio, head_dim, rank): SmolLM2-135M's (3 x 3, 64, its default rank 48), a rank off the register
# block of four tokens' rebuild, MHA, GQA 8 at head_dim 128
POSTHOC_SHAPES = [(3, 3, 64, 48), (2, 1, 64, 30), (1, 8, 128, 64), (4, 2, 128, 256)]
POSTHOC_IDS = [f"h{h}x{r}-d{d}-r{k}" for h, r, d, k in POSTHOC_SHAPES]


class PosthocPool(Pool):
    """A pool of ``mla``'s post-hoc latent over two layers of an MHA/GQA model (one stream, one head, ``rank`` wide;
    exact, or quantized per channel as ``mla+int8`` / ``mla+int4`` store it), with a random orthonormal basis per layer
    and the backend's own page layout and attention."""

    def __init__(self, heads: int, rep: int, head_dim: int, rank: int, dtype: torch.dtype, tokens_per_page: int,
                 seed: int, tier: str = "exact"):
        geometry = ModelGeometry(2, heads * rep, heads, head_dim, dtype.itemsize)
        self.backend = MLABackend(geometry, rank=rank, quantization=TIERS[tier])
        gen = torch.Generator().manual_seed(seed)
        bases = []
        for _ in range(2):
            q, _ = torch.linalg.qr(torch.randn(2 * heads * head_dim, rank, generator=gen))
            bases.append(LatentBasis(q, 0.3 * torch.randn(2 * heads * head_dim, generator=gen)))
        self.backend.bases, self.backend.rope = bases, RopeTable.llama(head_dim, 4096, dtype=dtype)
        spec = self.backend.kv_spec()
        page = -(-spec.exact_bytes(tokens_per_page, aligned=True) // 64) * 64
        self.layout = PageLayout(spec, dtype, page)
        assert kernels.fits(self.layout) and kernels.is_posthoc_latent(self.layout)
        self.pool = KVPool(400, self.layout.page_bytes, {"b": self.layout}, "cpu")
        self.pool.arena.zero_()
        self.views = self.pool.views["b"]
        self.gen = gen
        self.free = list(range(1, 400))
        random.Random(seed).shuffle(self.free)
        self.heads, self.rep, self.head_dim, self.rank, self.dtype = heads, rep, head_dim, rank, dtype
        self.twin = None

    def new_tokens(self, batch: int, n: int) -> list[torch.Tensor]:
        """One layer's random new latents, (batch, 1, n, rank), of the scale a basis gives real K/V (a few units)."""
        return [(3 * torch.randn(batch, 1, n, self.rank, generator=self.gen)).to(self.dtype)]

    def compare(self, meta, rep: int = 0) -> None:
        """The backend's attention through the kernel (the pages read in place) and through the torch path (gathered),
        over every layer with random queries: within the output's rounding of the torch path run in fp32 on the same
        stored latent, and no further from it than the torch path in the model dtype."""
        scaling = self.head_dim ** -0.5
        for layer in range(2):
            query = torch.randn(meta.batch, self.heads * self.rep, meta.n, self.head_dim, generator=self.gen)
            query = query.to(self.dtype)
            with kernels.using("torch"):
                reads = read_layer(self.views, layer, meta)
                ref = self.backend.attend_paged(layer, query, reads, meta, scaling)
                gold = self.backend.attend_paged(layer, query.float(), [_fp32(r) for r in reads], meta, scaling)
            with kernels.using("kernel"):
                in_place = in_place_layer(self.views, layer)
                assert isinstance(in_place[0], InPlaceRead)
                got = self.backend.attend_paged(layer, query, in_place, meta, scaling)
            assert got.shape == ref.shape == (meta.batch, self.heads * self.rep, meta.n, self.head_dim)
            assert got.dtype == ref.dtype == self.dtype
            tol = 2 * TOLERANCE[self.dtype]  # the value side's product rounds in the model dtype, after the op's
            scale = max(1.0, float(gold.abs().max()))
            torch.testing.assert_close(got.float(), gold, rtol=tol, atol=tol * scale)
            assert (got.float() - gold).abs().max() <= max((ref.float() - gold).abs().max(), tol * scale)


@pytest.mark.parametrize("tier", POSTHOC_TIERS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("heads,rep,head_dim,rank", POSTHOC_SHAPES, ids=POSTHOC_IDS)
def test_posthoc_mla_decode_of_a_ragged_batch_matches_the_torch_path(heads, rep, head_dim, rank, dtype, tier):
    """Rows of 1, 7, 16 (a page boundary), 45 and 130 tokens decoding together (quantized tiers drain a group inside
    the steps): the keys rebuilt and rotated inside the op give the torch path's rebuilt-K attention."""
    pool = PosthocPool(heads, rep, head_dim, rank, dtype, tokens_per_page=16, seed=rank + head_dim, tier=tier)
    ragged_decode(pool, 3 if tier != "exact" else 2)


@pytest.mark.parametrize("tier", POSTHOC_TIERS)
@pytest.mark.parametrize("dtype", [d for d in KERNEL_DTYPES if d != torch.float16], ids=str)
@pytest.mark.parametrize("heads,rep,head_dim,rank", POSTHOC_SHAPES[:3], ids=POSTHOC_IDS[:3])
def test_posthoc_mla_prefill_chunk_over_stored_pages_matches_the_torch_path(heads, rep, head_dim, rank, dtype, tier):
    """A 37-token chunk (causal within it; quantized tiers drain groups inside it) after 70 stored tokens (most of
    them codes when quantized), and the first chunk of an empty row."""
    pool = PosthocPool(heads, rep, head_dim, rank, dtype, tokens_per_page=16, seed=3 * rank + head_dim, tier=tier)
    chunk_after_history(pool)


@pytest.mark.parametrize("tier", POSTHOC_TIERS)
@pytest.mark.parametrize("splits", [1, 3])
def test_a_prefill_chunk_at_a_rank_above_head_dim_rebuilds_values_as_the_torch_path_sums(splits, tier, monkeypatch):
    """Rank 160 over head_dim 64, GQA 3: a chunk of 37 tokens (111 rows a tile) is past the point (107 rows) where the
    op rebuilds each block's values instead of summing the latent, a 20-token chunk (60 rows) short of it; both,
    whole or split over units, give the torch path's output (which always sums the latent)."""
    monkeypatch.setenv("KVSERVE_KERNEL_SPLITS", str(splits))
    pool = PosthocPool(2, 3, 64, 160, torch.float32, tokens_per_page=16, seed=11, tier=tier)
    rows = [SeqBlocks()]
    _grow(pool, rows, [90], chunk=45)
    pool.compare(pool.write(rows, [37], commit=False))
    pool.compare(pool.write(rows, [20], commit=False))
    pool.compare(pool.write([SeqBlocks()], [37], commit=False))


@pytest.mark.parametrize("tier", POSTHOC_TIERS)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("tokens_per_page", [8, 13])
def test_posthoc_mla_pages_splits_and_shuffled_tables(tokens_per_page, splits, tier, monkeypatch):
    """Pages of 8 and 13 tokens, a shuffled free list, each row's blocks whole or split over work units (a split's
    share of a quantized row may start or end inside a group), a long row whose positions pass a page boundary
    mid-block: the torch path's output for a ragged decode and a prefill chunk."""
    monkeypatch.setenv("KVSERVE_KERNEL_SPLITS", str(splits))
    pool = PosthocPool(3, 3, 64, 48, torch.float32, tokens_per_page=tokens_per_page, seed=tokens_per_page, tier=tier)
    rows = [SeqBlocks() for _ in range(3)]
    _grow(pool, rows, [9, 40, 300], chunk=64)
    pages = [p for b in rows for p in b.q + b.exact]
    assert pages != sorted(pages)
    pool.compare(pool.write(rows, [1, 1, 1], commit=False))
    pool.compare(pool.write([rows[1]], [29], commit=False))


def test_posthoc_mla_keys_are_rotated_at_each_tokens_position():
    """The op's keys are RoPE'd at each slot's own position: with the table of another position (each position's
    cos and sin shifted by one row) the output changes, and the torch path given the same shifted table agrees
    with it again, so the positions the op reads are the step's own."""
    pool = PosthocPool(2, 1, 64, 30, torch.float32, tokens_per_page=16, seed=5)
    rows = [SeqBlocks()]
    _grow(pool, rows, [50], chunk=50)
    meta = pool.write(rows, [1], commit=False)
    query = torch.randn(1, 2, 1, 64, generator=pool.gen)
    with kernels.using("kernel"):
        in_place = in_place_layer(pool.views, 0)
        before = pool.backend.attend_paged(0, query, in_place, meta, 0.125)
        rope = pool.backend.rope
        rope.cos, rope.sin, rope._float = rope.cos[1:], rope.sin[1:], None
        shifted = pool.backend.attend_paged(0, query, in_place, meta, 0.125)
    with kernels.using("torch"):
        ref = pool.backend.attend_paged(0, query, read_layer(pool.views, 0, meta), meta, 0.125)
    assert (before - shifted).abs().max() > 1e-3
    torch.testing.assert_close(shifted, ref, rtol=1e-4, atol=1e-4)


def test_a_rotated_posthoc_latent_is_read_in_place_with_rotated_bases():
    """``mla+int4:rotate=true`` on an MHA/GQA model: the op reads the rotated codes (:func:`kernels.fits`), rebuilding
    them with ``R P`` (the bases it is handed besides ``P``)."""
    from cache_backends.kv_spec import Quantization

    geometry = ModelGeometry(2, 6, 2, 64, 4)
    backend = MLABackend(geometry, rank=32, quantization=Quantization(8, 8, 4, 4, rotate=True))
    layout = PageLayout(backend.kv_spec(), torch.float32, 64 * 1024)
    assert kernels.is_posthoc_latent(layout) and kernels.fits(layout)
    q, _ = torch.linalg.qr(torch.randn(256, 32))
    backend.bases = [LatentBasis(q, torch.zeros(256))] * 2
    bases = backend._kernel_bases(0)
    from cache_backends.quant import hadamard

    assert len(bases) == 5 and torch.allclose(bases[4][0], hadamard(32) @ bases[0], atol=1e-6)


def test_the_op_refuses_shapes_that_do_not_match_its_layout():
    """A key basis of the wrong rank or head_dim, a value basis unlike the key's, or positions that do not cover the
    tables' slots: a clear error, never a read outside the tensors."""
    pool = PosthocPool(2, 1, 64, 30, torch.float32, tokens_per_page=16, seed=7)
    rows = [SeqBlocks()]
    _grow(pool, rows, [20], chunk=20)
    meta = pool.write(rows, [1], commit=False)
    read = in_place_layer(pool.views, 0)[0]
    query = torch.randn(1, 2, 1, 64)
    up, mean, v_up, v_mean = pool.backend._kernel_bases(0)
    cos, sin = pool.backend.rope.float_tables(64)
    with pytest.raises(RuntimeError, match="key_up must be"):
        kernels.latent_attention(query, read, meta, 0.125, (up[:, :16], mean, v_up, v_mean), cos, sin)
    with pytest.raises(RuntimeError, match="key_up must be"):
        kernels.latent_attention(torch.randn(1, 2, 1, 32), read, meta, 0.125, (up, mean, v_up, v_mean), cos, sin)
    with pytest.raises(RuntimeError, match="value_up and value_mean"):
        kernels.latent_attention(query, read, meta, 0.125, (up, mean, v_up[:1], v_mean), cos, sin)
    meta.positions = meta.positions[:, :-1]
    with pytest.raises(RuntimeError, match="positions must be"):
        kernels.latent_attention(query, read, meta, 0.125, (up, mean, v_up, v_mean), cos, sin)


def test_posthoc_mla_portable_kernel_matches_the_torch_path():
    """The portable C++ path on a post-hoc latent, exact and quantized, in a child process (the instruction set is
    chosen once)."""
    code = ("import torch, tests.test_kernels_mla as t; from cache_backends import kernels; "
            "assert torch.ops.kvserve.kernel_isa() == 'portable' if kernels.load() else False; "
            "t.test_posthoc_mla_decode_of_a_ragged_batch_matches_the_torch_path(3, 3, 64, 48, torch.bfloat16, "
            "'exact'); "
            "t.test_posthoc_mla_decode_of_a_ragged_batch_matches_the_torch_path(2, 1, 64, 30, torch.float32, 'int8'); "
            "t.test_posthoc_mla_prefill_chunk_over_stored_pages_matches_the_torch_path(3, 3, 64, 48, torch.float32, "
            "'int4')")
    env = {**os.environ, "KVSERVE_KERNEL_PORTABLE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_rope_tables_in_fp32_are_the_model_dtypes_widened():
    """:meth:`RopeTable.float_tables`: the model dtype's table widened to fp32, built once; a table made without a
    model (:meth:`RopeTable.llama`) is the rotation of Llama's RoPE at each position."""
    table = RopeTable.llama(8, 16, dtype=torch.bfloat16)
    cos, sin = table.float_tables(10)
    assert cos.dtype == torch.float32 and cos.shape == (16, 8) and torch.equal(cos, table.cos.float())
    assert table.float_tables(12)[0] is cos
    exact = RopeTable.llama(8, 16)
    x = torch.randn(1, 1, 5, 8)
    torch.testing.assert_close(exact.invert(exact.apply(x, 7), 7), x)
    assert math.isclose(float(exact.cos[3, 1]), math.cos(3 * 10_000 ** (-2 / 8)), rel_tol=1e-6)


@pytest.mark.parametrize("tier", ["exact", "int8"])
@pytest.mark.parametrize("dtype", [d for d in KERNEL_DTYPES if d != torch.float16], ids=str)
def test_the_fused_latent_write_stores_the_encoded_latent(tier, dtype):
    """:func:`kernels.latent_write` (RoPE undone, the mean taken off, the basis applied, the write: one op) stores the
    latent :meth:`MLABackend.encode_paged` computes in fp32, in the pool's dtype: a decode and a 37-token chunk at
    positions past a page boundary, with the groups the step drains quantized as the torch path's write does."""
    pool = PosthocPool(3, 3, 64, 48, dtype, tokens_per_page=16, seed=9, tier=tier)
    rows = [SeqBlocks() for _ in range(3)]
    _grow(pool, rows, [15, 40, 70], chunk=32)
    for n in (1, 37):
        meta = pool.write(rows, [n] * 3, commit=False)
        key, value = torch.randn(3, 3, n, 64, generator=pool.gen), torch.randn(3, 3, n, 64, generator=pool.gen)
        with kernels.using("kernel"):
            pool.backend.write_paged(pool.views, 0, 0, meta, key.to(dtype), value.to(dtype))
        stored = pool.views.exact[0][0][0, meta.write_pages, meta.write_slots].float()  # (B n, r)
        want = pool.backend.encode_paged(0, key.to(dtype).float(), value.to(dtype).float(), meta)[0]
        want = want[:, 0].reshape(-1, want.shape[-1]).to(dtype).float()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(stored, want, rtol=tol, atol=tol)
        pool.commit()


def test_a_posthoc_mla_decode_steps_kv_path_is_two_ops_per_layer():
    """With the kernel, a decode step of post-hoc ``mla`` encodes and writes a layer's latent in one op and attends in
    one (keys rebuilt, values absorbed and projected inside it): no gather, no rebuilt K the size of the context; the
    torch path encodes, gathers and rebuilds with many ops."""
    from tests.test_kernels import CountOps

    pool = PosthocPool(3, 3, 64, 48, torch.float32, tokens_per_page=16, seed=5)
    rows = [SeqBlocks() for _ in range(4)]
    _grow(pool, rows, [50, 60, 70, 80], chunk=64)
    counts = {}
    for mode in ("kernel", "torch"):
        with kernels.using(mode):
            meta = pool.write(rows, [1] * 4, commit=False)
            query = torch.randn(4, 9, 1, 64)
            key, value = torch.randn(4, 3, 1, 64), torch.randn(4, 3, 1, 64)
            pool.backend.rope.float_tables(200)  # the model's constants (built once, not per step)
            pool.backend._kernel_bases(0)
            _ = meta.query_stop  # worked out once per step, not per layer
            with CountOps() as counter:
                pool.backend.write_paged(pool.views, 0, 0, meta, key, value)
                reads = in_place_layer(pool.views, 0) or read_layer(pool.views, 0, meta)
                pool.backend.attend_paged(0, query, reads, meta, 0.125)
            pool.commit()
            counts[mode] = counter.ops
    assert counts["kernel"] == ["paged_latent_write", "paged_latent_attention"], counts["kernel"]
    assert "index_select" in counts["torch"] and len(counts["torch"]) > 10
