"""``dca`` in the paged pool: what its blocks hold and how its per-sequence reuse decisions change them (no torch).

A dca sequence's layers fall in two kinds, fixed when the backend is prepared:

* the *kept* layers (every layer that is not a reuse candidate, the sources among them) store every token, in
  the inner backend's form, in one group of pages that holds all of them, as ``full``/``int8`` pages do;
* each *reuse candidate* (:func:`cache_backends.dca.select_reuse_layers`) has a group of its own: pages of that
  one layer, so that what it holds depends on its own decision for this sequence only (the KV cache groups of
  vLLM's hybrid models, one group per candidate).

Per sequence and candidate (:class:`LayerState`), from the floats the runner measures (:class:`Feedback`):

* prefill writes every layer's K/V as the inner backend stores them; the runner measures each candidate's prompt
  similarity before the layer attends, and a candidate whose similarity reaches its runtime threshold becomes
  ``reuse``: its prefill reads its own tokens exact (as the reference, which attends a reuse layer's prompt with
  its own K/V), and at commit it keeps only its residual window, the newest
  :func:`cache_backends.estimate.dca_window_tokens` tokens, exact (the exact slots of the tokens the step
  quantized are still in its pages; its other pages go back at once); else it is ``kept``, as a kept layer;
* a ``reuse`` layer's decode writes its new token exact and drops its oldest ``window`` tokens once it holds
  ``2 * window`` (they are read from the source through the map again); every ``probe_interval`` decode steps the
  runner compares its true K/V of the token with the prediction, and the mean of its latest
  :data:`PROBE_WINDOW` probes below the runtime threshold for that many tokens makes it ``fallback``: from then on
  it keeps every token from its window's start (or from the token of the fall-back, without a window), quantized
  as the inner backend does, relative to its first own token.

A layer ``reuse`` or ``fallback`` attends to positions before ``own_start`` through its source's pages and to its
own tokens after (:class:`DCAPlan` ``own_from``). Bytes held: every group's pages; no candidate's pages hold a
token it does not own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cache_backends.sizes import dca_window_tokens
from cache_backends.page_plan import GroupedBlocks, GroupedPlan, Plan, SeqBlocks, TierPlan

SPANS = (1, 4, 16, 64, 256, 1024)  # token counts at which each layer's runtime threshold is calibrated
PROBE_WINDOW = 4  # a decode probe compares the mean of the last this-many probed tokens


def window_start(length: int, window: int) -> int:
    """The first position a reuse layer's residual window holds at ``length`` tokens: it holds the newest
    :func:`cache_backends.estimate.dca_window_tokens` of them (between ``window`` and ``2 * window - 1`` once
    the sequence is that long; it drops its oldest ``window`` tokens at once). ``length`` for ``window`` 0."""
    return length - dca_window_tokens(length, window)


def runtime_threshold(spans: dict[int, float] | None, cap: float, tokens: int) -> float:
    """The similarity a span of ``tokens`` tokens must reach to reuse: the lower of ``cap`` (``KV_DCA_THRESHOLD``)
    and the calibrated threshold at the longest calibrated span not above ``tokens``; +inf for a layer that is
    not a reuse candidate (``spans`` None)."""
    if spans is None:
        return float("inf")
    return min(cap, spans[max((n for n in SPANS if n <= tokens), default=SPANS[0])])


def probes_after(probes: list[float], similarity: float) -> list[float]:
    """The latest :data:`PROBE_WINDOW` probes once ``similarity`` is measured."""
    return (list(probes) + [similarity])[-PROBE_WINDOW:]


def falls_back(probes: list[float], spans: dict[int, float] | None, cap: float) -> bool:
    """Whether a reuse layer whose latest probes are ``probes`` falls back: their mean below the runtime threshold
    for that many tokens."""
    return bool(probes) and sum(probes) / len(probes) < runtime_threshold(spans, cap, len(probes))


@dataclass
class LayerState:
    """One reuse candidate of one sequence.

    Attributes:
        mode: ``kept`` (before and after a prefill that did not reuse it), ``reuse`` or ``fallback``.
        probes: similarity of its latest probed tokens (at most :data:`PROBE_WINDOW`).
        fallback_at: the position of the token whose probe made it fall back.
    """

    mode: str = "kept"
    probes: list[float] = field(default_factory=list)
    fallback_at: int | None = None


@dataclass
class DCABlocks(GroupedBlocks):
    """One dca sequence's block tables: ``groups[0]`` the kept layers' (every token), ``groups[1 + i]`` candidate
    ``i``'s (its own tokens, from position ``groups[1 + i].first`` on), and each candidate's state.

    Attributes:
        length: tokens of the sequence.
        decode_steps: decode steps since its prefill (the probe clock).
        decided: whether its prefill ran (the candidates' decisions are made).
        fallbacks: candidates that fell back.
    """

    groups: list[SeqBlocks]
    states: list[LayerState]
    length: int = 0
    decode_steps: int = 0
    decided: bool = False
    fallbacks: int = 0

    def copy(self) -> "DCABlocks":
        return DCABlocks([g.copy() for g in self.groups],
                         [LayerState(s.mode, list(s.probes), s.fallback_at) for s in self.states],
                         self.length, self.decode_steps, self.decided, self.fallbacks)

    def reuse_layers(self) -> int:
        """Candidates reusing their source now (not fallen back)."""
        return sum(s.mode == "reuse" for s in self.states)


@dataclass
class DCAPlan(GroupedPlan):
    """What writing ``n`` tokens does to a :class:`DCABlocks`, per group; decided before the step.

    Attributes:
        groups: each group's :class:`cache_backends.page_plan.Plan` (a reuse layer's drains nothing: its window
            is exact).
        exact_rows: per group, whether the step reads the group's tokens exact (a reuse layer), not by the inner
            backend's quantization rule.
        own_from: per candidate, the first position this step reads from its own pages (earlier ones through its
            source): 0 kept, its window's start after the step reusing, its first own token fallen back.
        own_from_fallback: per candidate, the same if this step's probe makes it fall back (no slide this step;
            without a window, the new token).
        probe: per candidate, whether the runner measures this step's probe (a reuse layer whose probe is due).
        prefill: the sequence's first step (the runner measures every candidate's prompt similarity).
    """

    n: int
    groups: list[Plan]
    exact_rows: list[bool]
    own_from: list[int]
    own_from_fallback: list[int]
    probe: list[bool]
    prefill: bool


@dataclass
class Feedback:
    """What the runner measured in one dca row's step (plain floats), by candidate index.

    Attributes:
        prefill: the prompt's similarity of every candidate (prefill steps).
        probe: the probed token's similarity (decode steps with a probe due).
    """

    prefill: dict[int, float] = field(default_factory=dict)
    probe: dict[int, float] = field(default_factory=dict)


class DCALayout:
    """The pages of every dca sequence: one :class:`cache_backends.page_plan.TierPlan` for the kept layers' group
    and one per candidate (each a :class:`cache_backends.page_layout.PageLayout` of its layers), and the rules above.

    Args:
        groups: ``[kept, candidate_0, ...]`` layouts (pages of the pool's size).
        kept_layers: the model's layers in the kept group, in order.
        candidates: the candidate layers, in order (candidate ``i``'s source is layer ``candidates[i] - 1``, a kept
            layer: no two candidates are adjacent).
        thresholds: per candidate, its runtime thresholds by span (:func:`runtime_threshold`).
        cap: ``KV_DCA_THRESHOLD``.
        window: the residual window (tokens).
        probe_interval: decode steps between probes.
    """

    on_demand = False
    cacheable = False  # each candidate decides on the whole prompt, not per block: no prefix caching

    def __init__(self, groups: list[TierPlan], kept_layers: list[int], candidates: list[int],
                 thresholds: list[dict[int, float]], cap: float, window: int, probe_interval: int):
        self.groups, self.kept_layers, self.candidates = groups, kept_layers, candidates
        self.thresholds, self.cap, self.window, self.probe_interval = thresholds, cap, window, probe_interval
        self.page_bytes = groups[0].page_bytes
        self.quantization = groups[0].quantization
        self.exact_tokens = groups[0].exact_tokens
        self.cache_block_tokens = groups[0].exact_tokens
        where = {layer: (0, j) for j, layer in enumerate(kept_layers)}
        where.update({layer: (1 + i, 0) for i, layer in enumerate(candidates)})
        self.where = [where[layer] for layer in range(len(where))]  # layer → (group, index in the group)

    # ---- tables ---------------------------------------------------------------------------------------
    def cached_prefix(self, pages: list[int]) -> DCABlocks:
        """Empty tables (dca is not prefix-cached: ``pages`` is always empty)."""
        if pages:
            raise ValueError("dca blocks are not prefix-cached")
        return DCABlocks([SeqBlocks() for _ in self.groups], [LayerState() for _ in self.candidates])

    def plan(self, blocks: DCABlocks, n: int) -> DCAPlan:
        """What writing ``n`` tokens into ``blocks`` needs (see the module)."""
        end = blocks.length + n
        plans, exact_rows = [self.groups[0].plan(blocks.groups[0], n)], [False]
        own_from, own_from_fallback, probe = [], [], []
        due = blocks.decided and (blocks.decode_steps + 1) % self.probe_interval == 0
        for i, state in enumerate(blocks.states):
            layout, own = self.groups[1 + i], blocks.groups[1 + i]
            if not blocks.decided:  # prefill: as the kept layers (the runner reads a reuse row's exact), decided
                plans.append(layout.plan(own, n))  # at commit
                exact_rows.append(False)
                own_from.append(0)
                own_from_fallback.append(0)
                probe.append(False)
            elif state.mode == "reuse":
                keep_from = max(own.first, window_start(end, self.window))
                plans.append(self._exact_plan(layout, own, n, keep_from - own.first))
                exact_rows.append(True)
                own_from.append(keep_from)
                own_from_fallback.append(own.first if self.window else blocks.length)
                probe.append(due)
            else:
                plans.append(layout.plan(own, n))
                exact_rows.append(False)
                own_from.append(own.first)
                own_from_fallback.append(own.first)
                probe.append(False)
        return DCAPlan(n, plans, exact_rows, own_from, own_from_fallback, probe, not blocks.decided)

    @staticmethod
    def _exact_plan(layout: TierPlan, own: SeqBlocks, n: int, drop: int) -> Plan:
        """``n`` tokens written exact (nothing quantized); ``drop``: the oldest tokens the window leaves after the
        step (``drained`` stays 0: they go nowhere, the pages that hold only them are freed)."""
        te = layout.exact_tokens
        need = math.ceil((own.start + own.exact_len + n) / te) - len(own.exact)
        return Plan(n, 0, max(0, need), 0, (own.start + drop) // te)

    @staticmethod
    def extend(blocks: DCABlocks, plan: DCAPlan, exact_pages: list[int], q_pages: list[int]) -> None:
        """Add the pages ``plan`` asked for to each group's tables, in group order."""
        e = q = 0
        for own, p in zip(blocks.groups, plan.groups):
            own.exact.extend(exact_pages[e : e + p.new_exact_pages])
            own.q.extend(q_pages[q : q + p.new_q_pages])
            e, q = e + p.new_exact_pages, q + p.new_q_pages

    def commit(self, blocks: DCABlocks, plan: DCAPlan, feedback: Feedback | None = None) -> list[int]:
        """Apply ``plan`` once the step ran, with what the runner measured (``None`` in planning: every candidate
        reuses, the least the sequence can hold); return the pages no token uses any more."""
        freed = self.groups[0].commit(blocks.groups[0], plan.groups[0])
        end = blocks.length + plan.n
        for i, state in enumerate(blocks.states):
            layout, own, p = self.groups[1 + i], blocks.groups[1 + i], plan.groups[1 + i]
            if plan.prefill:
                sim = None if feedback is None else feedback.prefill.get(i)
                reuse = feedback is None or self.reuses(i, sim, plan.n)
                state.mode = "reuse" if reuse else "kept"
                if reuse:  # its quantized pages go; its exact slots still hold every token: keep the window's
                    freed += own.q
                    own.q, own.q_len = [], 0
                    freed += self._write_exact(layout, own, p, window_start(end, self.window) - own.first)
                else:
                    freed += layout.commit(own, p)
            elif state.mode == "reuse":
                drop = plan.own_from[i] - own.first
                if feedback is not None and i in feedback.probe:
                    state.probes = probes_after(state.probes, feedback.probe[i])
                    if falls_back(state.probes, self.thresholds[i], self.cap):
                        state.mode, state.fallback_at = "fallback", blocks.length
                        blocks.fallbacks += 1
                        drop = plan.own_from_fallback[i] - own.first
                freed += self._write_exact(layout, own, p, drop)
            else:
                freed += layout.commit(own, p)
        blocks.length = end
        if plan.prefill:
            blocks.decided = True
        else:
            blocks.decode_steps += 1
        return freed

    def reuses(self, i: int, similarity: float | None, tokens: int) -> bool:
        """Whether candidate ``i`` reuses its source for a prompt of ``tokens`` tokens whose similarity is
        ``similarity`` (``None``: not measured, kept)."""
        return similarity is not None and similarity >= runtime_threshold(self.thresholds[i], self.cap, tokens)

    @staticmethod
    def _write_exact(layout: TierPlan, own: SeqBlocks, plan: Plan, drop: int) -> list[int]:
        """Commit a write of ``plan.n`` tokens as exact (a reuse layer's; at prefill the exact slots of the tokens
        its plan quantized are still there), then drop the oldest ``drop`` own tokens: the exact pages that hold
        only dropped tokens are returned."""
        te = layout.exact_tokens
        own.exact_len += plan.n - drop
        own.first += drop
        start = own.start + drop
        free = start // te
        freed = own.exact[:free]
        del own.exact[:free]
        own.start = start - free * te
        return freed

    # ---- sizes ----------------------------------------------------------------------------------------
    def written(self, start: DCABlocks, tokens: int) -> DCABlocks:
        """The tables (null pages) once ``tokens`` more tokens are prefilled after ``start``, every candidate reusing
        (the least the sequence can hold: the charge at admission)."""
        blocks = start.copy()
        if tokens > 0:
            plan = self.plan(blocks, tokens)
            self.extend(blocks, plan, [0] * plan.new_exact_pages, [0] * plan.new_q_pages)
            self.commit(blocks, plan)
        return blocks

    def pages_for(self, tokens: int, chunk: int | None = None, start=None, compress: bool = False) -> int:
        """At most the pages a sequence holds writing ``tokens`` tokens in steps of ``chunk`` (default: at once)
        with every layer kept (a sequence may reuse no layer, or fall back everywhere): each group's most, added.
        Its prompt is one step; the tokens it generates are one a step, within any ``chunk``."""
        return sum(g.pages_for(tokens, chunk) for g in self.groups)

    def pages_to_generate(self, prompt: int, total: int, chunk: int | None = None) -> int:
        """At most the pages a sequence holds writing its prompt, then one token a step until ``total``, with every
        layer kept: each group's most (:meth:`TierPlan.pages_to_generate`), added."""
        return sum(g.pages_to_generate(prompt, total, chunk) for g in self.groups)

    def prefill_pages(self, start: DCABlocks, tokens: int) -> int:
        """Pages the prefill step of ``tokens`` tokens holds (every layer's K/V, before the decisions)."""
        return len(start.pages()) + self.plan(start, tokens).pages_needed

    def stored_bytes(self, blocks: DCABlocks) -> int:
        """Bytes of the tokens every group holds in its stored form."""
        return sum(g.stored_bytes(b) for g, b in zip(self.groups, blocks.groups))

    def used_bytes(self) -> int:
        return min(g.used_bytes() for g in self.groups)

    def tier_tokens(self, blocks: DCABlocks) -> dict[str, int]:
        """Layer-tokens held per tier over every layer (a kept layer's tokens count once per layer), so that a
        reuse layer's dropped tokens show."""
        out: dict[str, int] = {}
        for g, b in zip(self.groups, blocks.groups):
            for tier, n in g.tier_tokens(b).items():
                out[tier] = out.get(tier, 0) + n * g.num_layers
        return out

    def stats(self, blocks: DCABlocks) -> dict:
        return {"dca_reuse_layers": blocks.reuse_layers(), "dca_fallbacks": blocks.fallbacks}
