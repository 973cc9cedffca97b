"""The attention kernel (``torch.ops.kvserve.paged_attention``) against the torch path it replaces: the same pool, the
same step, the same queries, read in place by the kernel or gathered and attended by
:func:`cache_backends.paged_attention.attend_pair`, for every stored form a K/V pair takes (exact fp32/bf16/fp16,
int8, int4, k8v4, a rotated tier, an on-demand tier) and a native-MLA latent takes (exact, ``mla+int8``, ``mla+int4``,
rotated), GQA ratios 1/3/8, head_dim 64/128/256, page sizes that leave rows ending on and off a page boundary,
shuffled block tables, ragged decode batches and prefill chunks."""

from __future__ import annotations

import os
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cache_backends import kernels
from cache_backends.kv_spec import KVSpec, Quantization, kv_streams
from cache_backends.page_layout import PageLayout
from cache_backends.paged import InPlaceRead, in_place_layer, read_layer, write_layer
from cache_backends.paged_attention import attend_pair
from cache_backends.page_plan import SeqBlocks
from cache_backends.pool import KVPool
from cache_backends.step_meta import StepMeta
from server.model_loading import DTYPES

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"the attention kernel is not available: "
                                                           f"{kernels.status()['reason']}")

TIERS = {
    "exact": None,
    "int8": Quantization(8, 8),
    "int4": Quantization(8, 8, 4, 4),
    "int4-rotated": Quantization(8, 8, 4, 4, rotate=True),
    "k8v4": Quantization(8, 8, 8, 4),
    "on-demand": Quantization(8, None, window=4),
}
# (KV heads, GQA ratio, head_dim)
SHAPES = [(2, 1, 64), (1, 3, 128), (1, 8, 256), (3, 3, 64)]
# The dtypes the value tests run in (DTYPE; unset or auto: all three; the fast tier sets float32)
KERNEL_DTYPES = [d for d in (torch.float32, torch.bfloat16, torch.float16)
                 if os.environ.get("DTYPE", "auto") in ("", "auto") or DTYPES.get(os.environ["DTYPE"]) == d]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 8e-3, torch.float16: 1e-3}  # about 2 roundings of the output
# tiers with 4-bit keys: a decode's few rows score them in integers (the query rounded to int8 once per key group),
# which the torch path does not do; they are compared with fp32 sums too (KVSERVE_KERNEL_EXACT_SUMS=1)
FOUR_BIT = {t for t, q in TIERS.items() if q is not None and q.key_bits == 4}


def _fp32(read):
    """A gathered stream with its exact tokens, scales and zero points in fp32 (its codes as they are)."""
    from cache_backends.paged import StreamRead

    q = None if read.codes is None else (read.codes, read.scale.float(), read.zero.float())
    return StreamRead(read.exact.float(), q, read.axis, read.group_size, read.bits, read.rotate)


class Pool:
    """A pool of one K/V layout over two layers, written with random K/V through the serving path's own planning
    (:meth:`PageLayout.plan`, ``extend``, :func:`write_layer`, ``commit``), pages handed out in a shuffled order."""

    def __init__(self, tier: str, heads: int, width: int, dtype: torch.dtype, tokens_per_page: int, seed: int):
        spec = KVSpec(tuple(kv_streams(heads, width)), 2, dtype.itemsize, TIERS[tier])
        page = -(-spec.exact_bytes(tokens_per_page, aligned=True) // 64) * 64
        self.layout = PageLayout(spec, dtype, page)
        self.pool = KVPool(400, self.layout.page_bytes, {"b": self.layout}, "cpu")
        self.pool.arena.zero_()  # pages never handed out are compared too (test_the_fused_write_...)
        self.views = self.pool.views["b"]
        self.gen = torch.Generator().manual_seed(seed)
        self.free = list(range(1, 400))
        random.Random(seed).shuffle(self.free)
        self.heads, self.width, self.dtype = heads, width, dtype
        # a 4-bit tier's exact twin: the same tokens in exact pages, for the error the codes themselves make
        self.twin = Pool("exact", heads, width, dtype, tokens_per_page, seed) if tier in FOUR_BIT else None
        self.twin_rows: dict[int, tuple[SeqBlocks, SeqBlocks]] = {}  # id(row): (row, kept alive; its twin's row)

    def write(self, rows: list[SeqBlocks], lengths: list[int], commit: bool = True,
              tokens: list[list[torch.Tensor]] | None = None) -> StepMeta:
        """Write ``lengths[i]`` random tokens (``tokens``: these, per layer) into row ``i`` (one step) and return the
        step's metadata; ``commit``: apply the step to the tables now (else :meth:`commit` does, after a
        comparison). A twin is written the same tokens."""
        n = lengths[0]
        tokens = tokens or [self.new_tokens(len(rows), n) for _ in range(2)]
        if self.twin is not None:
            twins = [self.twin_rows.setdefault(id(b), (b, SeqBlocks()))[1] for b in rows]
            self.twin_meta = self.twin.write(twins, lengths, commit, tokens)
        plans = []
        for blocks in rows:
            plan = self.layout.plan(blocks, n)
            pages = [self.free.pop() for _ in range(plan.pages_needed)]
            self.pool.zero(pages)
            self.layout.extend(blocks, plan, pages[: plan.new_exact_pages], pages[plan.new_exact_pages:])
            plans.append(plan)
        meta = StepMeta(self.layout, list(zip(rows, plans)), "cpu")
        for layer in range(2):
            write_layer(self.views, layer, meta, tokens[layer])
        self.pending = list(zip(rows, plans))
        if commit:
            self.commit()
        return meta

    def new_tokens(self, batch: int, n: int) -> list[torch.Tensor]:
        """One layer's random new K and V, (batch, heads, n, width) each."""
        return [torch.randn(batch, self.heads, n, self.width, generator=self.gen).to(self.dtype) * 2 for _ in range(2)]

    def commit(self) -> None:
        for blocks, plan in self.pending:
            self.free.extend(self.layout.commit(blocks, plan))
        self.pending = []
        if self.twin is not None:
            self.twin.commit()

    def compare(self, meta: StepMeta, rep: int, window: int | None = None) -> None:
        """Both paths over every layer with random queries (``window``: as a sliding-window layer of that many
        tokens): equal within the dtype's tolerance. A 4-bit tier's kernel sums in fp32 are held to that too;
        its integer sums add at most a third of the codes' own error (against its exact twin) and leave the error
        within 15% of the torch path's."""
        twin_meta = None if self.twin is None else self.twin_meta
        if window is not None:
            meta, twin_meta = meta.windowed(window), twin_meta and twin_meta.windowed(window)
        for layer in range(2):
            query = torch.randn(meta.batch, self.heads * rep, meta.n, self.width, generator=self.gen).to(self.dtype)
            with kernels.using("torch"):
                reads = read_layer(self.views, layer, meta)
                ref = attend_pair(query, reads[0], reads[1], meta, self.width ** -0.5)
                gold = attend_pair(query.float(), *map(_fp32, reads), meta, self.width ** -0.5)
            with kernels.using("kernel"):
                got = attend_pair(query, *in_place_layer(self.views, layer), meta, self.width ** -0.5)
                if self.twin is not None:
                    with kernels.exact_sums():
                        exact_sums = attend_pair(query, *in_place_layer(self.views, layer), meta, self.width ** -0.5)
            assert got.shape == ref.shape and got.dtype == ref.dtype
            if self.twin is not None:
                with kernels.using("torch"):  # the same queries over the same tokens never quantized
                    truth = attend_pair(query.float(), *map(_fp32, read_layer(self.twin.views, layer, twin_meta)),
                                        twin_meta, self.width ** -0.5)
                codes, ours = _rms(gold - truth), _rms(got.float() - truth)
                assert _rms(got.float() - gold) <= max(codes / 3, TOLERANCE[self.dtype]), (codes, ours)
                assert ours <= max(1.15 * codes, TOLERANCE[self.dtype]), (codes, ours)
                got = exact_sums
            # the kernel computes in fp32 whatever the dtype: within the output's rounding of the torch path run in
            # fp32 on the same stored K/V, and no further from it than the torch path in the model dtype
            tol = TOLERANCE[self.dtype]
            torch.testing.assert_close(got.float(), gold, rtol=tol, atol=tol)
            assert (got.float() - gold).abs().max() <= max((ref.float() - gold).abs().max(), tol)


def _rms(x: torch.Tensor) -> float:
    return float(x.float().pow(2).mean().sqrt())



def _grow(pool: Pool, rows: list[SeqBlocks], lengths: list[int], chunk: int) -> None:
    """Prefill each row to its length in chunks of ``chunk`` tokens (one row a step)."""
    for blocks, length in zip(rows, lengths):
        while blocks.tokens < length:
            pool.write([blocks], [min(chunk, length - blocks.tokens)])


def ragged_decode(pool, steps: int) -> None:
    """Rows of 1, 7, 16 (a page boundary), 45 and 130 tokens, then ``steps`` decode steps of them together, each
    compared (``pool.compare``, one query row a KV head's group) before it is committed."""
    lengths = [1, 7, 16, 45, 130]
    rows = [SeqBlocks() for _ in lengths]
    _grow(pool, rows, lengths, chunk=24)
    for _ in range(steps):
        pool.compare(pool.write(rows, [1] * len(rows), commit=False))
        pool.commit()


def chunk_after_history(pool) -> None:
    """A 37-token chunk after 70 stored tokens, and the first 37-token chunk of an empty row, each compared."""
    rows = [SeqBlocks()]
    _grow(pool, rows, [70], chunk=32)
    pool.compare(pool.write(rows, [37], commit=False))
    pool.compare(pool.write([SeqBlocks()], [37], commit=False))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("heads,rep,width", SHAPES, ids=[f"h{h}x{r}-d{w}" for h, r, w in SHAPES])
def test_decode_of_a_ragged_batch_matches_the_torch_path(tier, heads, rep, width, dtype):
    """Rows of 1, 7, 16 (a page boundary), 45 and 130 tokens, then a decode step of all of them (int8 tiers drain a
    group inside it): each row's output equals the torch path's."""
    pool = Pool(tier, heads, width, dtype, tokens_per_page=16, seed=width + heads + rep)
    lengths = [1, 7, 16, 45, 130]
    rows = [SeqBlocks() for _ in lengths]
    _grow(pool, rows, lengths, chunk=24)
    for _ in range(3):
        pool.compare(pool.write(rows, [1] * len(rows), commit=False), rep)
        pool.commit()


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("tier", list(TIERS))
def test_a_decode_split_over_kv_blocks_matches_the_torch_path(tier, splits, monkeypatch):
    """Each (row, KV head) item's blocks split between work units (as a decode of a few rows is, so that every
    thread has work), then merged: the same output as the torch path, for rows shorter than a split and longer."""
    monkeypatch.setenv("KVSERVE_KERNEL_SPLITS", str(splits))
    pool = Pool(tier, 3, 64, torch.float32, tokens_per_page=16, seed=splits)
    lengths = [3, 200, 700]
    rows = [SeqBlocks() for _ in lengths]
    _grow(pool, rows, lengths, chunk=128)
    for _ in range(2):
        pool.compare(pool.write(rows, [1] * len(rows), commit=False), 3)
        pool.commit()


@pytest.mark.parametrize("dtype", [d for d in KERNEL_DTYPES if d != torch.float16], ids=str)
@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("heads,rep,width", SHAPES[:3], ids=[f"h{h}x{r}-d{w}" for h, r, w in SHAPES[:3]])
def test_a_prefill_chunk_over_stored_history_matches_the_torch_path(tier, heads, rep, width, dtype):
    """A 37-token chunk (causal within it; int8 groups drain inside it) after 70 stored tokens, and the first chunk of
    an empty row: the torch path's output."""
    pool = Pool(tier, heads, width, dtype, tokens_per_page=16, seed=3 * width + rep)
    rows = [SeqBlocks()]
    _grow(pool, rows, [70], chunk=32)
    pool.compare(pool.write(rows, [37], commit=False), rep)
    fresh = [SeqBlocks()]
    pool.compare(pool.write(fresh, [37], commit=False), rep)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [5, 40])
@pytest.mark.parametrize("tier", list(TIERS))
def test_a_sliding_window_matches_the_torch_path(tier, window, splits, monkeypatch):
    """A sliding-window layer's step (:meth:`StepMeta.windowed`: each query's first exact slot, and with codes its
    first code, raised to its window's start): decode rows of 7, 45 and 130 tokens (the window inside the exact
    tier, inside the codes, past them), whole or split over blocks, and a 37-token prefill chunk over 130 stored
    tokens, as the torch path attends them under the window's mask."""
    monkeypatch.setenv("KVSERVE_KERNEL_SPLITS", str(splits))
    pool = Pool(tier, 1, 64, torch.float32, tokens_per_page=16, seed=window + splits)
    lengths = [7, 45, 130]
    rows = [SeqBlocks() for _ in lengths]
    _grow(pool, rows, lengths, chunk=24)
    for _ in range(2):
        pool.compare(pool.write(rows, [1] * len(rows), commit=False), 3, window)
        pool.commit()
    pool.compare(pool.write([rows[2]], [37], commit=False), 3, window)


@pytest.mark.parametrize("tier", sorted(FOUR_BIT))
def test_a_4_bit_decode_is_summed_in_integers_unless_exact_sums_are_asked(tier):
    """A decode scores 4-bit keys in integers (its output differs from the fp32 sums') unless
    KVSERVE_KERNEL_EXACT_SUMS is set; a prefill chunk's many rows widen the codes and sum in fp32 either way."""
    pool = Pool(tier, 1, 64, torch.float32, tokens_per_page=16, seed=7)
    rows = [SeqBlocks()]
    _grow(pool, rows, [200], chunk=64)
    for n, differs in ((1, True), (37, False)):
        meta = pool.write(rows, [n], commit=False)
        query = torch.randn(1, 3, n, 64, generator=pool.gen)
        outs = []
        for exact in (False, True, "0"):  # "0": the variable set to 0 is not asking for fp32 sums
            with kernels.using("kernel"), kernels.exact_sums(exact is True):
                if exact == "0":
                    os.environ["KVSERVE_KERNEL_EXACT_SUMS"] = "0"
                outs.append(attend_pair(query, *in_place_layer(pool.views, 0), meta, 0.125))
        # a prefill chunk's last tile may hold few rows and take the decode's sums: compare the chunk's first token
        assert bool((outs[0][..., :1, :] != outs[1][..., :1, :]).any()) == differs, (tier, n)
        assert torch.equal(outs[0], outs[2])
        pool.commit()


def test_status_says_how_4_bit_keys_are_scored(monkeypatch):
    """``/info``'s ``kv_attention`` and the start-up log name the sums: int8 on AVX2, fp32 when asked (any value
    of the variable but empty or ``0``)."""
    isa = torch.ops.kvserve.kernel_isa()
    assert kernels.status()["int4_key_scores"] == ("int8" if isa == "avx2" else "fp32")
    with kernels.exact_sums():
        assert kernels.status()["int4_key_scores"] == "fp32"
    monkeypatch.setenv("KVSERVE_KERNEL_EXACT_SUMS", "0")
    assert kernels.status()["int4_key_scores"] == ("int8" if isa == "avx2" else "fp32")


@pytest.mark.parametrize("tokens_per_page", [8, 13, 64])
def test_page_sizes_and_shuffled_tables(tokens_per_page):
    """Pages of 8, 13 (rows never end on a boundary with the same phase) and 64 tokens, a shuffled free list: the
    torch path's output for a ragged decode and a chunk."""
    pool = Pool("int8", 2, 64, torch.float32, tokens_per_page=tokens_per_page, seed=tokens_per_page)
    rows = [SeqBlocks() for _ in range(3)]
    _grow(pool, rows, [9, 40, 77], chunk=16)
    pages = [p for b in rows for p in b.q + b.exact]
    assert pages != sorted(pages)  # the tables are not in page order
    pool.compare(pool.write(rows, [1, 1, 1], commit=False), rep=2)
    pool.compare(pool.write([SeqBlocks()], [29], commit=False), rep=2)


def test_the_portable_kernel_gives_what_the_avx2_one_gives(monkeypatch):
    """The portable C++ path (what runs without AVX2) against the torch path, in a child process (the instruction
    set is chosen once per process)."""
    import subprocess
    import sys

    code = ("import torch, tests.test_kernels as t; from cache_backends import kernels; "
            "assert torch.ops.kvserve.kernel_isa() == 'portable' if kernels.load() else False; "
            "t.test_decode_of_a_ragged_batch_matches_the_torch_path('int4-rotated', 1, 3, 128, torch.float16); "
            "t.test_a_prefill_chunk_over_stored_history_matches_the_torch_path('int8', 2, 1, 64, torch.float32)")
    env = {**__import__("os").environ, "KVSERVE_KERNEL_PORTABLE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_reads_are_in_place_only_where_the_kernel_is_active():
    """``KV_ATTENTION=torch`` gathers; the kernel path hands attention the pool's views, no copy of a page."""
    pool = Pool("exact", 1, 64, torch.float32, tokens_per_page=16, seed=0)
    with kernels.using("torch"):
        assert in_place_layer(pool.views, 0) is None
    with kernels.using("kernel"):
        reads = in_place_layer(pool.views, 0)
        assert all(isinstance(r, InPlaceRead) and r.views.arena is pool.pool.arena for r in reads)


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="KV_ATTENTION"):
        kernels.configure("fast")


@pytest.mark.parametrize("dtype", [d for d in KERNEL_DTYPES if d != torch.float16], ids=str)
@pytest.mark.parametrize("tier", ["exact", "int8", "int4-rotated", "native-mla", "native-mla-int8"])
def test_the_fused_write_stores_what_the_torch_write_stores(tier, dtype):
    """The same steps (prefill chunks and decode steps of a ragged batch; int8 groups drain) written by
    ``kvserve::paged_write`` and by the torch path's indexed copies leave the same bytes in the pool (and a
    native-MLA model's latent and rope key)."""
    arenas = []
    for mode in ("kernel", "torch"):
        with kernels.using(mode):
            pool = LatentPool(32, 8, 2, 16, 16, dtype, tokens_per_page=16, seed=11, tier=tier[11:] or "exact") \
                if tier.startswith("native-mla") else Pool(tier, 2, 64, dtype, tokens_per_page=16, seed=11)
            rows = [SeqBlocks() for _ in range(3)]
            _grow(pool, rows, [5, 33, 70], chunk=20)
            for _ in range(4):
                pool.write(rows, [1, 1, 1])
            arenas.append(pool.pool.arena.clone())
    assert torch.equal(arenas[0], arenas[1])


class CountOps(TorchDispatchMode):
    """The ops a block dispatches (views left out), by name, in order: what "ops per layer" counts."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_decode_steps_kv_path_is_two_ops_per_layer():
    """With the kernel, a decode step writes a layer's K and V in one op and attends in one: two ops per layer
    (the torch path: indexed copies per stream, a gather and the attention's ops)."""
    pool = Pool("int8", 3, 64, torch.float32, tokens_per_page=16, seed=5)
    rows = [SeqBlocks() for _ in range(4)]
    _grow(pool, rows, [50, 60, 70, 80], chunk=64)
    counts = {}
    for mode in ("kernel", "torch"):
        with kernels.using(mode):
            meta = pool.write(rows, [1] * 4, commit=False)  # builds the step's metadata (once per step, not per layer)
            query = torch.randn(4, 9, 1, 64)
            new = [torch.randn(4, 3, 1, 64) for _ in range(2)]
            with CountOps() as counter:
                write_layer(pool.views, 0, meta, new)
                reads = in_place_layer(pool.views, 0) or read_layer(pool.views, 0, meta)
                attend_pair(query, reads[0], reads[1], meta, 0.125)
            pool.commit()
            counts[mode] = counter.ops
    assert counts["kernel"] == ["paged_write", "paged_attention"], counts["kernel"]
    assert len(counts["torch"]) > 10


def test_a_kernel_that_cannot_load_is_said_and_the_torch_path_serves(tmp_path):
    """Where no build can be made (here: the build folder is a file), ``auto`` reports the torch path and why, and
    ``kernel`` is refused naming the setting (in a child process: loading is once per process)."""
    import os
    import subprocess
    import sys

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    code = ("import json; from cache_backends import kernels; print(json.dumps(kernels.status('cpu')));"
            "kernels.configure('kernel')")
    env = {**os.environ, "KVSERVE_KERNELS_DIR": str(blocker), "KV_ATTENTION": "auto"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    status = __import__("json").loads(done.stdout.splitlines()[0])
    assert status["path"] == "torch" and "Not a directory" in status["reason"], status
    assert done.returncode != 0 and "ValueError: KV_ATTENTION=kernel" in done.stderr, done.stderr[-2000:]


# ------------------------------------------------------------------------------------------------ native MLA
# (kv_lora_rank r, qk_rope_head_dim, query heads, qk_nope_head_dim, v_head_dim): the tiny DeepseekV3 of
# tests/test_mla_native.py, a wider rope key, and DeepSeek-V2-Lite's widths (r 512, rope 64, 16 heads of 128)
LATENT_SHAPES = [(16, 8, 4, 16, 16), (32, 64, 3, 32, 32), (512, 64, 16, 128, 128)]
LATENT_IDS = [f"r{r}-rope{p}-h{h}" for r, p, h, _, _ in LATENT_SHAPES]
# a latent's stored forms: exact pages (``full``, ``mla``), and ``mla+int8`` / ``mla+int4`` (rotated or not): the
# latent and the rope key both per channel over groups of 8 tokens, the newest 8 exact
LATENT_TIERS = ["exact", "int8", "int4", "int4-rotated"]


class LatentPool(Pool):
    """A pool of a native-MLA model's entries over two layers (``full``'s and ``mla``'s: the latent c_KV and the
    shared rope key, one head each; exact pages, or under ``tier`` (:data:`TIERS`) both quantized per channel, as
    ``mla+int8`` / ``mla+int4`` store them), with a random ``kv_b_proj`` of the model's widths."""

    def __init__(self, rank: int, rope: int, heads: int, nope: int, v: int, dtype: torch.dtype, tokens_per_page: int,
                 seed: int, tier: str = "exact"):
        from types import SimpleNamespace

        from cache_backends.kv_spec import StreamSpec

        spec = KVSpec((StreamSpec(1, rank), StreamSpec(1, rope)), 2, dtype.itemsize, TIERS[tier])
        page = -(-spec.exact_bytes(tokens_per_page, aligned=True) // 64) * 64
        self.layout = PageLayout(spec, dtype, page)
        assert kernels.fits(self.layout) and kernels.is_latent(self.layout)
        self.pool = KVPool(400, self.layout.page_bytes, {"b": self.layout}, "cpu")
        self.pool.arena.zero_()
        self.views = self.pool.views["b"]
        self.gen = torch.Generator().manual_seed(seed)
        self.free = list(range(1, 400))
        random.Random(seed).shuffle(self.free)
        self.dtype, self.rank, self.rope, self.q_heads = dtype, rank, rope, heads
        self.twin = None
        def module(nope: int, v: int, weight: torch.Tensor, dtype: torch.dtype):
            return SimpleNamespace(qk_nope_head_dim=nope, v_head_dim=v, kv_b_proj=SimpleNamespace(weight=weight.to(dtype)))

        proj = torch.randn(heads * (nope + v), rank, generator=self.gen) * rank ** -0.5
        self.modules = [module(nope, v, proj, dtype), module(nope, v, proj, torch.float32)]
        # W_UK = W_UV = I (nope = v = r): absorbed attention is then the latent MQA alone, exactly in any dtype, so
        # the kernel's sums are compared with nothing else's rounding in between
        eye = torch.eye(rank).repeat(2 * heads, 1)
        self.identity = {d: module(rank, rank, eye, d) for d in (dtype, torch.float32)}

    def new_tokens(self, batch: int, n: int) -> list[torch.Tensor]:
        """One layer's random new latent and rope key, (batch, 1, n, width) each."""
        return [torch.randn(batch, 1, n, w, generator=self.gen).to(self.dtype) for w in (self.rank, self.rope)]

    def compare(self, meta: StepMeta, rep: int = 0) -> None:
        """Absorbed attention through the kernel (the pages read in place) and through the torch path (gathered),
        over every layer with random queries: equal within the dtype's tolerance."""
        for layer in range(2):
            with kernels.using("torch"):
                reads = read_layer(self.views, layer, meta)
            with kernels.using("kernel"):
                in_place = in_place_layer(self.views, layer)
            assert all(isinstance(r, InPlaceRead) for r in in_place)
            tol = TOLERANCE[self.dtype]
            # the latent MQA alone (W_UK = W_UV = I): within the output's rounding of the torch path run in fp32 on
            # the same stored latent, and no further from it than the torch path in the model dtype
            got, ref = self._both(self.identity[self.dtype], meta, reads, in_place)
            gold = self._absorbed(self.identity[torch.float32], self._query.float(), list(map(_fp32, reads)), meta)
            torch.testing.assert_close(got.float(), gold, rtol=tol, atol=tol)
            assert (got.float() - gold).abs().max() <= max((ref.float() - gold).abs().max(), tol)
            # with the model's W_UK and W_UV (applied in the model dtype by both paths): the torch path's output; on
            # codes, the torch path's sums round in the model dtype (a bf16 query times the scales, plus the zero
            # points' bias: a difference of two rounded terms), the kernel's in fp32: no further than it from the
            # sums in fp32
            got, ref = self._both(self.modules[0], meta, reads, in_place)
            if self.layout.quantization is None:
                torch.testing.assert_close(got.float(), ref.float(), rtol=2 * tol, atol=2 * tol)
            else:
                gold = self._absorbed(self.modules[1], self._query.float(), list(map(_fp32, reads)), meta)
                assert (got.float() - gold).abs().max() <= max((ref.float() - gold).abs().max(), 2 * tol)

    def _both(self, a, meta: StepMeta, reads: list, in_place: list) -> tuple:
        """Absorbed attention of one random query through the kernel and through the torch path."""
        self._query = torch.randn(meta.batch, self.q_heads, meta.n, a.qk_nope_head_dim + self.rope,
                                  generator=self.gen).to(self.dtype)
        got = self._absorbed(a, self._query, in_place, meta)
        ref = self._absorbed(a, self._query, reads, meta)
        assert got.shape == ref.shape == (meta.batch, self.q_heads, meta.n, a.v_head_dim)
        assert got.dtype == ref.dtype == self.dtype
        return got, ref

    def _absorbed(self, a, query: torch.Tensor, reads: list, meta: StepMeta) -> torch.Tensor:
        from cache_backends.absorbed_mla import absorbed_attention

        return absorbed_attention(query, reads[0], reads[1], meta, (a.qk_nope_head_dim + self.rope) ** -0.5, a)


@pytest.mark.parametrize("tier", LATENT_TIERS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("rank,rope,heads,nope,v", LATENT_SHAPES, ids=LATENT_IDS)
def test_native_mla_decode_of_a_ragged_batch_matches_absorbed_attention(rank, rope, heads, nope, v, dtype, tier):
    """A native-MLA model's latent and rope key read in place (MQA over (c_t, k_rope_t), values c_t, W_UK and W_UV
    applied in torch), exact or quantized (scores and values on the codes' groups, then the exact window): rows of
    1, 7, 16 (a page boundary), 45 and 130 tokens decoding together (quantized tiers drain a group inside the steps)
    give absorbed attention's output over the gathered pages."""
    pool = LatentPool(rank, rope, heads, nope, v, dtype, tokens_per_page=16, seed=rank + rope, tier=tier)
    ragged_decode(pool, 3 if tier != "exact" else 2)


@pytest.mark.parametrize("tier", LATENT_TIERS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("rank,rope,heads,nope,v", LATENT_SHAPES, ids=LATENT_IDS)
def test_native_mla_prefill_chunk_over_stored_pages_matches_absorbed_attention(rank, rope, heads, nope, v, dtype,
                                                                               tier):
    """A 37-token chunk (causal within it; quantized tiers drain groups inside it) after 70 stored tokens (most of
    them codes when quantized), and the first chunk of an empty row."""
    pool = LatentPool(rank, rope, heads, nope, v, dtype, tokens_per_page=16, seed=3 * rank + rope, tier=tier)
    chunk_after_history(pool)


@pytest.mark.parametrize("tier", LATENT_TIERS)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("tokens_per_page", [8, 13])
def test_native_mla_pages_splits_and_shuffled_tables(tokens_per_page, splits, tier, monkeypatch):
    """Pages of 8 and 13 tokens (rows ending on and off a boundary), a shuffled free list, each row's blocks whole
    or split over work units (a split's share of a quantized row may start or end inside a group): absorbed
    attention's output for a ragged decode and a prefill chunk."""
    monkeypatch.setenv("KVSERVE_KERNEL_SPLITS", str(splits))
    pool = LatentPool(32, 64, 3, 32, 32, torch.float32, tokens_per_page=tokens_per_page, seed=tokens_per_page,
                      tier=tier)
    rows = [SeqBlocks() for _ in range(3)]
    _grow(pool, rows, [9, 40, 300], chunk=64)
    pages = [p for b in rows for p in b.q + b.exact]
    assert pages != sorted(pages)
    pool.compare(pool.write(rows, [1, 1, 1], commit=False))
    pool.compare(pool.write([rows[1]], [29], commit=False))


def test_native_mla_portable_kernel_matches_absorbed_attention():
    """The portable C++ path on a native-MLA latent, exact and quantized, in a child process (the instruction set is
    chosen once)."""
    import subprocess
    import sys

    code = ("import torch, tests.test_kernels as t; from cache_backends import kernels; "
            "assert torch.ops.kvserve.kernel_isa() == 'portable' if kernels.load() else False; "
            "t.test_native_mla_decode_of_a_ragged_batch_matches_absorbed_attention(32, 64, 3, 32, 32, torch.bfloat16, "
            "'exact'); "
            "t.test_native_mla_prefill_chunk_over_stored_pages_matches_absorbed_attention(16, 8, 4, 16, 16, "
            "torch.float32, 'exact'); "
            "t.test_native_mla_decode_of_a_ragged_batch_matches_absorbed_attention(32, 64, 3, 32, 32, torch.bfloat16, "
            "'int8'); "
            "t.test_native_mla_decode_of_a_ragged_batch_matches_absorbed_attention(16, 8, 4, 16, 16, torch.float32, "
            "'int4-rotated'); "
            "t.test_native_mla_prefill_chunk_over_stored_pages_matches_absorbed_attention(32, 64, 3, 32, 32, "
            "torch.float32, 'int4')")
    env = {**os.environ, "KVSERVE_KERNEL_PORTABLE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("tier", ["int8", "int4"])
def test_a_quantized_native_mla_latent_is_read_in_place_and_split(tier, splits, monkeypatch):
    """``mla+int8`` / ``mla+int4`` on a native-MLA model at DeepSeek-V2-Lite's widths: the kernel reads the codes
    (:func:`kernels.fits`, in-place reads), a long row's blocks split over units (shares starting inside a group)
    and merged, beside short rows, give the torch path's output."""
    monkeypatch.setenv("KVSERVE_KERNEL_SPLITS", str(splits))
    pool = LatentPool(512, 64, 16, 128, 128, torch.float32, tokens_per_page=16, seed=splits, tier=tier)
    assert pool.layout.q_tokens and kernels.fits(pool.layout)
    rows = [SeqBlocks() for _ in range(3)]
    _grow(pool, rows, [3, 45, 333], chunk=128)
    for _ in range(2):
        pool.compare(pool.write(rows, [1, 1, 1], commit=False))
        pool.commit()
