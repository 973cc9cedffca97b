"""The ``window`` backend (StreamingLLM, arXiv 2309.17453): attention sinks plus a recent window on every layer.

A tiny randomly initialised Llama (2 layers, 4 query heads sharing 2 K/V heads, head_dim 16, fp32), window 8 and
2 sinks, pages of 4 tokens: prompts and prefill chunks longer than the window, the window starting inside a page.
The reference is transformers' eager attention under a 4-D additive mask of the same rule (``[0, S) ∪ [t - W + 1,
t]``): through the pool, on the torch path and on the attention kernel, every step's logits are the reference's;
the pool holds ``S + W - 1`` tokens a layer (the sinks' page kept, every page the window left freed); ``window+int8``
gives what its per-sequence stores give; on a tiny Gemma 3 a sliding layer keeps its own window; bad options and
compositions are refused naming why. SmolLM2-135M (``real_model``): the engine's greedy tokens are the reference's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cache_backends import kernels
from cache_backends.geometry import ModelGeometry
from cache_backends.registry import create
from cache_backends.store_path import StorePath
from tests.engine_helpers import PagedDriver, with_eager_twin

WINDOW, SINKS, LENGTH = 8, 2, 40
HEADS_KV, HEAD_DIM, LAYERS = 2, 16, 2
TOKEN_BYTES = 2 * HEADS_KV * HEAD_DIM * 4  # K and V, fp32, one layer


def _attention_modes():
    return ["torch", "kernel"] if kernels.load() else ["torch"]


def streaming_mask(length: int, window: int, sinks: int, start: int = 0) -> torch.Tensor:
    """(length - start, length) bool: query ``t`` sees ``[0, sinks) ∪ [t - window + 1, t]``."""
    i = torch.arange(length)
    rows = i[start:, None]
    return (i[None] <= rows) & ((i[None] > rows - window) | (i[None] < sinks))


def masked_logits(eager, ids: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """Eager attention's logits (B, T, vocab) under :func:`streaming_mask` as an additive 4-D mask."""
    mask = streaming_mask(ids.shape[1], window, sinks)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    with torch.no_grad():
        return eager(ids, attention_mask=additive[None, None].expand(ids.shape[0], 1, -1, -1)).logits


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=HEADS_KV, head_dim=HEAD_DIM,
                         max_position_embeddings=256)
    torch.manual_seed(0)
    return with_eager_twin(LlamaForCausalLM(config).eval())


@pytest.fixture(scope="module")
def sequences(tiny):
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, LENGTH))
    return ids.tolist(), masked_logits(tiny[1], ids, WINDOW, SINKS)


def _geometry(model) -> ModelGeometry:
    return ModelGeometry.from_config(model.config, torch.float32)


def _drive(driver: PagedDriver, ids: list[list[int]]) -> list[tuple[int, int, torch.Tensor]]:
    """Row 0: a 5-token chunk, then an 18-token chunk (longer than the window) beside row 1's whole 11-token prompt
    (a ragged step), then decodes of both to LENGTH: ``(row, position, logits)`` of each row's last token."""
    a, b = driver.new_blocks(), driver.new_blocks()
    seen = [(0, 4, driver.step([a], [ids[0][:5]])[0])]
    out = driver.step([a, b], [ids[0][5:23], ids[1][:11]])
    seen += [(0, 22, out[0]), (1, 10, out[1])]
    for pa in range(23, LENGTH):
        pb = pa - 12
        out = driver.step([a, b], [[ids[0][pa]], [ids[1][pb]]])
        seen += [(0, pa, out[0]), (1, pb, out[1])]
    driver.rows = (a, b)
    return seen


@pytest.mark.parametrize("mode", _attention_modes())
def test_the_pool_gives_eager_attention_under_the_sinks_and_window_mask(tiny, sequences, mode):
    """Prefill chunks longer than the window, a ragged step, decodes: on the kernel and on the torch path, the
    reference's logits at every step (and not those of full attention, which the window changes)."""
    model, eager = tiny
    ids, reference = sequences
    backend = create("window", _geometry(model), sinks=SINKS, window=WINDOW)
    with kernels.using(mode):
        driver = PagedDriver(model, backend, pages=64, block_size=4)
        seen = _drive(driver, ids)
    with torch.no_grad():
        dense = eager(torch.tensor(ids)).logits
    for row, pos, logits in seen:
        torch.testing.assert_close(logits, reference[row, pos], rtol=0, atol=2e-5, msg=f"row {row} at {pos}")
    assert (seen[-2][2] - dense[0, LENGTH - 1]).abs().max() > 1e-2  # the window is not full attention here


def test_the_kernel_and_the_torch_path_agree_on_a_prefill_chunk_longer_than_the_window(tiny):
    """One forward of a 30-token chunk after 20 tokens (the sink page already kept), both paths, every position."""
    if not kernels.load():
        pytest.skip("the attention kernel does not build here")
    model, eager = tiny
    torch.manual_seed(2)
    ids = torch.randint(3, 128, (1, 50))
    reference = masked_logits(eager, ids, WINDOW, SINKS)[0]
    out = {}
    for mode in ("torch", "kernel"):
        backend = create("window", _geometry(model), sinks=SINKS, window=WINDOW)
        with kernels.using(mode):
            driver = PagedDriver(model, backend, pages=64, block_size=4)
            blocks = driver.new_blocks()
            driver.step([blocks], [ids[0, :20].tolist()])
            assert blocks.groups[0].sink  # the sinks' page left the window and was kept
            plan = driver.layout.plan(blocks, 30)
            pages = driver.manager.allocate(plan.pages_needed)
            driver.layout.extend(blocks, plan, pages[: plan.new_exact_pages], pages[plan.new_exact_pages:])
            out[mode] = driver.runner.run_paged([ids[0, 20:].tolist()], [(backend, [0], [(blocks, plan)])], pages,
                                                all_logits=True)[0]
    torch.testing.assert_close(out["kernel"], out["torch"], rtol=0, atol=2e-5)
    torch.testing.assert_close(out["torch"], reference[20:], rtol=0, atol=2e-5)


def _ranges_as_mask(meta) -> torch.Tensor:
    """A 6-column :attr:`StepMeta.ranges` as the mask it stands for: codes ``[q0, q)``, exact ``[lo, hi)`` and the
    sinks' ``[s0, s1)`` of the sink tier (codes when the layout has them, else exact slots)."""
    tq, te = meta.q_width, meta.positions.shape[1] - meta.q_width
    r = meta.ranges.long()
    iq, ie = torch.arange(tq), torch.arange(te)
    codes = (iq[None, None] < r[..., 0:1]) & (iq[None, None] >= r[..., 3:4])
    exact = (ie[None, None] >= r[..., 1:2]) & (ie[None, None] < r[..., 2:3])
    sink_slots = iq if tq else ie
    sinks = (sink_slots[None, None] >= r[..., 4:5]) & (sink_slots[None, None] < r[..., 5:6])
    assert not (sinks & (codes if tq else exact)).any()  # disjoint: no token is counted twice
    if tq:
        codes = codes | sinks
    else:
        exact = exact | sinks
    return torch.cat([codes, exact], dim=-1)


@pytest.mark.parametrize("name,options", [("window", {}), ("window+int8", {"group_size": 2, "residual": 2})])
def test_every_steps_ranges_are_its_mask_and_the_mask_is_the_rule(tiny, sequences, monkeypatch, name, options):
    """Each step's metadata: the ranges the kernel reads are the mask the torch path applies, and every position the
    mask lets a query see is in ``[0, S) ∪ [t - W + 1, t]``, every position of that set held by the row is seen."""
    from cache_backends.step_meta import StepMeta

    model, _ = tiny
    built = []
    original = StepMeta._add_sinks

    def checked(self, layout, rows, sinks, window, device):
        original(self, layout, rows, sinks, window, device)
        assert self.ranges.shape[-1] == 6
        assert torch.equal(_ranges_as_mask(self), self.mask)
        pos, qp = self.positions[:, None, :], self.query_positions[:, :, None]
        rule = (pos <= qp) & ((pos > qp - window) | (pos < sinks))
        assert not (self.mask & ~rule).any()
        for b in range(self.batch):  # every position the rule wants is seen once
            for j in range(self.n):
                seen = sorted(self.positions[b][self.mask[b, j]].tolist())
                want = [p for p in range(int(qp[b, j, 0]) + 1) if p < sinks or p > qp[b, j, 0] - window]
                assert seen == want
        built.append(bool(self.q_width) if layout.quantization else True)

    monkeypatch.setattr(StepMeta, "_add_sinks", checked)
    backend = create(name, _geometry(model), sinks=SINKS, window=WINDOW, **options)
    with kernels.using("torch"):
        _drive(PagedDriver(model, backend, pages=64, block_size=4), sequences[0])
    assert built and all(built)


def test_the_pool_holds_the_sinks_and_the_window_and_frees_the_rest(tiny, sequences):
    """After :func:`_drive` (rows of 40 and 28 tokens): each row holds in each layer its 2 sinks (their page kept)
    and its newest 7 tokens, the bytes the backend's sums and ``kvserve estimate`` say; every other page is back in
    the pool."""
    from cache_backends.estimate import Shape, bytes_per_token_per_layer

    model, _ = tiny
    backend = create("window", _geometry(model), sinks=SINKS, window=WINDOW)
    driver = PagedDriver(model, backend, pages=64, block_size=4)
    with kernels.using("torch"):
        _drive(driver, sequences[0])
    layout = driver.layout
    assert layout.windows == [WINDOW] and layout.sinks == [SINKS] and layout.layers == [[0, 1]]
    held = 0
    for blocks, length in zip(driver.rows, (LENGTH, LENGTH - 12)):
        (group,) = blocks.groups
        assert (group.first, group.exact_len, len(group.sink)) == (length - (WINDOW - 1), WINDOW - 1, 1)
        assert layout.stored_bytes(blocks) == TOKEN_BYTES * LAYERS * (SINKS + WINDOW - 1)
        assert backend.bytes_per_token_per_layer(length) * length * LAYERS == layout.stored_bytes(blocks)
        held += len(blocks.pages())
        assert len(blocks.pages()) <= 1 + -(-(4 - 1 + WINDOW) // 4)  # the sink page and the window's
    assert driver.manager.num_free == 64 - 1 - held
    shape = Shape(LAYERS, HEADS_KV, HEAD_DIM, HEAD_DIM)
    assert bytes_per_token_per_layer(shape, "window", {"sinks": SINKS, "window": WINDOW}, 4, LENGTH) * LENGTH \
        == TOKEN_BYTES * (SINKS + WINDOW - 1)
    assert backend.sums_spec() == ("window", {"sinks": SINKS, "window": WINDOW})
    full = create("full", _geometry(model))
    assert backend.bytes_per_token_per_layer(8192) < full.bytes_per_token_per_layer(8192) / 100


def test_decoding_gives_back_pages_as_the_window_moves(tiny):
    """Decoding one row to 200 tokens: the pages it holds stop growing once the window is full, the sinks' page is
    the one it held first, and the admission bound covers every step."""
    model, _ = tiny
    backend = create("window", _geometry(model), sinks=SINKS, window=WINDOW)
    driver = PagedDriver(model, backend, pages=32, block_size=4)
    layout = driver.layout
    blocks = driver.new_blocks()
    torch.manual_seed(3)
    ids = torch.randint(3, 128, (200,)).tolist()
    with kernels.using("torch"):
        driver.step([blocks], [ids[:3]])
        first_page = blocks.groups[0].exact[0]
        counts = []
        for t in ids[3:]:
            driver.step([blocks], [[t]])
            counts.append(len(blocks.pages()))
    assert blocks.groups[0].sink == [first_page]
    assert max(counts[50:]) == max(counts[:50]) <= layout.pages_to_generate(3, 200)
    assert driver.manager.num_free == 32 - 1 - counts[-1]  # 200 tokens in a pool of 31 pages of 4


def _walked_pages(layout, prompt: int, total: int, chunk: int | None) -> int:
    """The most pages a sequence holds, step by step: its prompt in steps of ``chunk``, then one token a step."""
    from cache_backends.page_plan import NULL_PAGE

    blocks, most, steps = layout.cached_prefix([]), 0, []
    while sum(steps) < prompt:
        steps.append(min(chunk or prompt, prompt - sum(steps)))
    for n in steps + [1] * (total - prompt):
        plan = layout.plan(blocks, n)
        layout.extend(blocks, plan, [NULL_PAGE] * plan.new_exact_pages, [NULL_PAGE] * plan.new_q_pages)
        most = max(most, len(blocks.pages()))
        layout.commit(blocks, plan)
    return most


SMOLLM2 = ModelGeometry(num_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, dtype_bytes=4)


@pytest.mark.parametrize("name", ["window", "window+int8", "window+int4"])
@pytest.mark.parametrize("sinks, window", [(0, 64), (4, 64), (16, 100), (4, 300)])
def test_admission_reserves_what_a_request_holds_and_not_a_sink_page_more(name, sinks, window):
    """The pages admission reserves (:meth:`HybridLayout.pages_to_generate`) cover every step of a request and, for a
    short one, are what it holds: the sinks' page was counted apart from the window's pages even while the window
    still held it, a page more than a short request ever holds (2 pages reserved for 1 of 30 tokens in a pool of
    48-token pages)."""
    from server.engine.kv_cache import page_layouts

    served = {name: create(name, SMOLLM2, sinks=sinks, window=window),
              **{n: create(n, SMOLLM2) for n in ("full", "int8")}}  # KV_BACKENDS' default: pages of 48 exact tokens
    layout = page_layouts(served, torch.float32, 16)[1][name]
    for prompt, total in [(10, 30), (40, 80), (5, 400), (300, 600), (700, 1000)]:
        for chunk in (None, 32, 256):
            assert layout.pages_to_generate(prompt, total, chunk) >= _walked_pages(layout, prompt, total, chunk)
    assert layout.pages_to_generate(10, 30, 256) == _walked_pages(layout, 10, 30, 256) == 1


GEMMA_LIKE = ModelGeometry(num_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=64, dtype_bytes=4,
                           layer_windows=(64, 64, None, 64, 64, None), rope_per_layer_type=True)


def _cut_pages(layout, steps: list[int]) -> int:
    """The most pages a sequence holds writing its prompt in ``steps`` (tokens a step)."""
    blocks, most = layout.cached_prefix([]), 0
    for n in steps:
        plan = layout.plan(blocks, n)
        layout.extend(blocks, plan, [0] * plan.new_exact_pages, [0] * plan.new_q_pages)
        most = max(most, len(blocks.pages()))
        layout.commit(blocks, plan)
    return most


def _random_cut(prompt: int, chunk: int, rng) -> list[int]:
    """A prompt's steps of at most ``chunk`` tokens, each cut at random (as a step budget shared with decoding
    sequences and other prefills cuts them)."""
    steps = []
    while sum(steps) < prompt:
        steps.append(min(prompt - sum(steps), rng.choice([chunk, chunk, rng.randint(1, chunk)])))
    return steps


@pytest.mark.parametrize("name, geometry, options", [
    ("window", SMOLLM2, {"sinks": 4, "window": 64}), ("window+int8", SMOLLM2, {"sinks": 4, "window": 64}),
    ("window+int4", SMOLLM2, {"sinks": 4, "window": 64}), ("window+int8", SMOLLM2, {"sinks": 16, "window": 100}),
    ("full", GEMMA_LIKE, {}), ("int8", GEMMA_LIKE, {}), ("int4", GEMMA_LIKE, {}),
    ("window", GEMMA_LIKE, {"sinks": 4, "window": 128})], ids=lambda v: getattr(v, "num_layers", v))
def test_the_pages_to_generate_bound_every_cut_of_a_hybrid_prompt_into_steps(name, geometry, options):
    """The scheduler cuts a prompt's steps anywhere (:meth:`KVCacheManager.step_tokens`, a budget shared with the
    decoding sequences), and on a layout of window groups a step that starts where the window's pages are least
    aligned holds more than the walk of whole chunks from position 0: a 300-token ``window+int8`` prompt (sinks 4,
    window 64) in steps of 95, 95 (a 100-token chunk beside 5 decoding tokens), then 100 (the decoding sequences
    done) held 7 pages where the bound, walking steps of 100, said 6. The bound is the most over every start ``p`` of a step of ``min(chunk, prompt - p)``
    tokens, the groups' pages added in the same step (no looser: some cut reaches it), and no random cut holds
    more; on a Gemma-3-like model (sliding layers of window 64 beside global ones) too."""
    import random

    from server.engine.kv_cache import page_layouts

    served = {name: create(name, geometry, **options), **{n: create(n, geometry) for n in ("full", "int8")}}
    layout = page_layouts(served, torch.float32, 16)[1][name]
    rng = random.Random(0)
    for prompt in (1, 33, 75, 141, 300, 457):
        for chunk in (1, 24, 64, 95, 100, 256):
            bound = layout.pages_to_generate(prompt, prompt, chunk)
            most = max(layout.prefill_pages(layout.written(layout.cached_prefix([]), p), min(chunk, prompt - p))
                       for p in range(prompt))
            assert bound == most, (prompt, chunk)
            for _ in range(3):
                assert _cut_pages(layout, _random_cut(prompt, chunk, rng)) <= bound, (prompt, chunk)
            for total in (prompt + 1, prompt + 200):
                assert layout.pages_to_generate(prompt, total, chunk) >= bound
    if (name, geometry, options) == ("window+int8", SMOLLM2, {"sinks": 4, "window": 64}):
        assert (_walked_pages(layout, 300, 300, 100), _cut_pages(layout, [95, 95, 100, 10])) == (6, 7)
        assert layout.pages_to_generate(300, 300, 100) == 7


@pytest.mark.parametrize("name", ["full", "int8", "int4"])
def test_a_hybrid_bound_over_too_many_starts_adds_the_groups_own_peaks(monkeypatch, name):
    """Where the groups' periods make more starts than :data:`cache_backends.hybrid_peak.MOST_STARTS` (page sizes of a
    large ``lcm``), :meth:`HybridLayout.prefill_peak` adds each group's own peak: still at least what every start's
    step holds, and a page above the joint peak at most."""
    from cache_backends import hybrid_peak
    from server.engine.kv_cache import page_layouts

    def layout():
        served = {name: create(name, GEMMA_LIKE), **{n: create(n, GEMMA_LIKE) for n in ("full", "int8")}}
        return page_layouts(served, torch.float32, 16)[1][name]

    joint, apart = layout(), layout()
    monkeypatch.setattr(hybrid_peak, "MOST_STARTS", 0)
    for prompt in (75, 300, 457):
        for chunk in (24, 95, 256):
            most = max(apart.prefill_pages(apart.written(apart.cached_prefix([]), p), min(chunk, prompt - p))
                       for p in range(prompt))
            assert most <= apart.prefill_peak(prompt, chunk) <= most + 1, (prompt, chunk)
            monkeypatch.setattr(hybrid_peak, "MOST_STARTS", 4096)
            assert joint.prefill_peak(prompt, chunk) == most, (prompt, chunk)
            monkeypatch.setattr(hybrid_peak, "MOST_STARTS", 0)


def test_window_int8_holds_its_two_tiers_pages_beside_the_window():
    """Why ``window+int8`` can need more pages than ``window`` for one request on a small pool (inherent, not an
    over-reservation): it keeps its residual window and forming group exact (up to residual + group_size - 1 = 63
    tokens) and the older tokens the window sees as codes in pages of their own, freed only once every token in
    them left the window, and a prefill step writes its chunk exact before it drains it. In one pool (48 exact tokens
    or 160 codes a page), ``window:window=64`` holds 80 tokens in 2 pages (positions 17-79 and the sinks), and
    ``window+int8`` in 3: tokens 0-31 as codes in one page, 32-79 exact in two; a 256-token step holds up to 7 exact
    pages under both (one from position 33 to 44, the prompt's first step cut short, holds every token up to 289 or
    more before the window drops any), and under ``window+int8`` its 2 pages of codes too. With a window of 1024 at 600 tokens it is the
    other way round: the codes' smaller size outweighs the tiers' pages (docs/backends.md, ``window``)."""
    from server.engine.kv_cache import page_layouts

    def pages(window, prompt, total, chunk=256):
        served = {n: create(n, SMOLLM2, window=window) for n in ("window", "window+int8")}
        layouts = page_layouts({**served, **{n: create(n, SMOLLM2) for n in ("full", "int8")}}, torch.float32,
                               16)[1]
        assert (layouts["window+int8"].groups[0].exact_tokens, layouts["window+int8"].groups[0].q_tokens) == (48, 160)
        return [layouts[n].pages_to_generate(prompt, total, chunk) for n in ("window", "window+int8")]

    assert pages(64, 10, 63) == [2, 2]  # nothing quantized yet: the same exact pages
    assert pages(64, 40, 80) == [2, 3]
    assert pages(64, 300, 600) == [7, 9]
    assert pages(1024, 300, 600) == [13, 9]


@pytest.mark.parametrize("mode", _attention_modes())
@pytest.mark.parametrize("name", ["window+int8", "window+int4"])
def test_quantized_tiers_under_the_window_give_what_their_stores_give(tiny, sequences, mode, name):
    """The codes under the window (the sinks' codes kept in their page, pages of codes the window left freed): the
    pool's logits are those of the per-sequence stores (fed token by token, each token reading the codes it reads
    decoding alone), which attend to every code under the same mask."""
    model, _ = tiny
    ids, _ = sequences
    options = {"group_size": 2, "residual": 2}
    backend = create(name, _geometry(model), sinks=SINKS, window=WINDOW, **options)
    with kernels.using(mode):
        driver = PagedDriver(model, backend, pages=64, block_size=4)
        paged = _drive(driver, ids)
    (group,) = driver.rows[0].groups
    assert group.sink and group.first > 0 and group.q  # the sinks' codes kept, older codes freed
    runner = StorePath(model, LAYERS)
    expected = {}
    for r in range(2):
        store = backend.new_store()
        expected[(r, 0)] = runner.prefill(ids[r][:1], store)[-1]
        for pos in range(1, LENGTH):
            expected[(r, pos)] = runner.decode([ids[r][pos]], [store])[0]
    tol = 1e-3 if name == "window+int8" else 3e-3  # codes one rounding step apart (tests/test_sliding_window.py)
    for row, pos, logits in paged:
        torch.testing.assert_close(logits, expected[(row, pos)], rtol=0, atol=tol, msg=f"row {row} at {pos}")
    q = driver.layout.groups[0].q_tokens
    assert driver.layout.stored_bytes(driver.rows[0]) <= backend.kv_spec().stored_bytes(
        group.exact_len, SINKS + WINDOW - 1 + q)


def test_the_per_sequence_stores_give_the_reference(tiny, sequences):
    model, _ = tiny
    ids, reference = sequences
    backend = create("window", _geometry(model), sinks=SINKS, window=WINDOW)
    runner = StorePath(model, LAYERS)
    stores = [backend.new_store(), backend.new_store()]
    for r in range(2):
        torch.testing.assert_close(runner.prefill(ids[r][:20], stores[r], all_logits=True), reference[r, :20],
                                   rtol=0, atol=2e-5)
    for pos in range(20, LENGTH):
        torch.testing.assert_close(runner.decode([ids[0][pos], ids[1][pos]], stores), reference[:, pos], rtol=0,
                                   atol=2e-5)


def test_on_gemma3_a_sliding_layer_keeps_its_own_window_and_global_layers_get_sinks():
    """A tiny Gemma 3 (layers sliding, sliding, global, sliding of window 8): under ``window:window=16`` the sliding
    layers keep their window of 8 and no sinks, the global layer 16 and the sinks; under ``window=6`` (narrower than
    the model's) every layer gets 6 and the sinks. Through the pool, both paths give the per-sequence stores'
    logits."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from cache_backends.attention import install

    config = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=20,
                              sliding_window=8, max_position_embeddings=256,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                           "sliding_attention"])
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    install(model)
    geometry = _geometry(model)
    wide = create("window", geometry, sinks=SINKS, window=16)
    assert wide.rules == [(8, None), (8, None), (16, SINKS), (8, None)]
    assert wide.groups() == [(8, None, [0, 1, 3]), (16, SINKS, [2])]
    narrow = create("window", geometry, sinks=SINKS, window=6)
    assert narrow.groups() == [(6, SINKS, [0, 1, 2, 3])]
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, LENGTH)).tolist()
    runner = StorePath(model, 4)
    for backend in (wide, narrow):
        store = backend.new_store()
        expected = runner.prefill(ids[0][:23], store, all_logits=True)
        for mode in _attention_modes():
            with kernels.using(mode):
                driver = PagedDriver(model, backend, pages=64, block_size=4)
                blocks = driver.new_blocks()
                driver.step([blocks], [ids[0][:5]])
                plan = driver.layout.plan(blocks, 18)
                pages = driver.manager.allocate(plan.pages_needed)
                driver.layout.extend(blocks, plan, pages[: plan.new_exact_pages], pages[plan.new_exact_pages:])
                out = driver.runner.run_paged([ids[0][5:23]], [(backend, [0], [(blocks, plan)])], pages,
                                              all_logits=True)[0]
            torch.testing.assert_close(out, expected[5:], rtol=0, atol=5e-5, msg=f"{backend.groups()} {mode}")


@pytest.mark.parametrize("spec,says", [
    ("window:window=0", "window must be >= 1"),
    ("window:sinks=-1", "sinks must be >= 0"),
    ("window:sinks=abc", "sinks must be an integer"),
    ("window:rank=4", "window takes no option rank"),
    ("window+mla", "mla's latent pages keep every token"),
    ("mla+window", "mla's latent pages keep every token"),
    ("window+gqa", "gqa's pages keep every token"),
    ("window+dca", "dca lets a layer read another layer's cache"),
    ("dca+window", "dca lets a layer read another layer's cache"),
    ("window+elastic", "elastic's on-demand tier keeps every token"),
])
def test_bad_options_and_compositions_are_refused_naming_why(spec, says):
    from cache_backends.spec import check_options, parse_spec

    with pytest.raises(ValueError, match=says):
        name, options = parse_spec(spec)
        check_options(name, options)


def test_bad_values_are_refused_at_construction(tiny):
    geometry = _geometry(tiny[0])
    with pytest.raises(ValueError, match=r"window=8 must be >= residual \+ group_size = 64"):
        create("window+int8", geometry, window=8)
    with pytest.raises(ValueError, match="window: window must be an integer >= 1"):
        create("window", geometry, window=0)
    with pytest.raises(ValueError, match="window: sinks must be an integer >= 0"):
        create("window", geometry, sinks=True)
    with pytest.raises(ValueError, match=r"sinks=10 must be at most window=8 \(KV_WINDOW_SINKS <= KV_WINDOW_SIZE"):
        create("window", geometry, sinks=10, window=8)
    create("window", geometry, sinks=8, window=8)  # every seen token a sink or recent: allowed
    with pytest.raises(ValueError, match=r"sinks=8 \(KV_WINDOW_SINKS\) must fit one page of its sink tier \(4 tokens a page\): lower "
                       "KV_WINDOW_SINKS or raise KV_BLOCK_SIZE"):
        create("window", geometry, sinks=8).page_layout(torch.float32, create("window", geometry).block_bytes(4))


def test_settings_refuse_an_unsupported_composition_with_the_reason():
    from pydantic import ValidationError

    from server.config import Settings

    with pytest.raises(ValidationError, match="'window\\+mla': mla's latent pages keep every token"):
        Settings(kv_backend="window+mla")
    with pytest.raises(ValidationError, match="'dca\\+window': dca lets a layer read"):
        Settings(kv_backends="full,dca+window")
    with pytest.raises(ValidationError) as e:  # the reason once, not twice
        Settings(kv_backend="window+int8+int4")
    assert str(e.value).count("window composes only as window+int8 or window+int4") == 1
    settings = Settings(kv_backend="window+int8", kv_window_size=256, kv_window_sinks=4)
    assert settings.backend_options("window+int8") == {"sinks": 4, "window": 256, "group_size": 32,
                                                        "residual": 32, "key_bits": 8, "value_bits": 8,
                                                        "rotate": False}


def test_a_window_the_quality_budget_cannot_see_past_is_warned_about(tiny):
    """The budget prices on windows of 512 tokens: a ``window`` of 512 or more never drops a token there, so its
    price says nothing about longer contexts; the warning names the window and the priced length."""
    from server.quality_price import PRICE_WINDOW

    geometry = _geometry(tiny[0])
    says = create("window", geometry).window_warning(PRICE_WINDOW)
    assert says and "window of 1024" in says and f"windows of {PRICE_WINDOW} tokens" in says
    assert create("window", geometry, window=256).window_warning(PRICE_WINDOW) is None


def test_kvserve_estimate_prices_the_window(tiny):
    """``kvserve estimate`` rows for window specs: ``min(T, S + W - 1)`` tokens a layer (codes under window+int8)."""
    from cache_backends.estimate import Shape, estimate_rows

    shape = Shape(32, 8, 128, 128)
    rows = estimate_rows(shape, [("full", {}), ("window", {}), ("window+int8", {})], [512, 8192], [1], 2)
    per = {(r["backend"], r["seq_len"]): r["bytes_per_token_per_layer"] for r in rows}
    assert per[("window", 512)] == per[("full", 512)]  # the window covers every token
    assert per[("window", 8192)] == pytest.approx(per[("full", 8192)] * (4 + 1023) / 8192)
    assert per[("window+int8", 8192)] < per[("window", 8192)] / 1.8


MODEL = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"


@pytest.mark.real_model
@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="SmolLM2-135M not fetched (kvserve fetch-model)")
def test_smollm2_greedy_tokens_are_those_of_eager_attention_under_the_same_mask():
    """SmolLM2-135M, a 200-token prompt prefilled in chunks of 64 under ``window:sinks=4,window=64``, 12 greedy
    tokens through the pool (kernel where it builds): the tokens eager attention picks under the 4-D mask."""
    from transformers import AutoModelForCausalLM

    model, eager = with_eager_twin(AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval(),
                                   sharpen=False)
    torch.manual_seed(4)
    prompt = torch.randint(100, 20000, (200,)).tolist()
    backend = create("window", _geometry(model), sinks=4, window=64)
    driver = PagedDriver(model, backend, pages=64, block_size=16)
    blocks = driver.new_blocks()
    for i in range(0, 200, 64):
        logits = driver.step([blocks], [prompt[i : i + 64]])[0]
    tokens = []
    for _ in range(12):
        tokens.append(int(logits.argmax()))
        logits = driver.step([blocks], [[tokens[-1]]])[0]
    ids = prompt[:]
    reference = []
    for _ in range(12):
        reference.append(int(masked_logits(eager, torch.tensor([ids]), 64, 4)[0, -1].argmax()))
        ids.append(reference[-1])
    assert tokens == reference
    assert len(blocks.pages()) <= 1 + 2 * -(-(16 - 1 + 64) // 16)  # the sinks' page and the window's, per group


def test_start_up_warns_of_a_window_the_budget_prices_blind(tiny):
    """``/info``'s ``kv_quality`` and the start-up log carry the warning for ``window`` (not for ``full``)."""
    from server.engine_loading import window_warning

    geometry = _geometry(tiny[0])
    assert "loses retrieval" in window_warning(create("window", geometry))
    assert window_warning(create("full", geometry)) is None
