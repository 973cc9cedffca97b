"""The ``snapkv`` backend (SnapKV, arXiv 2404.14469): each layer and K/V head keeps the prompt tokens its observation
window attends to most.

A tiny randomly initialised Llama (2 layers, 4 query heads sharing 2 K/V heads, head_dim 16, fp32, sharpened
attention), capacity 24 with a window of 4 and a pooling kernel of 3, pages of 4 tokens, a 50-token prompt. The
reference is transformers' eager attention: the selection is recomputed from its attention weights
(``output_attentions``), and the logits after the prompt are eager attention's under a per-layer, per-head 4-D mask
of the kept tokens. Through the pool (torch path and attention kernel): the prompt's logits are ``full``'s, every
decode step's are the reference's, each layer's pages hold the reference's kept keys, the pool holds ``capacity``
tokens a layer and frees the rest; a prompt no longer than the capacity gives ``full``'s tokens; ``snapkv+int8``
gives its per-sequence stores' tokens and serves through the engine; bad options are refused naming them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cache_backends import kernels
from cache_backends.geometry import ModelGeometry
from cache_backends.registry import create
from cache_backends.store_path import StorePath
from server.engine.kv_cache import PagedStore
from server.engine.sequence import FinishReason
from tests.conftest import MODEL_DIR
from tests.engine_helpers import PagedDriver, make_engine, make_seq, run_all, with_eager_twin

CAPACITY, WINDOW, KERNEL, PROMPT, DECODE = 24, 4, 3, 50, 8
HEADS, HEADS_KV, HEAD_DIM, LAYERS = 4, 2, 16, 2
TOKEN_BYTES = 2 * HEADS_KV * HEAD_DIM * 4  # K and V, fp32, one layer
OPTIONS = {"capacity": CAPACITY, "window": WINDOW, "kernel": KERNEL}


def _attention_modes():
    return ["torch", "kernel"] if kernels.load() else ["torch"]


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS_KV, head_dim=HEAD_DIM,
                         max_position_embeddings=256)
    torch.manual_seed(0)
    return with_eager_twin(LlamaForCausalLM(config).eval())


@pytest.fixture(scope="module")
def prompt():
    torch.manual_seed(1)
    return torch.randint(3, 128, (PROMPT,)).tolist()


def _geometry(model) -> ModelGeometry:
    return ModelGeometry.from_config(model.config, torch.float32)


def reference_selection(eager, ids: list[int], pooling: str = "avg") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the (H, CAPACITY) kept indices computed from eager attention's weights (the paper's listing:
    the window's weights summed over its queries and each K/V head's query heads, average- or max-pooled, top-k,
    the window appended) and the (H, T, d) keys eager attention cached."""
    with torch.no_grad():
        out = eager(torch.tensor([ids]), output_attentions=True, use_cache=True)
    rep, t = HEADS // HEADS_KV, len(ids)
    selections, keys = [], []
    for layer, weights in enumerate(out.attentions):  # (1, Hq, T, T)
        votes = weights[0, :, -WINDOW:, : t - WINDOW].reshape(HEADS_KV, rep * WINDOW, t - WINDOW).sum(1)
        pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
        votes = pool(votes[:, None], KERNEL, stride=1, padding=KERNEL // 2)[:, 0]
        chosen = votes.topk(CAPACITY - WINDOW, dim=-1).indices.sort(-1).values
        selections.append(torch.cat([chosen, torch.arange(t - WINDOW, t).expand(HEADS_KV, WINDOW)], -1))
        keys.append(out.past_key_values.layers[layer].keys[0])
    return selections, keys


def masked_logits(eager, ids: list[int], prompt_len: int, selections: list[torch.Tensor]) -> torch.Tensor:
    """Eager attention's logits (T, vocab) where every query after the prompt sees, in layer ``l`` and query head
    ``h``, the prompt tokens ``selections[l]`` keeps for its K/V head and every later token (a per-layer 4-D mask)."""
    t, rep = len(ids), HEADS // HEADS_KV
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    masks = []
    for index in selections:
        keep = torch.zeros(HEADS_KV, prompt_len, dtype=torch.bool).scatter_(1, index, True)
        mask = causal[None].repeat(HEADS, 1, 1)
        mask[:, prompt_len:, :prompt_len] &= keep.repeat_interleave(rep, 0)[:, None, :]
        additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        masks.append(additive[None])

    def hook(layer):
        def swap(module, args, kwargs):
            kwargs["attention_mask"] = masks[layer]
            return args, kwargs
        return swap

    handles = [block.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i, block in enumerate(eager.model.layers)]
    try:
        with torch.no_grad():
            return eager(torch.tensor([ids])).logits[0]
    finally:
        for h in handles:
            h.remove()


def _generate(driver: PagedDriver, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor], object]:
    """The prompt in one step, then ``steps`` greedy tokens one a step: the tokens, every step's logits, the tables."""
    blocks = driver.new_blocks()
    logits = [driver.step([blocks], [ids])[0]]
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits.append(driver.step([blocks], [[tokens[-1]]])[0])
    return tokens, logits, blocks


def _store_tokens(model, backend, ids: list[int], layers: int = LAYERS) -> list[int]:
    """DECODE greedy tokens through ``backend``'s per-sequence store (the reference path): the prompt in one pass."""
    runner, store = StorePath(model, layers), backend.new_store()
    assert not store.supports_chunked_prefill
    logits = runner.prefill(ids, store)[-1]
    tokens = []
    for _ in range(DECODE):
        tokens.append(int(logits.argmax()))
        logits = runner.decode([tokens[-1]], [store])[0]
    return tokens


def _pool_keys(driver: PagedDriver, blocks, layer: int) -> torch.Tensor:
    """(H, tokens, d) keys of ``layer`` in the exact pages of a full-precision sequence, slot order."""
    view = driver.pool.views[driver.backend.name].exact[layer][0]  # (heads, num_pages, exact_tokens, d)
    pages = view[:, blocks.exact]
    return pages.reshape(pages.shape[0], -1, pages.shape[-1])[:, blocks.start : blocks.start + blocks.exact_len]


@pytest.mark.parametrize("mode,pooling", [(mode, "avg") for mode in _attention_modes()] + [("torch", "max")])
def test_the_pool_keeps_the_selection_of_eager_attention_weights_and_decodes_as_its_mask(tiny, prompt, mode, pooling):
    """A 50-token prompt under capacity 24: its logits are full attention's (the prefill is exact), each layer's
    pages hold, head by head, the keys of the tokens eager attention's weights select, and every decode step's
    logits are eager attention's under that per-layer, per-head mask."""
    model, eager = tiny
    selections, keys = reference_selection(eager, prompt, pooling)
    assert any(not torch.equal(selections[0][h], selections[1][h]) for h in range(HEADS_KV))  # per layer
    assert not torch.equal(selections[0][0], selections[0][1])  # and per head
    with kernels.using(mode):
        driver = PagedDriver(model, create("snapkv", _geometry(model), **OPTIONS, pooling=pooling), pages=64,
                             block_size=4)
        tokens, logits, blocks = _generate(driver, prompt, DECODE)
    with torch.no_grad():
        dense = eager(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits[0], dense[-1], rtol=0, atol=2e-5)
    for layer in range(LAYERS):
        held = _pool_keys(driver, blocks, layer)[:, :CAPACITY]
        expected = keys[layer].gather(1, selections[layer][..., None].expand(-1, -1, HEAD_DIM))
        torch.testing.assert_close(held, expected, rtol=0, atol=1e-5, msg=f"layer {layer}")
    reference = masked_logits(eager, prompt + tokens, PROMPT, selections)
    for step in range(1, DECODE + 1):
        torch.testing.assert_close(logits[step], reference[PROMPT + step - 1], rtol=0, atol=2e-5,
                                   msg=f"decode step {step}")
    full = masked_logits(eager, prompt + tokens, PROMPT, [torch.arange(PROMPT).expand(HEADS_KV, -1)] * LAYERS)
    assert (full[-1] - reference[-1]).abs().max() > 1e-2  # the selection is not full attention here


def test_the_kernel_and_the_torch_path_give_the_same_greedy_tokens(tiny, prompt):
    if not kernels.load():
        pytest.skip("the attention kernel does not build here")
    model, _ = tiny
    out = {}
    for mode in ("torch", "kernel"):
        with kernels.using(mode):
            driver = PagedDriver(model, create("snapkv", _geometry(model), **OPTIONS), pages=64, block_size=4)
            out[mode] = _generate(driver, prompt, DECODE)[0]
    assert out["torch"] == out["kernel"]


@pytest.mark.parametrize("mode", _attention_modes())
def test_a_prompt_no_longer_than_the_capacity_gives_full_s_tokens(tiny, prompt, mode):
    model, _ = tiny
    with kernels.using(mode):
        full = _generate(PagedDriver(model, create("full", _geometry(model)), pages=64, block_size=4),
                         prompt[:CAPACITY], 12)
        driver = PagedDriver(model, create("snapkv", _geometry(model), **OPTIONS), pages=64, block_size=4)
        snap = _generate(driver, prompt[:CAPACITY], 12)
    assert snap[0] == full[0]
    for a, b in zip(snap[1], full[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (snap[2].first, snap[2].exact_len) == (0, CAPACITY + 12)  # every token kept, decode tokens too


def test_the_pool_holds_the_capacity_and_frees_the_rest(tiny, prompt):
    """After the prompt each layer holds CAPACITY tokens (the bytes the sums and ``kvserve estimate`` say) in the
    pages of CAPACITY tokens, every other page back in the pool; decode tokens are appended and kept; admission's
    bound covers every step."""
    from cache_backends.estimate import Shape, bytes_per_token_per_layer

    model, _ = tiny
    backend = create("snapkv", _geometry(model), **OPTIONS)
    driver = PagedDriver(model, backend, pages=64, block_size=4)
    layout, blocks = driver.layout, driver.new_blocks()
    held = []
    with kernels.using("torch"):
        driver.step([blocks], [prompt])
        assert (blocks.first, blocks.exact_len, blocks.q_len) == (PROMPT - CAPACITY, CAPACITY, 0)
        assert layout.stored_bytes(blocks) == TOKEN_BYTES * LAYERS * CAPACITY
        assert backend.bytes_per_token_per_layer(PROMPT) * PROMPT * LAYERS == layout.stored_bytes(blocks)
        assert len(blocks.pages()) == CAPACITY // 4
        assert driver.manager.num_free == 64 - 1 - CAPACITY // 4
        for t in range(DECODE):
            driver.step([blocks], [[5 + t]])
            held.append(len(blocks.pages()))
    assert blocks.exact_len == CAPACITY + DECODE and blocks.first == PROMPT - CAPACITY
    assert max(held) <= layout.pages_to_generate(PROMPT, PROMPT + DECODE)
    assert layout.pages_for(PROMPT) == -(-PROMPT // 4)  # the prompt's step holds every prompt token
    assert layout.written(layout.cached_prefix([]), PROMPT).exact_len == CAPACITY  # admission's stored form
    shape = Shape(LAYERS, HEADS_KV, HEAD_DIM, HEAD_DIM)
    assert bytes_per_token_per_layer(shape, "snapkv", OPTIONS, 4, PROMPT) * PROMPT == TOKEN_BYTES * CAPACITY
    assert backend.sums_spec() == ("snapkv", {"capacity": CAPACITY})


@pytest.mark.parametrize("mode", _attention_modes())
def test_snapkv_int8_keeps_the_capacity_as_codes_and_gives_its_stores_tokens(tiny, prompt, mode):
    """``snapkv+int8`` (groups of 4, residual 4): after the prompt each layer holds CAPACITY tokens, whole groups as
    codes and the residual window exact; its greedy tokens are those of its per-sequence stores (same selection,
    same codes), and its stored bytes are the sums'."""
    model, _ = tiny
    options = {**OPTIONS, "group_size": 4, "residual": 4}
    backend = create("snapkv+int8", _geometry(model), **options)
    with kernels.using(mode):
        driver = PagedDriver(model, backend, pages=64, block_size=4)
        tokens, _, blocks = _generate(driver, prompt, DECODE)
    expected = _store_tokens(model, backend, prompt)
    assert tokens == expected
    assert blocks.q_len + blocks.exact_len == CAPACITY + DECODE and blocks.q_len % 4 == 0 and blocks.q_len > 0
    stored = driver.layout.stored_bytes(blocks)
    live = backend.live_bytes_per_token_per_layer(PagedStore(blocks, driver.layout))
    assert stored == live * (CAPACITY + DECODE) * LAYERS
    assert stored < 0.7 * TOKEN_BYTES * LAYERS * (CAPACITY + DECODE)  # codes (and scales of groups of 4)
    prefilled = driver.new_blocks()
    with kernels.using(mode):
        driver.step([prefilled], [prompt])
    assert driver.layout.stored_bytes(prefilled) == backend.bytes_per_token_per_layer(PROMPT) * PROMPT * LAYERS


def test_the_per_sequence_stores_give_the_pool_s_tokens(tiny, prompt):
    model, _ = tiny
    backend = create("snapkv", _geometry(model), **OPTIONS)
    with kernels.using("torch"):
        tokens = _generate(PagedDriver(model, backend, pages=64, block_size=4), prompt, DECODE)[0]
    expected = _store_tokens(model, backend, prompt)
    assert tokens == expected


def test_snapkv_int8_serves_through_the_engine(ref_model):
    """The engine (one-step prefill, compaction at commit, decode) serves ``snapkv+int8`` on the reference model: a
    long prompt holds its capacity, a short one gives ``full``'s greedy tokens."""
    model, tokenizer = ref_model
    long_prompt = " ".join(["In the beginning God created the heaven and the earth."] * 20)
    short_prompt = "And God said, Let there be light"
    out = {}
    for name in ("full", "snapkv+int8"):
        engine = make_engine(model, tokenizer, name, capacity=64, window=8, group_size=16, residual=16) \
            if name != "full" else make_engine(model, tokenizer, name)
        seqs = [make_seq(tokenizer, long_prompt, 8, backend=name), make_seq(tokenizer, short_prompt, 8, backend=name)]
        run_all(engine, seqs)
        assert all(len(s.output_ids) == 8 for s in seqs)
        out[name] = seqs
    assert len(tokenizer.encode(long_prompt)) > 64 > len(tokenizer.encode(short_prompt))
    assert out["snapkv+int8"][1].output_ids == out["full"][1].output_ids
    assert out["snapkv+int8"][0].peak_kv_stored_bytes < out["full"][0].peak_kv_stored_bytes / 4


@pytest.mark.parametrize("spec,says", [
    ("snapkv:capacity=1", "capacity must be >= 2"),
    ("snapkv:window=0", "window must be >= 1"),
    ("snapkv:kernel=abc", "kernel must be an integer"),
    ("snapkv:pooling=sum", "pooling"),
    ("snapkv:capacity=32,window=32", r"window=32 must be below capacity=32"),
    ("snapkv:kernel=4", r"kernel=4 must be odd"),
    ("snapkv:capacity=16,window=8,kernel=9", r"^snapkv: kernel=9 must be at most capacity - window = 16 - 8 = 8 "
     r"\(KV_SNAPKV_KERNEL <= KV_SNAPKV_CAPACITY - KV_SNAPKV_WINDOW: the pooling would spread each vote over more "
     r"tokens than it selects\)$"),
    ("snapkv+int8:capacity=64,kernel=1001", r"kernel=1001 must be at most capacity - window = 64 - 32 = 32"),
    ("snapkv:sinks=4", "snapkv takes no option sinks"),
    ("snapkv+gqa", "gqa's shared heads"),
    ("snapkv+window", "window drops tokens by position"),
    ("snapkv+dca", "dca lets a layer read another layer's cache"),
])
def test_bad_options_and_compositions_are_refused_naming_them(spec, says):
    from cache_backends.spec import check_options, parse_spec

    with pytest.raises(ValueError, match=says):
        name, options = parse_spec(spec)
        check_options(name, options)


def test_bad_values_are_refused_at_construction(tiny):
    geometry = _geometry(tiny[0])
    with pytest.raises(ValueError, match="snapkv: capacity must be an integer >= 2"):
        create("snapkv", geometry, capacity=1)
    with pytest.raises(ValueError, match="snapkv: window must be an integer >= 1"):
        create("snapkv", geometry, window=True)
    with pytest.raises(ValueError, match="snapkv: pooling must be one of avg, max"):
        create("snapkv", geometry, pooling="sum")
    with pytest.raises(ValueError, match=r"window=64 must be below capacity=64 \(KV_SNAPKV_WINDOW"):
        create("snapkv+int8", geometry, capacity=64, window=64)
    with pytest.raises(ValueError, match=r"kernel=6 must be odd"):
        create("snapkv", geometry, kernel=6)
    with pytest.raises(ValueError, match=r"kernel=9 must be at most capacity - window = 16 - 8 = 8"):
        create("snapkv", geometry, capacity=16, window=8, kernel=9)
    assert create("snapkv", geometry, capacity=17, window=8, kernel=9).params()["kernel"] == 9  # the bound itself


def test_a_kernel_wider_than_the_selection_stops_start_up_before_the_load():
    """``KV_SNAPKV_KERNEL`` over ``KV_SNAPKV_CAPACITY - KV_SNAPKV_WINDOW`` was served: each vote pooled over more
    tokens than the layer keeps. The start-up check (config only, no weights) refuses it naming the three values."""
    from server.backend_check import check_backend
    from server.config import ConfigError, load_settings

    settings = load_settings(model_id=str(MODEL_DIR), kv_backend="snapkv", kv_backends="", kv_snapkv_capacity=64,
                             kv_snapkv_window=8, kv_snapkv_kernel=57)
    with pytest.raises(ConfigError, match=r"^snapkv: kernel=57 must be at most capacity - window = 64 - 8 = 56 "):
        check_backend(settings)
    check_backend(load_settings(model_id=str(MODEL_DIR), kv_backend="snapkv", kv_backends="", kv_snapkv_capacity=64,
                                kv_snapkv_window=8, kv_snapkv_kernel=55))


def test_settings_carry_the_options():
    from server.config import Settings

    settings = Settings(kv_backend="snapkv+int8", kv_snapkv_capacity=256, kv_snapkv_window=16)
    assert settings.backend_options("snapkv+int8") == {"capacity": 256, "window": 16, "kernel": 7, "pooling": "avg",
                                                       "group_size": 32, "residual": 32, "key_bits": 8,
                                                       "value_bits": 8, "rotate": False}


def test_kvserve_estimate_prices_the_capacity():
    """``kvserve estimate`` rows: ``min(T, capacity)`` tokens a layer (codes under snapkv+int8)."""
    from cache_backends.estimate import Shape, default_specs, estimate_rows

    shape = Shape(32, 8, 128, 128)
    rows = estimate_rows(shape, [("full", {}), ("snapkv", {}), ("snapkv+int8", {})], [512, 8192], [1], 2)
    per = {(r["backend"], r["seq_len"]): r["bytes_per_token_per_layer"] for r in rows}
    assert per[("snapkv", 512)] == per[("full", 512)]  # the capacity covers every token
    assert per[("snapkv", 8192)] == pytest.approx(per[("full", 8192)] * 1024 / 8192)
    assert per[("snapkv+int8", 8192)] < per[("snapkv", 8192)] / 1.8
    assert "snapkv" in default_specs()


def test_the_quality_budget_is_warned_of_a_capacity_it_never_exceeds(tiny):
    from server.quality_price import PRICE_WINDOW

    geometry = _geometry(tiny[0])
    says = create("snapkv", geometry).window_warning(PRICE_WINDOW)
    assert says and "capacity of 1024" in says
    assert create("snapkv", geometry, capacity=256).window_warning(PRICE_WINDOW) is None
    assert create("snapkv", geometry, capacity=256).drops_tokens(257)
    assert not create("snapkv", geometry, capacity=256).drops_tokens(256)


MODEL = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"


@pytest.mark.real_model
@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="SmolLM2-135M not fetched (kvserve fetch-model)")
def test_smollm2_pool_tokens_are_its_stores_tokens_on_both_paths():
    """SmolLM2-135M (9 query heads on 3 K/V heads, 30 layers), a 300-token prompt under ``snapkv:capacity=128,
    window=16``: the pool's greedy tokens, on the torch path and on the kernel, are the per-sequence stores'."""
    from transformers import AutoModelForCausalLM

    model, _ = with_eager_twin(AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval(), sharpen=False)
    torch.manual_seed(4)
    ids = torch.randint(100, 20000, (300,)).tolist()
    backend = create("snapkv", ModelGeometry.from_config(model.config, torch.float32), capacity=128, window=16)
    expected = _store_tokens(model, backend, ids, model.config.num_hidden_layers)
    for mode in _attention_modes():
        with kernels.using(mode):
            driver = PagedDriver(model, backend, pages=64, block_size=16)
            tokens, _, blocks = _generate(driver, ids, DECODE)
        assert tokens == expected, mode
        assert (blocks.first, blocks.exact_len) == (300 - 128, 128 + DECODE)


def test_a_preempted_sequence_that_can_never_be_readmitted_ends_and_frees_the_queue(ref_model):
    """A preempted ``snapkv`` sequence recomputes its prompt and generated tokens in one prefill step, which holds
    every one of them; once they outgrow the pool it could never start again, and the queue behind it waited for
    ever with nothing running (the pool of 31 pages below; 331-token prompts compacted to 64 tokens and decoding
    to 731). Such a sequence now ends with an error naming the pool, and the others finish."""
    model, tokenizer = ref_model
    prompt = " ".join(["In the beginning God created the heaven and the earth."] * 30)
    engine = make_engine(model, tokenizer, "snapkv", budget=8 * 1024 * 1024, capacity=64, window=8)
    events: dict[int, list] = {}
    seqs = []
    for i in range(3):
        seq = make_seq(tokenizer, f"{i} {prompt}", 400, backend="snapkv", events=events.setdefault(i, []))
        seqs.append(seq)
    late = make_seq(tokenizer, "Hi", 3, backend="snapkv", events=events.setdefault(3, []))
    assert engine.kv.blocks.usable_pages * 16 < 508  # a recompute of 508 tokens needs more pages than the pool has
    run_all(engine, seqs + [late], max_steps=3000)
    ended = {s.request_id: s.finish_reason for s in seqs + [late]}
    assert late.finish_reason == FinishReason.LENGTH and len(late.output_ids) == 3, ended
    errors = [ev[-1].error for ev in events.values() if ev and ev[-1].finish_reason == FinishReason.ERROR]
    assert errors and all("KV blocks" in e and "after a preemption" in e for e in errors), errors
    assert engine.kv.blocks.num_free == engine.kv.blocks.usable_pages  # every page back


@pytest.mark.parametrize("spec,options,expected", [("snapkv", {"capacity": 64, "window": 8}, 1024.0),
                                                   ("snapkv+int4", {"capacity": 64, "window": 8}, 592.0),
                                                   ("window", {"sinks": 4, "window": 64}, 1072.0)])
def test_kvserve_bench_measures_what_the_pool_holds_of_a_backend_that_drops_tokens(ref_model, spec, options,
                                                                                   expected):
    """``kvserve bench``'s bytes per token at 1024 tokens: measured on the per-sequence reference store, which keeps
    every token, they read ``full``'s 16384 (1.00x) for ``snapkv`` and ``window``; they are now the pool's, equal to
    the sums (fp32, 8 layers of 8 heads of 32: ``full`` 16384; 64 tokens kept of 1024, 68 for window's sinks)."""
    from server.bench_cmd.fidelity import measured_bytes_per_token

    model, tokenizer = ref_model
    backend = create(spec, _geometry(model), **options)
    ids = tokenizer.encode(" ".join(["In the beginning God created the heaven and the earth."] * 100))
    assert measured_bytes_per_token(model, backend, ids, 1024) == (expected, expected)
