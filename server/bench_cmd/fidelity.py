"""Fidelity and speed of a KV backend, measured through its own cache path.

* Held-out perplexity: the evaluation slice is cut into windows of ``window`` tokens; the first
  ``prefix`` tokens of every window are prefilled into the backend's store, then every later token is
  scored from the logits of the decode step that precedes it (teacher forcing through decode, all
  windows in one batched decode per step). Perplexity = exp(mean negative log-likelihood) over the
  scored tokens (``window - prefix`` per window).
* Greedy agreement with ``full``: greedy continuations of ``new_tokens`` tokens after each prompt;
  the fraction of positions where the backend's token equals ``full``'s.
* Bytes per token: the store's own count after ``context`` tokens, divided by ``context``.
* TPOT at a context length: median wall time of one single-sequence decode step after prefilling
  ``context - steps`` tokens, over ``steps`` steps (seconds).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from cache_backends.store_path import StorePath
from server.engine.runner import ModelRunner


def _runner(model, backend) -> StorePath:
    return StorePath(model, backend.geometry.num_layers)


@torch.inference_mode()
def cache_path_perplexity(model, backend, token_ids: list[int], window: int = 1024, prefix: int = 512,
                          max_windows: int | None = None) -> float:
    """Perplexity of the tokens after ``prefix`` in each ``window``-token window, scored through decode."""
    runner = _runner(model, backend)
    windows = [token_ids[s : s + window] for s in range(0, len(token_ids) - window + 1, window)]
    windows = windows[:max_windows] if max_windows else windows
    stores = [backend.new_store() for _ in windows]
    nll, count = 0.0, 0
    logits = torch.stack([runner.prefill(w[:prefix], s)[-1] for w, s in zip(windows, stores)])  # (n, vocab)
    for pos in range(prefix, window):
        targets = torch.tensor([w[pos] for w in windows], device=logits.device)
        nll += torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum").item()
        count += len(windows)
        if pos + 1 < window:
            logits = runner.decode([w[pos] for w in windows], stores)
    for s in stores:
        s.release()
    return math.exp(nll / count)


@torch.inference_mode()
def paged_perplexity(model, backend, token_ids: list[int], window: int = 1024, prefix: int = 512,
                     max_windows: int | None = None, compress_all: bool = False, block_size: int = 16) -> float:
    """:func:`cache_path_perplexity` through the paged pool (the path the server runs), every window one row of
    each batched step. ``compress_all``: after the prefill and after every decode step, quantize every group an
    on-demand tier may quantize (``elastic`` with the pool always at its shortest: its worst case)."""
    from cache_backends.page_plan import SeqBlocks
    from cache_backends.pool import KVPool

    g, dtype = backend.geometry, next(model.parameters()).dtype
    layout = backend.page_layout(dtype, -(-backend.block_bytes(2 * block_size) // 64) * 64)
    windows = [token_ids[s : s + window] for s in range(0, len(token_ids) - window + 1, window)]
    windows = windows[:max_windows] if max_windows else windows
    pages = len(windows) * (layout.pages_for(window, None) + 2) + 1
    pool = KVPool(pages, layout.page_bytes, {backend.name: layout}, next(model.parameters()).device)
    runner = ModelRunner(model, g.num_layers, pool)
    free = list(range(1, pages))
    rows = [SeqBlocks() for _ in windows]

    def step(ids: list[list[int]]) -> torch.Tensor:
        plans, new = [], []
        for blocks, row in zip(rows, ids):
            plan = layout.plan(blocks, len(row))
            taken = [free.pop() for _ in range(plan.pages_needed)]
            layout.extend(blocks, plan, taken[: plan.new_exact_pages], taken[plan.new_exact_pages:])
            plans.append(plan)
            new += taken
        logits = runner.run_paged(ids, [(backend, list(range(len(rows))), list(zip(rows, plans)))], new)
        for blocks, plan in zip(rows, plans):
            free.extend(layout.commit(blocks, plan))
        if compress_all and layout.on_demand:
            plans = [(b, layout.plan_compress(b, layout.compressible(b))) for b in rows]
            new = []
            for blocks, plan in plans:
                taken = [free.pop() for _ in range(plan.new_q_pages)]
                layout.extend(blocks, plan, [], taken)
                new += taken
            runner.compress([(backend, plans)], new)
            for blocks, plan in plans:
                free.extend(layout.commit(blocks, plan))
        return logits

    logits = step([w[:prefix] for w in windows])  # (windows, vocab_size)
    nll, count = 0.0, 0
    for pos in range(prefix, window):
        targets = torch.tensor([w[pos] for w in windows], device=logits.device)
        nll += torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum").item()
        count += len(windows)
        if pos + 1 < window:
            logits = step([[w[pos]] for w in windows])
    return math.exp(nll / count)


@torch.inference_mode()
def greedy_tokens(model, backend, prompts: list[list[int]], new_tokens: int, inspect=None) -> list[list[int]]:
    """Greedy continuations (token ids) of every prompt, decoded as one batch through ``backend``; ``inspect``,
    if given, is called with the stores at the end of the generation, before they are released."""
    runner = _runner(model, backend)
    stores = [backend.new_store() for _ in prompts]
    last = [int(runner.prefill(p, s)[-1].argmax()) for p, s in zip(prompts, stores)]
    outs = [[t] for t in last]
    for _ in range(new_tokens - 1):
        last = runner.decode(last, stores).argmax(-1).tolist()
        for o, t in zip(outs, last):
            o.append(t)
    if inspect is not None:
        inspect(stores)
    for s in stores:
        s.release()
    return outs


@torch.inference_mode()
def forced_agreement(model, backend, prompts: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of positions where ``backend``'s greedy token equals ``reference``'s when both read the same context
    (each prompt followed by the reference's own tokens so far: teacher forcing), so that one early difference
    does not move every later position, as it does in :func:`agreement` of free-running continuations. The
    references must be of one length."""
    runner = _runner(model, backend)
    stores = [backend.new_store() for _ in prompts]
    logits = torch.stack([runner.prefill(p, s)[-1] for p, s in zip(prompts, stores)])  # (prompts, vocab_size)
    same = 0
    for j in range(len(reference[0])):
        same += sum(int(t) == r[j] for t, r in zip(logits.argmax(-1).tolist(), reference))
        if j + 1 < len(reference[0]):
            logits = runner.decode([r[j] for r in reference], stores)
    for s in stores:
        s.release()
    return same / sum(len(r) for r in reference)


def agreement(ours: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of positions where two sets of continuations have the same token."""
    same = sum(a == b for x, y in zip(ours, reference) for a, b in zip(x, y))
    return same / sum(len(y) for y in reference)


@torch.inference_mode()
def measured_bytes_per_token(model, backend, token_ids: list[int], context: int = 1024) -> tuple[float, float]:
    """Bytes the store holds after ``context`` tokens (prefill then one decode step), per token (all layers),
    and the sums' figure for that same store: the backend's formula at ``context``, or for dca (whose reuse
    depends on the input) the formula over this sequence's own reuse decisions.

    A backend that drops tokens at ``context`` (:meth:`cache_backends.base.KVBackend.drops_tokens`: ``window``,
    ``snapkv``) is measured in the paged pool the server serves it from, after a prompt of ``context`` tokens (the
    prompt its formula counts): its per-sequence reference store keeps every token and attends under a mask, so its
    bytes would be ``full``'s."""
    if backend.drops_tokens(context):
        seq = PagedSequence(model, backend, context)
        seq.step(token_ids[:context])
        return (seq.layout.stored_bytes(seq.blocks) / context,
                backend.bytes_per_token_per_layer(context) * backend.geometry.num_layers)
    runner = _runner(model, backend)
    store = backend.new_store()
    runner.prefill(token_ids[: context - 1], store)
    runner.decode([token_ids[context - 1]], [store])
    assert store.num_tokens() == context
    nbytes = store.nbytes()
    live = getattr(backend, "live_bytes_per_token_per_layer", None)
    formula = live(store) if live else backend.bytes_per_token_per_layer(context)
    store.release()
    return nbytes / context, formula * backend.geometry.num_layers


class PagedSequence:
    """One sequence served the way the server serves it: its backend's blocks in a private paged pool, written
    and attended through :meth:`ModelRunner.run_paged` (for speed measurements of the served path).

    Args:
        model: the loaded model.
        backend: the backend.
        tokens: the most tokens the sequence will hold.
    """

    def __init__(self, model, backend, tokens: int):
        from cache_backends.pool import KVPool
        from server.engine.block_manager import BlockManager
        from server.engine.kv_cache import page_layouts

        page, layouts = page_layouts({backend.name: backend}, next(model.parameters()).dtype, 16)
        self.layout = layouts[backend.name]
        pages = self.layout.pages_for(tokens) + 2
        self.runner = ModelRunner(model, backend.geometry.num_layers,
                                  KVPool(pages, page, layouts, next(model.parameters()).device))
        self.manager, self.blocks, self.backend = BlockManager(pages), self.layout.cached_prefix([]), backend

    @torch.inference_mode()
    def step(self, ids: list[int]) -> torch.Tensor:
        """Write ``ids`` and return the logits of the last, (vocab_size,)."""
        plan = self.layout.plan(self.blocks, len(ids))
        new = self.manager.allocate(plan.pages_needed)
        self.layout.extend(self.blocks, plan, new[: plan.new_exact_pages], new[plan.new_exact_pages :])
        feedback: dict = {}
        logits = self.runner.run_paged([ids], [(self.backend, [0], [(self.blocks, plan)])], new, feedback=feedback)
        self.manager.free(self.layout.commit(self.blocks, plan, feedback.get(0)))
        return logits[0]


@torch.inference_mode()
def tpot(model, backend, token_ids: list[int], context: int, steps: int = 32) -> float:
    """Median single-sequence decode step time (seconds) over ``steps`` steps ending at ``context`` tokens, through
    the path the server serves the backend by (the paged pool).

    The median, not the mean, so that one step delayed by the machine does not move the number.
    """
    seq = PagedSequence(model, backend, context)
    seq.step(token_ids[: context - steps])
    step = lambda t: seq.step([t])  # noqa: E731
    last = token_ids[context - steps]
    step(last)  # warm-up step
    times = []
    for _ in range(steps - 1):
        t0 = time.perf_counter()
        last = int(step(last).argmax())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
