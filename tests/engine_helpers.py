"""Drive an Engine synchronously (no thread, no HTTP) for value tests."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cache_backends.geometry import ModelGeometry
from cache_backends.calibration import calibration_ids
from cache_backends.page_plan import SeqBlocks
from cache_backends.pool import KVPool
from cache_backends.registry import create
from server.engine.block_manager import BlockManager
from server.engine.runner import ModelRunner
from server.engine.engine import Engine
from server.engine.sampling import SamplingParams
from server.engine.sequence import Sequence, TokenEvent
from server.engine.setup import build_engine
from tests.conftest import fits


def make_engine(model, tokenizer, backend: str = "full", max_batch_size: int = 8, budget=None,
                prefill_chunk_tokens: int | None = 256, block_size: int = 16, prefix_caching: bool = True,
                prepared=None, **options):
    """An engine serving ``backend`` built with ``options`` and prepared on a short calibration slice, or the
    ``prepared`` backend object itself (a test that already prepared it for its reference)."""
    if prepared is not None:
        be = prepared
    else:
        geometry = ModelGeometry.from_config(model.config, next(model.parameters()).dtype)
        be = create(backend, geometry, **options)
        # tests: a short calibration slice; fitted once a run (tests.conftest.fits)
        be.prepare(model, calibration_ids(model, tokenizer, max_tokens=4096), fits(model))
    eos = model.generation_config.eos_token_id
    return build_engine(model, tokenizer, {backend: be}, set(eos if isinstance(eos, list) else [eos]),
                        max_batch_size=max_batch_size, budget_bytes=budget,
                        max_total_tokens=model.config.max_position_embeddings, block_size=block_size,
                        prefill_chunk_tokens=prefill_chunk_tokens, max_concurrent_requests=1000,
                        prefix_caching=prefix_caching)


_LISTENERS: dict[int, Callable[[TokenEvent], None]] = {}  # seq_id -> the test's callback for its events


def on_events(seq: Sequence, fn: Callable[[TokenEvent], None]) -> Sequence:
    """Hand each event of ``seq`` that :func:`run_step` takes from the engine to ``fn`` (the engine's sequences have
    no callback: :meth:`Engine.step` returns the events); returns ``seq``."""
    _LISTENERS[seq.seq_id] = fn
    return seq


def make_seq(tokenizer, prompt: str, max_new_tokens: int, backend: str = "full", params: SamplingParams = None,
             stop=(), events=None) -> Sequence:
    """An engine sequence of ``prompt``; its events go to the list ``events``, when given (:func:`run_step`)."""
    seq = Sequence(request_id=prompt, prompt_ids=tokenizer.encode(prompt), max_new_tokens=max_new_tokens,
                   params=params or SamplingParams(), stop=list(stop), backend_name=backend)
    return on_events(seq, events.append) if events is not None else seq


def run_step(engine: Engine) -> None:
    """One engine step, each of its events handed to its sequence's listener (:func:`on_events`)."""
    for seq, event in engine.step():
        if (fn := _LISTENERS.get(seq.seq_id)) is not None:
            fn(event)


def run_all(engine: Engine, seqs: list[Sequence], max_steps: int = 10_000) -> None:
    for s in seqs:
        engine.submit(s)
    for _ in range(max_steps):
        if not engine.running and not engine.waiting and not engine.compiling:
            return
        run_step(engine)
    raise AssertionError("engine did not finish")


def raising_once(fn, message: str = "boom"):
    """``fn`` whose first call raises ``RuntimeError(message)``; the later calls are ``fn``'s."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(message)
        return fn(*args, **kwargs)

    return wrapper


def first_compression(engine: Engine) -> list[int]:
    """A list filled with the sequences of the first step of ``engine`` that compresses (spying its runner)."""
    seen, execute = [], engine.runner.execute

    def spy(out, *args):
        if out.compress and not seen:
            seen.extend(i for c in out.compress for i in c.seq_ids)
        return execute(out, *args)

    engine.runner.execute = spy
    return seen


def serve_counting_pages(engine: Engine, prompt_ids: list[int], max_new_tokens: int,
                         backend: str = "full") -> tuple[Sequence, int]:
    """``prompt_ids`` served alone, greedily to ``max_new_tokens`` (end-of-text ignored): the sequence, and the pages
    its run took from the pool."""
    blocks, taken = engine.scheduler.kv.blocks, []
    allocate = blocks.allocate
    blocks.allocate = lambda n: taken.extend(allocate(n)) or taken[len(taken) - n:]
    seq = Sequence(request_id=str(prompt_ids[:4]), prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens,
                   params=SamplingParams(ignore_eos=True), stop=[], backend_name=backend)
    try:
        run_all(engine, [seq])
    finally:
        del blocks.allocate
    return seq, len(taken)


def reference_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    ids = torch.tensor([tokenizer.encode(prompt)], device=model.device)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id,
                         eos_token_id=None)
    return out[0, ids.shape[1]:].tolist()


class PagedDriver:
    """Drives :meth:`ModelRunner.run_paged` for one backend over a private pool (no engine)."""

    def __init__(self, model, backend, pages: int = 300, block_size: int = 16):
        g, dtype = backend.geometry, next(model.parameters()).dtype
        page = -(-backend.block_bytes(block_size) // 64) * 64
        self.layout = backend.page_layout(dtype, page)
        self.pool = KVPool(pages, page, {backend.name: self.layout}, next(model.parameters()).device)
        self.manager = BlockManager(pages)
        self.runner = ModelRunner(model, g.num_layers, self.pool)
        self.backend = backend

    def step(self, rows: list[SeqBlocks], ids: list[list[int]]) -> torch.Tensor:
        """Write ``ids[i]`` into row ``i`` (rows of any lengths: one forward) and return each row's last logits
        (B, vocab_size)."""
        plans, new = [], []
        for blocks, row_ids in zip(rows, ids):
            plan = self.layout.plan(blocks, len(row_ids))
            pages = self.manager.allocate(plan.pages_needed)
            self.layout.extend(blocks, plan, pages[: plan.new_exact_pages], pages[plan.new_exact_pages:])
            plans.append(plan)
            new += pages
        feedback: dict = {}
        logits = self.runner.run_paged(ids, [(self.backend, list(range(len(rows))), list(zip(rows, plans)))], new,
                                       feedback=feedback)
        for i, (blocks, plan) in enumerate(zip(rows, plans)):
            self.manager.free(self.layout.commit(blocks, plan, feedback.get(i)))
        return logits

    def new_blocks(self):
        """Empty tables of this backend's layout."""
        return self.layout.cached_prefix([])


def with_eager_twin(model, sharpen: bool = True):
    """``(model, eager)``: ``model`` with kvserve's attention installed, and a copy of it on transformers' eager
    attention (the reference). With ``sharpen``, every layer's query and key projections are first scaled by 4, so
    that random weights give attention far from uniform (a token dropped or kept moves the logits)."""
    import copy

    from cache_backends.attention import install

    if sharpen:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(4)
                layer.self_attn.k_proj.weight.mul_(4)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    install(model)
    return model, eager
