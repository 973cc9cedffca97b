"""The KV cache manager: pages for sequences, on demand (no tensors).

It knows each served backend's page layout (:class:`cache_backends.page_layout.PageLayout`) and the block manager
(free list, reference counts); it plans how many pages a step's tokens need, hands them out, and takes back
those a sequence no longer uses (an int8-family window drained into quantized pages) or all of them (a
sequence that finished or was preempted). Every served backend has a page layout: every backend draws from
the one budget.

Admission charges a paged sequence what it holds once its context is written (:meth:`KVCacheManager.
stored_pages`): for an int8-family backend its quantized pages plus the exact pages of its residual window,
not the exact pages a prefill chunk passes through. A step writes every new token into exact pages first and
quantizes its whole groups from there (the chunk's later tokens read the drained ones exact:
:class:`cache_backends.step_meta.StepMeta`), so a prefill step of ``n`` tokens holds, for the length of the step,
the exact pages of ``n`` tokens and of the residual window before them on top of the quantized pages. The
engine prefills one sequence at a time (reserve, forward, commit, then the next), so at most one sequence is
ever above its stored form: the scheduler keeps free once, not per sequence, the largest
:meth:`KVCacheManager.transient_pages` of the sequences still prefilling, the bound for a step of
:data:`MIN_PREFILL_CHUNK` tokens; a step runs longer (up to ``prefill_chunk_tokens``) only where the pages are
free beyond every other sequence's charge (:meth:`KVCacheManager.step_tokens`). ``elastic``, whose tier fills
on demand, is charged as if compressed down to its window (the least it can hold).

Prefix caching (``KV_PREFIX_CACHING``, on by default): every full block a paged sequence writes is registered
under its chained hash (:mod:`server.engine.prefix_cache`); at admission a sequence takes the longest run of
cached blocks its context starts with, and prefills only the rest. An int8-family backend shares its
quantized pages (whole groups, whose codes depend on the tokens before them only,
:class:`cache_backends.step_meta.StepMeta`); its exact pages are the residual window and are never shared.
``dca``, whose reuse is decided from the whole prompt, is not cached. A hybrid model's layout keys each window
group's blocks (exact pages, or an int8-family backend's code pages) on its own chain and hits a prefix only where
its global groups hold every block and its sliding groups the blocks of their last window
(:mod:`cache_backends.hybrid`, vLLM's rule): its sliding groups' blocks the window leaves stay cached, evictable,
as a finished sequence's do.

The manager owns every sequence's block tables (:attr:`KVCacheManager.tables`, by ``seq_id``: a sequence
has an entry from :meth:`KVCacheManager.start` to :meth:`KVCacheManager.release`) and its prefix-cache keys
(:class:`server.engine.prefix_cache.PrefixIndex`); the scheduler and the runner read them
(:meth:`KVCacheManager.table`), and only the manager changes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cache_backends.base import KVBackend
from cache_backends.page_plan import NULL_PAGE, Plan, SeqBlocks
from cache_backends.page_layout import PageLayout
from server.engine.block_manager import BlockManager
from server.engine.prefix_cache import PrefixIndex
from server.engine.sequence import Sequence
from server.engine.step_plan import MIN_PREFILL_CHUNK

WATERMARK = 0.01  # share of the pool admission keeps free for running sequences' next blocks (vLLM's default)


def largest_step(chunk: int | None) -> int | None:
    """The most prompt tokens one prefill step writes for a prefill ``chunk`` (``None``: a context written in one
    step): the chunk, or :data:`MIN_PREFILL_CHUNK` if larger (the scheduler's step budget is never below it:
    :meth:`server.engine.scheduler.Scheduler._prefill_rows`)."""
    return None if chunk is None else max(chunk, MIN_PREFILL_CHUNK)


def page_layouts(backends: dict[str, KVBackend], dtype: torch.dtype, block_size: int) -> tuple[int, dict]:
    """The pool's page size and each paged backend's layout.

    The page is ``k`` blocks of ``block_size`` tokens of the costliest served backend's stored form (whole
    quantization groups for int8-family backends); every other backend fills a page with as many of its tokens
    as fit. ``k`` is the smallest of 1-4 whose pages every backend fills to 90% or more (else the fullest): a
    pool serving one backend wastes nothing, and ``full`` beside ``int8`` takes 2-block pages (``int8`` fills
    only 62% of a one-block page, 94% of a two-block page, on the reference model in fp32).

    Returns:
        ``(page_bytes, {name: layout})``.

    Raises:
        ValueError: for a backend without a paged form.
    """
    for name, backend in backends.items():
        try:
            backend.kv_spec()
        except NotImplementedError:
            raise ValueError(f"{name} has no paged form: it cannot be served") from None

    def layouts(k: int) -> tuple[int, dict]:
        page = max(b.block_bytes(k * block_size) for b in backends.values())
        page = -(-page // 64) * 64
        return page, {n: b.page_layout(dtype, page) for n, b in backends.items()}

    def filled(page: int, out: dict) -> float:
        return min(l.used_bytes() / page for l in out.values())

    options = [layouts(k) for k in (1, 2, 3, 4)]
    good = [o for o in options if filled(*o) >= 0.9]
    return good[0] if good else max(options, key=lambda o: filled(*o))


class PagedStore:
    """A paged sequence's view for the engine's measurements and metrics (the tensors are in the pool).

    Args:
        blocks: the sequence's block tables.
        layout: its backend's page layout.
    """

    def __init__(self, blocks: SeqBlocks, layout: PageLayout):
        self.blocks, self.layout = blocks, layout

    def num_tokens(self) -> int:
        return self.blocks.tokens

    def nbytes(self) -> int:
        """Bytes of the cached tokens in their stored form (what the closed formulas count)."""
        return self.layout.stored_bytes(self.blocks)

    def allocated_bytes(self) -> int:
        """Bytes of the pages the sequence holds."""
        return len(self.blocks.pages()) * self.layout.page_bytes

    def stats(self) -> dict:
        return self.layout.stats(self.blocks)


@dataclass
class Reservation:
    """Pages handed out to one sequence for one step."""

    plan: Plan
    pages: list[int]


class KVCacheManager:
    """Pages on demand for every sequence, from one pool.

    Args:
        backends: served backends by name.
        layouts: each paged backend's layout (from :func:`page_layouts`).
        page_bytes: bytes per page.
        num_pages: pages in the pool (the null page included).
        prefill_chunk_tokens: the engine's prefill chunk (tokens), for admission's transient pages.
        prefix_caching: share full blocks between sequences whose contexts start alike (see the module).
    """

    def __init__(self, backends: dict[str, KVBackend], layouts: dict[str, PageLayout], page_bytes: int,
                 num_pages: int, prefill_chunk_tokens: int | None = None, prefix_caching: bool = True):
        self.backends, self.layouts, self.page_bytes = backends, layouts, page_bytes
        self.blocks = BlockManager(num_pages)
        self.chunk = prefill_chunk_tokens
        self.prefix_caching = prefix_caching
        self.watermark = max(1, int(WATERMARK * self.blocks.usable_pages))
        # by Sequence.seq_id, not request_id: request ids may repeat in a process (an engine stepped directly by
        # tests and benchmarks), and the step's rows and results are keyed by seq_id too
        self.tables: dict[int, SeqBlocks] = {}  # each started sequence's block tables (dca: DCABlocks)
        self.prefix = PrefixIndex(backends, layouts, self.blocks)

    def table(self, seq: Sequence) -> SeqBlocks | None:
        """``seq``'s block tables (the manager's own object: read it, never change it), or ``None`` while it holds
        none (waiting, preempted, ended)."""
        return self.tables.get(seq.seq_id)

    def store(self, seq: Sequence) -> PagedStore | None:
        """A view of ``seq``'s tables for measurements (:class:`PagedStore`), or ``None`` while it holds none."""
        table = self.tables.get(seq.seq_id)
        return None if table is None else PagedStore(table, self.layouts[seq.backend_name])

    @property
    def num_pages(self) -> int:
        return self.blocks.num_pages

    def chunked_prefill(self, seq: Sequence) -> bool:
        """Whether ``seq``'s context may be written over several steps (not ``dca``, which decides on the whole
        prompt)."""
        return self.backends[seq.backend_name].chunked_prefill

    # ---- costs ----------------------------------------------------------------------------------------
    def prefill_chunk(self, seq: Sequence) -> int | None:
        """The chunk ``seq``'s context is prefilled in: the engine's, or ``None`` (whole) for a prompt that wants
        every position's log-probability (the rule of :meth:`Scheduler._prefill_rows`) or whose backend does not
        take chunks (``dca``)."""
        if (seq.want_prompt_logprobs and not seq.output_ids) or not self.chunked_prefill(seq):
            return None
        return self.chunk

    def pages_for(self, seq: Sequence, tokens: int) -> int:
        """Pages ``seq`` holds with ``tokens`` tokens cached, prefilled as the engine will prefill them (an
        on-demand tier compressing what it may after each chunk: the least it can hold; ``dca``: every layer
        kept, the most it can hold)."""
        layout = self.layouts[seq.backend_name]
        return layout.pages_for(tokens, self.prefill_chunk(seq), compress=layout.on_demand)

    def largest_step(self, seq: Sequence) -> int | None:
        """The most prompt tokens one prefill step of ``seq`` may write: :func:`largest_step` of its chunk."""
        return largest_step(self.prefill_chunk(seq))

    def pages_to_finish(self, seq: Sequence) -> int:
        """The most pages ``seq`` holds on its own from admission to its last token: its prompt as it is prefilled,
        in steps of at most :meth:`largest_step` tokens cut anywhere (the budget a step shares with the decoding
        sequences and the other prefills, and :meth:`step_tokens`, cut them short), and every token once generated
        (an on-demand tier compressed as it grows)."""
        total = len(seq.prompt_ids) + seq.max_new_tokens
        return self.layouts[seq.backend_name].pages_to_generate(len(seq.prompt_ids), total, self.largest_step(seq))

    def fits_alone(self, seq: Sequence) -> bool:
        """Whether ``seq`` could finish with the pool to itself (:meth:`pages_to_finish`)."""
        return self.pages_to_finish(seq) <= self.blocks.usable_pages

    def _prefill_start(self, seq: Sequence) -> SeqBlocks:
        """The tables ``seq``'s remaining prefill starts from: its own once started, else its prefix-cache hit
        (``seq.prefix_hit``, from :meth:`admission_cost`) or none."""
        table = self.tables.get(seq.seq_id)
        if table is not None:
            return table
        return self.layouts[seq.backend_name].cached_prefix(getattr(seq, "prefix_hit", None) or [])

    def _stored(self, seq: Sequence) -> SeqBlocks:
        """The tables (null pages) ``seq`` has once its whole context is written: :meth:`stored_pages`."""
        start = self._prefill_start(seq)
        return self.layouts[seq.backend_name].written(start, len(seq.context_ids) - start.tokens)

    def stored_pages(self, seq: Sequence) -> int:
        """Pages paged ``seq`` holds once its whole context is written, its prefix-cache hit's pages included: for
        an int8-family backend ``ceil(q / q_tokens)`` quantized pages (``q``: its whole groups of ``group_size``
        that leave at least ``residual`` tokens exact) plus the exact pages of the rest (the residual window); an
        on-demand tier (``elastic``) compressed down to its window (the least it can hold); ``full`` the exact
        pages of every token. Independent of how the context is chunked (a group is drained as soon as
        ``residual`` newer tokens exist, and exact pages are aligned to positions); ``dca``: every candidate layer
        reusing, down to its window (the least it can hold; its prefill step holds every layer's K/V:
        :meth:`transient_pages`)."""
        return len(self._stored(seq).pages())

    def min_step(self, seq: Sequence) -> int | None:
        """The fewest tokens a chunked prefill step of ``seq`` writes while that many are left (``None``: its
        context is written in one step): :data:`MIN_PREFILL_CHUNK`, or the engine's chunk if smaller."""
        chunk = self.prefill_chunk(seq)
        return None if chunk is None else min(chunk, MIN_PREFILL_CHUNK)

    def step_tokens(self, seq: Sequence, n: int, running: list[Sequence]) -> int:
        """The tokens running ``seq``'s next chunked prefill step writes, at most ``n``: ``n`` if its pages are free
        beyond what the other running sequences still need for their stored form (:meth:`pending`) and the
        watermark, else the most that are, but never fewer than :meth:`min_step` (whose pages admission keeps
        free: :meth:`transient_pages`). A shorter step writes the same tokens over more steps: the stored form
        and every token's K/V are those of any chunking (:class:`cache_backends.step_meta.StepMeta`)."""
        if n <= 1:
            return n
        others = [s for s in running if s is not seq]
        room = self.blocks.num_free - sum(self.pending(s) for s in others) - (self.watermark if others else 0)
        lo = min(n, self.min_step(seq) or n)
        if self.pages_needed(seq, n) <= room or self.pages_needed(seq, lo) > room:
            return n if self.pages_needed(seq, n) <= room else lo
        hi = n  # pages_needed grows with the tokens: the most in (lo, n) that fit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.pages_needed(seq, mid) <= room else (lo, mid)
        return lo

    def transient_pages(self, seq: Sequence) -> int:
        """A bound on the pages ``seq``'s remaining prefill holds above :meth:`stored_pages` during one step of
        :meth:`min_step` tokens (the engine takes a longer one only where its pages are free beyond every charge:
        :meth:`step_tokens`; the steps are cut anywhere, as the step budget is shared with the decoding sequences
        and the prefills before it): a step writes its ``n`` tokens into exact pages before it
        quantizes their whole groups (:class:`cache_backends.step_meta.StepMeta` reads the drained tokens exact), so
        it holds at most the final quantized pages ``Q`` plus ``ceil((exact_tokens - 1 + W + n) / exact_tokens)``
        exact pages (``W``: the most exact tokens held between steps, ``residual + group_size - 1``, or an
        on-demand tier's ``window + group_size - 1``), never more than the exact pages of every token left, and
        its first step exactly what its plan says; at most the pool's usable pages. The bound less the stored
        form; 0 once prefilled and for a layout without a quantized tier (it stores every token it writes). A hybrid
        model's layout bounds its own (:meth:`cache_backends.hybrid.HybridLayout.transient_pages`): its sliding layers
        hold a step's tokens (and a quantized tier their codes) before they keep only their window. A prompt written in one step (one that wants
        every position's log-probability; ``dca``'s) holds what that step's plan says, less what it keeps."""
        if seq.prefilled >= len(seq.context_ids):
            return 0
        layout, start = self.layouts[seq.backend_name], self._prefill_start(seq)
        left = len(seq.context_ids) - start.tokens
        chunk = min(self.min_step(seq) or left, left)
        first = layout.prefill_pages(start, chunk)
        stored, te = self._stored(seq), layout.exact_tokens
        if self.min_step(seq) is None:  # one step: what it holds while it runs, less what it keeps
            return max(0, first - len(stored.pages()))
        if hasattr(layout, "transient_pages"):  # a hybrid model's groups: a step's tokens, then the window
            return min(layout.transient_pages(stored, chunk), self.blocks.usable_pages)
        q = layout.quantization
        if not q:
            return 0
        window = (q.window if q.on_demand else q.residual) + q.group_size - 1
        exact = min(math.ceil((te - 1 + window + chunk) / te), math.ceil((start.start + start.exact_len + left) / te))
        # at most the pool: a sequence that fits alone (:meth:`fits_alone`) is admitted to an empty pool
        peak = min(max(first, len(stored.q) + exact), self.blocks.usable_pages)
        return max(0, peak - len(stored.pages()))

    def admission_cost(self, seq: Sequence) -> int:
        """Pages charged to admit ``seq``: what it holds once the tokens it prefills (its prompt, or on
        readmission after a preemption its prompt and the tokens it had generated) are written
        (:meth:`stored_pages`), less the cached blocks it starts with (:meth:`lookup`, kept on ``seq.prefix_hit``
        for :meth:`start`) unless no sequence holds them now: the stored tables' new pages, and the hit's pages no
        sequence holds (a hybrid hit's sliding blocks that its window leaves on the way count, though freed again,
        and are not in the stored tables). A prefill
        step's transient exact pages are not in it (:meth:`transient_pages`: the scheduler keeps the largest
        free once)."""
        seq.prefix_hit = self.lookup(seq)
        if not seq.prefix_hit:
            return self.stored_pages(seq)
        # the stored tables' new pages (null here; a hybrid hit's sliding blocks the window passes are not in them)
        new = sum(1 for p in self._stored(seq).pages() if p == NULL_PAGE)
        return new + self.blocks.evictable_among(seq.prefix_hit)

    def pending(self, seq: Sequence) -> int:
        """Pages a running sequence still needs to hold its whole context in stored form (:meth:`stored_pages`
        less what it holds; 0 once decoding); its next steps' transient pages are :meth:`transient_pages`."""
        if seq.prefilled >= len(seq.context_ids):
            return 0
        return max(0, self.stored_pages(seq) - self.held(seq))

    # ---- prefix cache ---------------------------------------------------------------------------------
    def caches_backend(self, name: str) -> bool:
        """Whether backend ``name``'s blocks can go through the prefix cache at all (caching on, a paged backend
        whose stored form depends on the tokens alone)."""
        layout = self.layouts.get(name)
        return self.prefix_caching and layout is not None and layout.cacheable

    def cacheable(self, seq: Sequence) -> bool:
        """Whether ``seq``'s blocks go through the prefix cache: a paged backend whose stored form depends on the
        tokens alone (not ``elastic``, quantized when the pool ran short), caching on, and not a prompt that
        wants every position's log-probability (those come from its own prefill of the whole prompt)."""
        return self.caches_backend(seq.backend_name) and not (seq.want_prompt_logprobs and not seq.output_ids)

    def lookup(self, seq: Sequence) -> list[int]:
        """The cached pages of the longest run of full blocks ``seq``'s context starts with, leaving at least its
        last token to prefill (its logits give the next token); ``[]`` when it is not :meth:`cacheable`. A hybrid
        model's: every group's blocks of the longest prefix its rule hits, null where a window needs none
        (:meth:`cache_backends.hybrid.HybridLayout.cache_hit`)."""
        return self.prefix.lookup(seq) if self.cacheable(seq) else []

    def held(self, seq: Sequence) -> int:
        """Pages ``seq`` holds now."""
        table = self.tables.get(seq.seq_id)
        return len(table.pages()) if table is not None else 0

    def held_bytes(self, seq: Sequence) -> int:
        """Bytes of the pages ``seq`` holds, a page shared through the prefix cache split between its holders (so
        the sequences' figures add up to :meth:`used_bytes`)."""
        table = self.tables.get(seq.seq_id)
        if table is None:
            return 0
        ref = self.blocks.ref
        return round(self.page_bytes * sum(1 / ref[p] for p in table.pages()))

    # ---- life of a sequence ---------------------------------------------------------------------------
    def start(self, seq: Sequence) -> int:
        """Give an admitted sequence its block tables (its entry in :attr:`tables`) — the cached blocks
        :meth:`admission_cost` found, if any, its context then counting as prefilled up to them.

        Returns:
            the context tokens served from the prefix cache.
        """
        layout = self.layouts[seq.backend_name]
        hit = getattr(seq, "prefix_hit", None) or []
        self.blocks.acquire([p for p in hit if p != NULL_PAGE])
        table = self.tables[seq.seq_id] = layout.cached_prefix(hit)
        self.prefix.started(seq, len(hit))
        seq.prefilled = table.tokens
        seq.prefix_hit = []
        return table.tokens

    def reserve(self, seq: Sequence, n: int) -> Reservation | None:
        """Pages for writing ``n`` more tokens of ``seq`` (added to its tables now), or ``None`` if too few are
        free (nothing is taken then)."""
        layout, table = self.layouts[seq.backend_name], self.tables[seq.seq_id]
        plan = layout.plan(table, n)
        if plan.pages_needed > self.blocks.num_free:
            return None
        exact = self.blocks.allocate(plan.new_exact_pages)
        q = self.blocks.allocate(plan.new_q_pages)
        layout.extend(table, plan, exact, q)
        return Reservation(plan, exact + q)

    def commit(self, seq: Sequence, plan: Plan, feedback=None) -> None:
        """The step ran: update ``seq``'s lengths and free the exact pages it drained, and register its full blocks
        in the prefix cache (a prompt that wanted every position's log-probability too: it hit nothing, but its
        blocks serve later requests, even when it ends after one token, as ``echo`` with ``max_tokens: 0``).
        ``feedback``: what the runner measured for the row (``dca``'s similarities: its decisions)."""
        layout, table = self.layouts[seq.backend_name], self.tables[seq.seq_id]
        caching, hybrid = self.caches_backend(seq.backend_name), hasattr(layout, "full_blocks")
        if caching and hybrid:
            self.prefix.register_hybrid(seq, table, plan)  # before the commit frees the pages a window leaves
        self.blocks.free(layout.commit(table, plan, feedback))
        if caching and not hybrid:
            self.prefix.register(seq, table)

    # ---- compression under pressure (elastic) --------------------------------------------------------
    def plan_compression(self, running: list[Sequence], need: int) -> list[tuple[Sequence, Reservation]]:
        """Which on-demand-tier sequences quantize which oldest groups so that ``need`` more pages are free:
        the sequence with the most compressible tokens first, as few groups as do. A plan's quantized pages are
        exact pages its own drained tokens leave (so compressing needs no free page), already moved to its
        quantized tier; the caller runs the re-encoding (:meth:`ModelRunner.compress`) and then commits each plan
        (:meth:`commit`), which frees the rest. ``[]`` when nothing can be compressed; fewer pages than ``need``
        when that is all there is.
        """
        out, gained = [], 0
        candidates = [s for s in running if self.layouts[s.backend_name].on_demand]
        tables = self.tables
        for seq in sorted(candidates, key=lambda s: -self.layouts[s.backend_name].compressible(tables[s.seq_id])):
            if self.blocks.num_free + gained >= need:
                break
            layout, table = self.layouts[seq.backend_name], tables[seq.seq_id]
            g, most = layout.quantization.group_size, layout.compressible(table)
            plan = None
            for tokens in range(g, most + 1, g):  # the fewest groups that free what is missing
                plan = layout.plan_compress(table, tokens)
                if plan.free_front - plan.new_q_pages >= need - self.blocks.num_free - gained:
                    break
            if plan is None or plan.free_front - plan.new_q_pages <= 0:
                continue
            reused = table.exact[: plan.new_q_pages]  # whole pages of drained tokens: free once read
            layout.extend(table, plan, [], reused)
            gained += plan.free_front - plan.new_q_pages
            out.append((seq, Reservation(plan, reused)))
        return out

    def commit_compression(self, seq: Sequence, res: Reservation) -> None:
        """A compression ran: update ``seq``'s lengths and free the exact pages it left, but those it reused for
        its codes."""
        freed = self.layouts[seq.backend_name].commit(self.tables[seq.seq_id], res.plan)
        self.blocks.free([p for p in freed if p not in res.pages])

    def pages_needed(self, seq: Sequence, n: int) -> int:
        """Pages writing ``n`` more tokens of ``seq`` takes."""
        return self.layouts[seq.backend_name].plan(self.tables[seq.seq_id], n).pages_needed

    def compressible_pages(self, running: list[Sequence]) -> int:
        """Pages compressing every compressible group of the running on-demand-tier sequences would free."""
        total = 0
        for seq in running:
            layout = self.layouts.get(seq.backend_name)
            table = self.tables.get(seq.seq_id)
            if layout is not None and layout.on_demand and table is not None:
                plan = layout.plan_compress(table, layout.compressible(table))
                total += max(0, plan.free_front - plan.new_q_pages)
        return total

    def tier_tokens(self, seq: Sequence) -> dict[str, int]:
        """Tokens ``seq`` holds per tier (``exact``, and for quantized layouts ``int8``, ``int4`` or ``k8v4``)."""
        table = self.tables.get(seq.seq_id)
        if table is None:
            return {"exact": 0}
        return self.layouts[seq.backend_name].tier_tokens(table)

    def release(self, seq: Sequence) -> None:
        """Return every page ``seq`` holds (finished, cancelled or preempted); its cached blocks stay in the
        prefix cache, the deepest first in line for eviction. Its tables' entry goes; its prefix-cache keys stay
        (a preempted sequence's tokens are the same when readmitted) until :meth:`forget`."""
        table = self.tables.pop(seq.seq_id, None)
        if table is not None:
            layout = self.layouts[seq.backend_name]
            if hasattr(layout, "release_order"):  # a hybrid model's groups
                self.blocks.free(layout.release_order(table))
            elif layout.cacheable:
                self.blocks.free(table.exact[::-1] + table.q[::-1])
            else:
                self.blocks.free(table.pages())

    def forget(self, seq: Sequence) -> None:
        """``seq`` ended (finished, cancelled or failed): :meth:`release` its pages and drop its prefix-cache keys;
        the manager then keeps nothing of it."""
        self.release(seq)
        self.prefix.forget(seq)

    # ---- figures --------------------------------------------------------------------------------------
    def usage(self) -> float:
        """Pages in use / usable pages, 0-1 (vLLM's ``kv_cache_usage_perc``)."""
        return self.blocks.usage()

    def used_bytes(self) -> int:
        """Bytes of the pages in use."""
        return self.blocks.num_used * self.page_bytes

    def info(self) -> dict:
        """The pool's shape for ``/info`` and the metrics (``block_size_tokens``: tokens of one block of each
        paged backend, the unit the prefix cache shares; ``pool_bytes``: every page, the ``null_pages`` that pad block
        tables and hold no tokens included: ``(num_blocks + null_pages) * page_bytes``)."""
        null_pages = self.num_pages - self.blocks.usable_pages
        return {"block_size_tokens": {n: l.cache_block_tokens for n, l in self.layouts.items()},
                "page_bytes": self.page_bytes, "num_blocks": self.blocks.usable_pages, "null_pages": null_pages,
                "pool_bytes": self.num_pages * self.page_bytes, "prefix_caching": self.prefix_caching,
                "prefix_cached_backends": [n for n in self.backends if self.caches_backend(n)]}
