"""The paged KV pool: stored-form batched attention equals each backend's per-sequence store, blocks are taken on
demand and given back, preemption is invisible to the client, and a decode step's op count does not grow with
the batch."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cache_backends import kernels
from cache_backends.geometry import ModelGeometry
from cache_backends.calibration import calibration_ids
from cache_backends.page_plan import SeqBlocks
from cache_backends.registry import create
from cache_backends.store_path import StorePath
from server.engine.sampling import SamplingParams
from server.engine.sequence import Sequence
from tests.conftest import fits
from tests.precision import LOGIT_FACTOR
from tests.engine_helpers import PagedDriver, make_engine, make_seq, reference_greedy, run_all, run_step

SPECS = [("full", {}), ("int8", {}), ("gqa", {"groups": 2}), ("gqa+int8", {"groups": 2}), ("mla", {"rank": 64}),
         ("mla+int8", {"rank": 64}), ("int4", {}), ("int4", {"rotate": True}), ("int8", {"value_bits": 4}),
         ("gqa+int4", {"groups": 2, "rotate": True}), ("mla+int4", {"rank": 64, "rotate": True})]
SPEC_IDS = [name + "".join(f":{k}={v}" for k, v in options.items()) for name, options in SPECS]
TEXTS = ["And God said, Let there be light: and there was light. And God saw the light, that it was good",
         "In the beginning God created the heaven and the earth. And the earth was without form, and void",
         "The LORD is my shepherd; I shall not want."]


def _backend(model, tok, name, options):
    geometry = ModelGeometry.from_config(model.config, next(model.parameters()).dtype)
    backend = create(name, geometry, **options)
    backend.prepare(model, calibration_ids(model, tok, max_tokens=4096), fits(model))
    return backend


@pytest.mark.value
@pytest.mark.parametrize("name,options", SPECS, ids=SPEC_IDS)
def test_paged_batch_matches_the_backends_per_sequence_store(value_model, precision, name, options):
    """Prefill in chunks, then 56 batched decode steps (int8 tiers drain groups on the way): every row's logits
    equal those of the backend's per-sequence store (its identity tests: tests/test_backends.py)."""
    model, tok = value_model
    backend = _backend(model, tok, name, options)
    driver, reference = PagedDriver(model, backend), StorePath(model, backend.geometry.num_layers)
    prompts = [tok.encode(t) for t in TEXTS]
    rows, refs = [SeqBlocks() for _ in prompts], [backend.new_store() for _ in prompts]
    for blocks, store, ids in zip(rows, refs, prompts):
        driver.step([blocks], [ids[:7]])
        paged = driver.step([blocks], [ids[7:]])
        ref = reference.prefill(ids, store)
        precision.assert_close(paged[0], ref[-1], what=f"{name} prefill")
    last = [ids[-1] for ids in prompts]
    # Each path quantizes the K/V its own forward produced; those differ by a few eps, and a value that sits on a
    # rounding boundary then gets codes one step apart in the two stores. That moves later logits by more than
    # one forward's rounding, so int8 tiers are compared at 4x the logit factor (measured: up to 1.1x). A 4-bit
    # code step is 17x an int8 one (range / 15 against range / 255), and a 4-bit stream's fp16 scale can round
    # to a neighbouring fp16 value in the two paths: 4-bit tiers get 16x more (measured: 7.3x the int8 allowance).
    quant = backend.quantization
    factor = LOGIT_FACTOR * (4 if quant else 1) * (16 if quant and 4 in (quant.key_bits, quant.value_bits) else 1)
    for step in range(56):
        # the kernel scores a decode's 4-bit keys in integers unless asked for fp32 sums, as the store computes
        # (tests/test_kernels.py bounds the integer sums' error)
        with kernels.exact_sums():
            paged = driver.step(rows, [[t] for t in last])
        ref = reference.decode(last, refs)
        precision.assert_close(paged, ref, factor, what=f"{name} decode step {step}")
        last = ref.argmax(-1).tolist()
    assert [b.tokens for b in rows] == [len(p) + 56 for p in prompts]
    if backend.quantization:
        assert all(b.q_len > 0 for b in rows)  # the int8 tier was exercised
        assert all(b.exact_len < 64 for b in rows)  # the exact tier is the residual window only


MIXED_SPECS = [("full", {}), ("int8", {}), ("mla+int8", {"rank": 64}), ("int4", {"rotate": True})]


@pytest.mark.value
@pytest.mark.parametrize("name,options", MIXED_SPECS, ids=[n + "".join(f":{k}={v}" for k, v in o.items())
                                                          for n, o in MIXED_SPECS])
def test_a_mixed_step_gives_each_row_what_it_gets_in_a_step_of_its_own(value_model, precision, name, options):
    """Two sequences decoding and a third's prompt chunks (40, then 7 tokens: int8 groups drain inside a chunk) run
    in one forward of rows of different lengths: each row's logits equal those of the same rows run as a decode
    step and a prefill step apart, at the tolerance of :func:`test_paged_batch_matches_the_backends_per_sequence_store`
    (a quantized tier may round a code differently when the forward's K/V differ by a few eps)."""
    model, tok = value_model
    backend = _backend(model, tok, name, options)
    apart, mixed = PagedDriver(model, backend), PagedDriver(model, backend)
    prompts = [tok.encode(t) for t in TEXTS]
    long = (prompts[2] * 4)[:47]
    rows_a, rows_m = [SeqBlocks() for _ in range(3)], [SeqBlocks() for _ in range(3)]
    last = []
    for i in range(2):
        ref = apart.step([rows_a[i]], [prompts[i]])
        mixed.step([rows_m[i]], [prompts[i]])
        last.append(int(ref[0].argmax()))
    quant = backend.quantization
    factor = LOGIT_FACTOR * (4 if quant else 1) * (16 if quant and 4 in (quant.key_bits, quant.value_bits) else 1)
    for chunk in (long[:40], long[40:]):
        decode = apart.step(rows_a[:2], [[t] for t in last])
        prefill = apart.step([rows_a[2]], [chunk])
        both = mixed.step(rows_m, [[last[0]], [last[1]], chunk])
        assert both.shape == (3, decode.shape[-1])
        precision.assert_close(both[:2], decode, factor, what=f"{name} decode rows of a mixed step")
        precision.assert_close(both[2:], prefill, factor, what=f"{name} prefill row of a mixed step")
        last = decode.argmax(-1).tolist()
    assert [b.tokens for b in rows_m] == [b.tokens for b in rows_a]


def test_blocks_are_taken_on_demand_and_given_back(ref_model):
    model, tok = ref_model
    engine = make_engine(model, tok, budget=64 * 262144)  # 64 blocks of 16 full-precision tokens
    seq = make_seq(tok, "And God said", 300)  # 3 prompt tokens; reserving 303 tokens would take 19 blocks
    engine.submit(seq)
    run_step(engine)  # the prompt prefilled and its first token sampled; decode steps follow
    assert engine.kv.held(seq) == 1 and engine.kv_held_bytes() == engine.kv.page_bytes
    for _ in range(14):
        run_step(engine)
    assert engine.kv.store(seq).num_tokens() == 17 and engine.kv.held(seq) == 2  # a second block when the first filled
    seq.cancel()
    run_step(engine)
    assert engine.kv_held_bytes() == 0 and engine.kv.blocks.num_free == engine.kv.blocks.usable_pages


def test_info_says_the_pool_counts_its_null_page(ref_model):
    """``/info``'s ``pool_bytes`` was one page more than ``num_blocks`` pages, without saying why: the null page
    (zeros) that pads block tables is part of the pool and holds no tokens."""
    model, tok = ref_model
    info = make_engine(model, tok, "full", budget=40 * 262144).kv.info()  # 40 blocks of 16 full tokens
    assert info["null_pages"] == 1
    assert info["pool_bytes"] == (info["num_blocks"] + info["null_pages"]) * info["page_bytes"]


def test_int8_window_pages_are_returned_as_groups_quantize(ref_model):
    """An int8 sequence holds its quantized pages plus only the exact pages of its residual window."""
    model, tok = ref_model
    engine = make_engine(model, tok, "int8")
    layout = engine.kv.layouts["int8"]
    seq = make_seq(tok, " ".join(["And God said"] * 80), 4, backend="int8")
    engine.submit(seq)
    while seq.prefilled < len(seq.prompt_ids):
        run_step(engine)
    blocks = engine.kv.table(seq)
    assert blocks.exact_len < 32 + 32 and blocks.q_len % 32 == 0
    assert len(blocks.exact) <= -(-(blocks.start + blocks.exact_len) // layout.exact_tokens)
    assert engine.kv.store(seq).nbytes() == layout.stored_bytes(blocks)
    assert engine.kv_held_bytes() == len(blocks.pages()) * engine.kv.page_bytes


def test_a_request_that_can_never_fit_the_pool_is_refused(ref_model):
    model, tok = ref_model
    engine = make_engine(model, tok, budget=8 * 262144)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.submit(make_seq(tok, "And God said", 200))


@pytest.mark.value
def test_preemption_is_invisible_to_the_client(value_model, precision):
    """Four streams under a pool too small for them all: sequences are preempted and recomputed, yet each stream
    gets every index once, in order, and the greedy tokens of generate()."""
    model, tok = value_model
    engine = make_engine(model, tok, budget=12 * 262144 // (4 // next(model.parameters()).element_size()),
                         max_batch_size=4)
    prompts = ["And God said", "The LORD is my shepherd", "In the beginning", "Blessed are the"]
    events = [[] for _ in prompts]
    seqs = [make_seq(tok, p, 60, events=ev) for p, ev in zip(prompts, events)]
    run_all(engine, seqs)
    assert sum(s.preemptions for s in seqs) > 0
    for prompt, seq, ev in zip(prompts, seqs, events):
        assert [e.index for e in ev] == list(range(60)) and ev[-1].finish_reason is not None
        precision.assert_greedy_agrees(model, tok.encode(prompt), seq.output_ids,
                                       reference_greedy(model, tok, prompt, 60))
    assert engine.kv.blocks.num_free == engine.kv.blocks.usable_pages


def test_mixed_backends_share_the_pool_and_one_forward(ref_model):
    """full and int8 sequences decode in one forward; each row gets what it gets alone."""
    from server.engine.setup import build_engine

    model, tok = ref_model
    g = ModelGeometry.from_config(model.config, torch.float32)
    backends = {"full": create("full", g), "int8": create("int8", g)}
    params = SamplingParams()

    def run(names):
        engine = build_engine(model, tok, {n: backends[n] for n in dict.fromkeys(names)}, {0},
                              max_batch_size=4, budget_bytes=None, max_total_tokens=1024)
        seqs = [make_seq(tok, p, 30, backend=n, params=params) for p, n in zip(TEXTS, names)]
        run_all(engine, seqs)
        return [s.output_ids for s in seqs]

    mixed = run(["full", "int8", "full"])
    assert mixed[0] == run(["full"])[0] and mixed[1] == run(["full", "int8"])[1]


def test_a_mixed_step_of_several_backends(ref_model):
    """A long int8 prompt is prefilled in chunks while a full and a dca+mla sequence decode: each step's chunk, the
    full row and the dca+mla row (its groups of pages, attended in its span of the flat row) run in one forward,
    and every sequence's greedy output equals its output served alone."""
    from server.engine.setup import build_engine

    model, tok = ref_model
    g = ModelGeometry.from_config(model.config, torch.float32)
    calib = calibration_ids(model, tok, max_tokens=4096)
    backends = {"full": create("full", g), "int8": create("int8", g), "dca+mla": create("dca+mla", g)}
    for backend in backends.values():
        backend.prepare(model, calib, fits(model))
    long = " ".join([TEXTS[0], TEXTS[1]] * 3)  # ~130 tokens: three chunks of 48

    def engine(names):
        return build_engine(model, tok, {n: backends[n] for n in names}, {0}, max_batch_size=4, budget_bytes=None,
                            max_total_tokens=1024, prefill_chunk_tokens=50)

    def alone(prompt, name, n):
        seq = make_seq(tok, prompt, n, backend=name)
        run_all(engine([name]), [seq])
        return seq.output_ids

    e = engine(["full", "int8", "dca+mla"])
    shapes = []
    hook = e.runner.model.register_forward_hook(lambda m, a, kw, out: shapes.append(tuple(kw["input_ids"].shape)),
                                                with_kwargs=True)
    running = [make_seq(tok, TEXTS[2], 40, backend="full"), make_seq(tok, TEXTS[1], 40, backend="dca+mla")]
    for seq in running:
        e.submit(seq)
    run_step(e)
    run_step(e)
    before = len(shapes)
    late = make_seq(tok, long, 8, backend="int8")
    run_all(e, [late])
    hook.remove()
    # after the two prompts and a decode step: each chunk of the long prompt beside the two decode tokens, one flat row
    chunks = [n - 2 for rows, n in shapes[before:] if rows == 1]
    assert len(chunks) >= 2 and sum(chunks) == len(late.prompt_ids)
    assert late.output_ids == alone(long, "int8", 8)
    assert running[0].output_ids == alone(TEXTS[2], "full", 40)
    assert running[1].output_ids == alone(TEXTS[1], "dca+mla", 40)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops that compute (views, which only relabel a tensor's shape, are not counted: the model's
    own reshapes differ at batch 1)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.by_op = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        self.by_op[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name,options", [("full", {}), ("int8", {}), ("mla+int8", {"rank": 64}),
                                          ("dca", {"threshold": -1.0}), ("dca+int8", {"threshold": -1.0})],
                         ids=["full", "int8", "mla+int8", "dca", "dca+int8"])
def test_a_decode_steps_op_count_does_not_grow_with_the_batch(ref_model, name, options):
    """One decode step's aten ops are the same at batch 1, 4 and 8 (dca: every candidate reusing its source through
    its map, read from the kept layers' pages)."""
    model, tok = ref_model
    backend = _backend(model, tok, name, options)
    counts = {}
    for batch in (1, 4, 8):
        driver = PagedDriver(model, backend, pages=400)
        ids = tok.encode(TEXTS[0])[:20]
        rows = [driver.new_blocks() for _ in range(batch)]
        driver.step(rows, [ids] * batch)
        driver.step(rows, [[ids[0]]] * batch)
        with _OpCounter() as counter:
            driver.step(rows, [[ids[1]]] * batch)
        counts[batch] = counter.count
    assert counts[1] == counts[4] == counts[8], counts


@pytest.mark.parametrize("name", ["full", "int8"])
def test_a_step_gathers_the_exact_streams_of_a_layer_in_one_op(ref_model, name):
    """The pages of every head, sequence and exact stream of one layer (``full``'s and ``int8``'s K and V lie end to
    end in a page) are gathered by one ``index_select`` per layer (not one per stream, nor per head: 8x the ops on
    the reference model), and each stream's part of it is what a gather of that stream alone reads."""
    from cache_backends.paged import _gather
    from cache_backends.step_meta import StepMeta

    model, tok = ref_model
    backend = _backend(model, tok, name, {})
    driver = PagedDriver(model, backend, pages=400)
    ids = tok.encode(" ".join(TEXTS * 3))[:100]  # int8: 100 tokens leave quantized groups beside the exact window
    rows = [SeqBlocks() for _ in range(4)]
    with kernels.using("torch"):  # the torch path gathers (the attention kernel reads the pages in place)
        driver.step(rows, [ids] * 4)
        with _OpCounter() as counter:
            driver.step(rows, [[ids[0]]] * 4)
    views = driver.pool.views[backend.name]
    assert (rows[0].q_len > 0) == bool(views.layout.quantization)
    q_gathers = 3 * len(views.layout.streams) if views.layout.quantization else 0  # codes, scales, zero points
    assert counter.by_op["index_select"] == model.config.num_hidden_layers * (1 + q_gathers), counter.by_op
    meta = StepMeta(views.layout, [(b, views.layout.plan(b, 1)) for b in rows], torch.device("cpu"))
    for layer in range(model.config.num_hidden_layers):
        joint = _gather(views.exact_joint[layer], meta.exact_table, {})
        alone = [_gather(views.exact[layer][s], meta.exact_table, {}) for s in range(len(views.layout.streams))]
        assert torch.equal(joint, torch.cat(alone)) and joint.abs().sum() > 0


def test_a_wide_request_cannot_make_a_later_one_wait_for_its_whole_length(ref_model):
    """Four generations of one request fill the batch; a later one-request sequence gets a slot within a few steps
    (the wide request's newest generation is preempted), and every wide generation still streams every index
    once, in order, and ends with the tokens it gets alone."""
    model, tok = ref_model
    engine = make_engine(model, tok, max_batch_size=4)
    events = [[] for _ in range(4)]
    wide = [make_seq(tok, "And God said", 80, events=ev) for ev in events]
    for seq in wide:
        seq.group = "wide"
        engine.submit(seq)
    for _ in range(3):
        run_step(engine)
    small = make_seq(tok, "The LORD is my shepherd", 3)
    engine.submit(small)
    steps = 0
    while small.finish_reason is None:
        run_step(engine)
        steps += 1
    assert steps <= 6 and sum(s.preemptions for s in wide) >= 1
    run_all(engine, [])
    alone = reference_greedy(model, tok, "And God said", 80)
    for seq, ev in zip(wide, events):
        assert [e.index for e in ev] == list(range(80)) and seq.output_ids == alone


def _steps_for_a_later_request(engine, tok):
    """Submit a 200-token prompt (13 blocks) for 3 tokens and step ``engine`` until it ends: the steps it took, and
    the sequence."""
    small = make_seq(tok, " ".join(["The LORD is my shepherd; I shall not want."] * 20), 3)
    small.prompt_ids = small.prompt_ids[:200]
    engine.submit(small)
    steps = 0
    while small.finish_reason is None:
        run_step(engine)
        steps += 1
    return steps, small


def test_a_wide_request_on_a_full_pool_cannot_make_a_later_one_wait_for_its_whole_length(ref_model):
    """Fair share of the pool, not only of the batch: four generations of one request fill a pool of 32 blocks with
    the batch half empty; a later request whose prompt needs 13 blocks is admitted ahead of the wide request's
    preempted generations and finishes within a few steps (it waited for a wide generation to end before), while
    every wide generation still gets the tokens it gets alone."""
    model, tok = ref_model
    engine = make_engine(model, tok, max_batch_size=8, budget=33 * 262144)
    assert engine.kv.blocks.usable_pages == 32
    events = [[] for _ in range(4)]
    wide = [make_seq(tok, "And God said", 200, params=SamplingParams(ignore_eos=True), events=ev) for ev in events]
    for seq in wide:
        seq.group = "wide"
        engine.submit(seq)
    while engine.kv.blocks.num_free > 1:
        run_step(engine)
    assert engine.waiting or sum(s.preemptions for s in wide) or len(engine.running) == 4
    steps, small = _steps_for_a_later_request(engine, tok)
    assert steps <= 8 and small.finish_reason.value == "length", steps
    run_all(engine, [])
    alone = reference_greedy(model, tok, "And God said", 200)
    for seq, ev in zip(wide, events):
        assert [e.index for e in ev] == list(range(200)) and seq.output_ids == alone
    assert engine.kv.blocks.num_free == engine.kv.blocks.usable_pages


def test_two_wide_requests_on_a_full_pool_cannot_make_a_later_one_wait(ref_model):
    """The pool's share is split between every request that competes for it: two wide requests of three
    generations each fill a pool of 32 blocks; a later 200-token prompt (13 blocks, more than either holds above
    its share) finishes within a few steps, and every wide generation still gets the tokens it gets alone."""
    model, tok = ref_model
    engine = make_engine(model, tok, max_batch_size=8, budget=33 * 262144)
    wide = []
    for group, prompt in (("a", "And God said"), ("b", "In the beginning")):
        for _ in range(3):
            seq = make_seq(tok, prompt, 160, params=SamplingParams(ignore_eos=True))
            seq.group = group
            wide.append(seq)
            engine.submit(seq)
    while engine.kv.blocks.num_free > 1:
        run_step(engine)
    steps, small = _steps_for_a_later_request(engine, tok)
    assert steps <= 8 and small.finish_reason.value == "length", steps
    run_all(engine, [])
    for seq in wide:
        prompt = "And God said" if seq.group == "a" else "In the beginning"
        assert seq.output_ids == reference_greedy(model, tok, prompt, 160)


def test_two_long_single_requests_do_not_evict_each_other_in_turn(ref_model):
    """The pool's fair share never preempts a request's only sequence for another: two single requests too long to
    run together finish one after the other, each preempted at most once, with their greedy tokens."""
    model, tok = ref_model
    engine = make_engine(model, tok, max_batch_size=8, budget=33 * 262144)
    prompts = ["And God said", "In the beginning"]
    seqs = [make_seq(tok, p, 300, params=SamplingParams(ignore_eos=True)) for p in prompts]
    run_all(engine, seqs, max_steps=2000)
    for p, s in zip(prompts, seqs):
        assert s.preemptions <= 1 and s.output_ids == reference_greedy(model, tok, p, 300)


def test_a_whole_prompt_prefill_that_can_never_fit_is_refused_at_once(ref_model):
    """int8 prefills a prompt that wants every position's log-probability whole, its exact pages first: when
    that alone exceeds the pool, the request is refused when submitted (it used to be preempted and readmitted
    forever, then ended with an error after its first try), while the same prompt prefilled in chunks is served."""
    model, tok = ref_model
    engine = make_engine(model, tok, "int8", budget=50 * 163840)
    seq = make_seq(tok, " ".join(["And God said"] * 200), 4, backend="int8")
    seq.prompt_ids = seq.prompt_ids[:600]
    seq.want_prompt_logprobs = True
    with pytest.raises(ValueError, match="KV blocks"):
        engine.submit(seq)
    chunked = make_seq(tok, " ".join(["And God said"] * 200), 4, backend="int8")
    chunked.prompt_ids = chunked.prompt_ids[:600]
    run_all(engine, [chunked], max_steps=50)
    assert chunked.finish_reason.value == "length" and engine.kv.blocks.num_free == engine.kv.blocks.usable_pages


@pytest.mark.parametrize("name,options", [("int4", {}), ("int4", {"rotate": True}), ("int8", {"value_bits": 4}),
                                          ("mla+int4", {"rank": 64})],
                         ids=["int4", "int4:rotate=true", "k8v4", "mla+int4:rank=64"])
def test_4bit_pages_hold_packed_codes_and_cost_the_sums(ref_model, name, options):
    """A 4-bit tier's codes are uint8 slabs of width / 2 bytes per token and head (two codes a byte), and a sequence
    the engine prefills and decodes holds, at every length checked, the bytes the closed-form sums give at that
    length (``kvserve estimate`` and ``/info``), to the byte."""
    model, tok = ref_model
    engine = make_engine(model, tok, name, **options)
    layout = engine.kv.layouts[name]
    quant = layout.quantization
    for row, spec in zip(layout.q_slabs[0], layout.streams):
        bits = quant.bits(spec.axis)
        assert row[0].dtype == (torch.uint8 if bits == 4 else torch.int8) and row[0].width == spec.width * bits // 8
    seq = make_seq(tok, " ".join(["And God said, Let there be light"] * 40), 70, backend=name)
    engine.submit(seq)
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    sums = create(name, geometry, **options)
    seen = set()
    while seq.finish_reason is None:
        run_step(engine)
        table = engine.kv.table(seq)
        t = table.tokens if table is not None else 0
        if t and t not in seen and (t % 7 == 0 or seq.prefilled == len(seq.prompt_ids) and not seen):
            seen.add(t)
            want = sums.bytes_per_token_per_layer(t) * t * geometry.num_layers
            assert layout.stored_bytes(table) == pytest.approx(want, rel=1e-12), t
            q_len = table.q_len
    assert len(seen) >= 5 and len(seq.output_ids) == 70 and q_len > 0  # the 4-bit tier was exercised


@pytest.mark.parametrize("name,options", [("int8", {}), ("int4", {})], ids=["int8", "int4"])
def test_admission_charges_the_stored_form_not_the_chunks_exact_pages(ref_model, name, options):
    """A quantized prompt is charged the pages it holds once written (its quantized pages and residual window),
    and the transient exact pages of one prefill step of 64 tokens are kept free once, not per sequence (a step
    is shortened to the pages free): a pool that holds five 512-token prompts in stored form plus that transient
    admits all five at once (charged each prompt's in-step peak at 256-token chunks, it admitted one or two),
    each is charged exactly what it holds after its prefill, nothing is preempted, and the greedy tokens are
    those of each prompt served alone."""
    model, tok = ref_model
    stream = tok.encode(" ".join(TEXTS * 40))
    prompts = [stream[7 * i : 7 * i + 512] for i in range(5)]

    def seqs():
        out = [make_seq(tok, f"p{i}", 6, backend=name, params=SamplingParams(ignore_eos=True)) for i in range(5)]
        for s, ids in zip(out, prompts):
            s.prompt_ids = list(ids)
        return out

    def spy(kv):
        """The pages each sequence holds after its prefill."""
        after, commit = {}, kv.commit

        def spy_commit(seq, res, feedback=None):
            commit(seq, res, feedback)
            if not seq.output_ids and kv.table(seq).tokens == len(seq.prompt_ids):
                after[seq.request_id] = kv.held(seq)

        kv.commit = spy_commit
        return after

    roomy = make_engine(model, tok, name, prefix_caching=False, **options)
    held = spy(roomy.kv)
    alone = []
    for s in seqs():
        run_all(roomy, [s])
        alone.append(s.output_ids)
    stored, peak = held["p0"], roomy.kv.pages_for(seqs()[0], 512)  # peak: chunks of 256 from an empty table
    layout, q = roomy.kv.layouts[name], roomy.kv.layouts[name].quantization
    te, drained = layout.exact_tokens, (512 - q.residual) // q.group_size * q.group_size
    assert set(held.values()) == {stored} == {-(-drained // layout.q_tokens) + -(-512 // te) - drained // te}
    # one 64-token step after a window of at most residual + group_size - 1 exact tokens, at the worst offset
    transient = -(-drained // layout.q_tokens) + -(-(te - 1 + q.residual + q.group_size - 1 + 64) // te) - stored
    usable = 5 * stored + transient + 2
    assert usable < 3 * peak  # the old rule (each prompt charged its peak) admits two at most

    engine = make_engine(model, tok, name, budget=(usable + 1) * roomy.kv.page_bytes, prefix_caching=False,
                         **options)
    assert engine.kv.blocks.usable_pages == usable
    kv, batch = engine.kv, seqs()
    after = spy(kv)
    charged = {s.request_id: kv.admission_cost(s) for s in batch}
    for s in batch:
        engine.submit(s)
    run_step(engine)
    assert len(engine.running) == 5 and not engine.waiting
    run_all(engine, [], max_steps=400)
    assert after == charged == {s.request_id: stored for s in batch}
    assert [s.preemptions for s in batch] == [0] * 5
    assert [s.output_ids for s in batch] == alone
    assert kv.transient_pages(seqs()[0]) == transient


def test_the_attention_mask_is_dropped_only_when_it_hides_nothing(ref_model):
    """Decode rows of one length attend with no mask, over their own tokens (the padding of their last page left
    out); rows of different lengths, or a chunk of several tokens (causal), get the step's mask, grouped once per
    step for every layer; the logits are the same either way (the engine's value tests)."""
    from cache_backends.step_meta import StepMeta

    model, tok = ref_model
    backend = _backend(model, tok, "full", {})
    driver = PagedDriver(model, backend, pages=400)
    layout = driver.pool.views[backend.name].layout
    ids = tok.encode(" ".join(TEXTS))
    even, uneven = [SeqBlocks() for _ in range(2)], [SeqBlocks() for _ in range(2)]
    driver.step(even, [ids[:28]] * 2)  # two pages of 16 tokens: room for 4 more without a new page
    driver.step(uneven, [ids[:28], ids[:20]])

    def meta(rows, n):
        return StepMeta(layout, [(b, layout.plan(b, n)) for b in rows], torch.device("cpu"))

    m = meta(even, 1)
    assert m.grouped_mask(1) is None and m.unmasked_len == 29
    m = meta(uneven, 1)
    grouped = m.grouped_mask(2)
    assert grouped.shape == (2, 1, 2, 32)
    assert grouped[0, 0, :, :29].all() and not grouped[0, 0, :, 29:].any()
    assert grouped[1, 0, :, :21].all() and not grouped[1, 0, :, 21:].any()
    assert m.grouped_mask(2) is grouped  # built once for every layer
    chunk = meta(even, 3).grouped_mask(1)
    assert chunk is not None and chunk[0, 0, 0, :29].all() and not chunk[0, 0, 0, 29:].any()  # not its next ones


def test_decode_rows_of_one_length_give_the_same_logits_without_the_mask(ref_model, monkeypatch):
    from cache_backends.step_meta import StepMeta

    model, tok = ref_model
    backend = _backend(model, tok, "full", {})
    ids = tok.encode(" ".join(TEXTS))
    logits = []
    for keep_mask in (False, True):
        if keep_mask:
            monkeypatch.setattr(StepMeta, "grouped_mask", lambda self, rep: self.mask[:, None].expand(
                -1, rep, -1, -1).reshape(self.mask.shape[0], 1, -1, self.mask.shape[-1]))
        driver = PagedDriver(model, backend, pages=400)
        rows = [SeqBlocks() for _ in range(3)]
        driver.step(rows, [ids[:37], ids[3:40], ids[5:42]])
        logits.append(driver.step(rows, [[ids[37]], [ids[40]], [ids[42]]]))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_zero_clears_exactly_the_pages_given():
    """``KVPool.zero`` (over the arena's words) clears the listed pages, every byte, and no other."""
    from cache_backends.pool import KVPool

    pool = KVPool(6, 128, {}, "cpu")
    pool.arena.fill_(7)
    pool.zero([2, 4])
    assert pool.arena[[2, 4]].eq(0).all() and pool.arena[[1, 3, 5]].eq(7).all()


@pytest.mark.parametrize("backend", ["int8", "int4", "full"])
@pytest.mark.parametrize("chunk, decoding", [(100, 5), (24, 3)])
def test_a_prompt_cut_by_the_decoding_tokens_holds_no_more_than_admission_bounds(ref_model, backend, chunk, decoding):
    """Beside ``decoding`` sequences a prompt's steps are ``chunk - decoding`` tokens (never fewer than
    MIN_PREFILL_CHUNK: with a chunk of 24, steps of 64), cut where the chunk's walk does not cut it: a 141-token int8
    prompt held 15 pages in steps of 95 where :meth:`KVCacheManager.pages_to_finish` (walking steps of 100) said
    12. The pages it holds during each step stay within the bound."""
    model, tok = ref_model
    engine = make_engine(model, tok, backend, prefill_chunk_tokens=chunk, block_size=16)
    kv = engine.kv
    ids = tok.encode(" ".join(TEXTS * 4))
    assert len(ids) >= 141
    long = Sequence(request_id="long", prompt_ids=ids[:141], max_new_tokens=2, params=SamplingParams(), stop=[],
                    backend_name=backend)
    peak, commit = [], kv.commit

    def held_then_commit(seq, plan, feedback=None):
        if seq is long:
            peak.append(kv.held(seq))
        return commit(seq, plan, feedback)

    kv.commit = held_then_commit
    for i in range(decoding):
        engine.submit(Sequence(request_id=f"d{i}", prompt_ids=ids[i : i + 3], max_new_tokens=30,
                               params=SamplingParams(), stop=[], backend_name=backend))
    run_step(engine)
    run_all(engine, [long])
    assert max(peak) <= kv.pages_to_finish(long), (peak, kv.pages_to_finish(long))


@pytest.mark.parametrize("backend", ["window+int8", "window+int4"])
def test_a_windowed_prompt_cut_by_the_decoding_tokens_holds_no_more_than_admission_bounds(ref_model, backend):
    """On a layout of window groups (``window`` with sinks 4 and a window of 64, over int8/int4) too: beside 5
    sequences that decode 3 tokens, a 300-token prompt's steps are 95, 95, then 100 from position 190, where the
    window's pages are least aligned: it held 23 pages (int4: 39) where :meth:`KVCacheManager.pages_to_finish`,
    walking steps of 100 from position 0, said 19 (int4: 33). The pages it holds during each step stay within the
    bound."""
    model, tok = ref_model
    engine = make_engine(model, tok, backend, prefill_chunk_tokens=100, block_size=16, sinks=4, window=64)
    kv = engine.kv
    ids = tok.encode(" ".join(TEXTS * 8))
    long = Sequence(request_id="long", prompt_ids=ids[:300], max_new_tokens=2, params=SamplingParams(), stop=[],
                    backend_name=backend)
    peak, steps, commit = [], [], kv.commit

    def held_then_commit(seq, plan, feedback=None):
        if seq is long:
            peak.append(kv.held(seq))
            steps.append(plan.n)
        return commit(seq, plan, feedback)

    kv.commit = held_then_commit
    for i in range(5):
        engine.submit(Sequence(request_id=f"d{i}", prompt_ids=ids[i : i + 3], max_new_tokens=3,
                               params=SamplingParams(), stop=[], backend_name=backend))
    run_step(engine)
    run_all(engine, [long])
    assert steps[:3] == [95, 95, 100]  # the cut the bound must allow for
    assert max(peak) <= kv.pages_to_finish(long), (peak, kv.pages_to_finish(long))
