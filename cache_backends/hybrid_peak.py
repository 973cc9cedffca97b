"""The most pages a hybrid layout's sequence holds while its prompt is prefilled in steps cut anywhere.

:class:`cache_backends.hybrid.HybridLayout` admits a sequence by the pages it can hold (``pages_to_generate``); the
scheduler cuts a prompt's steps anywhere (the decoding sequences take part of each step's budget), and a step that
starts where a window's pages are least aligned holds more than a walk of whole chunks from position 0. Plain Python
(no torch).
"""

from __future__ import annotations

import math

from cache_backends.page_plan import NULL_PAGE, cached_peak

MOST_STARTS = 4096
"""The most starts :func:`prefill_peak` walks with the groups together (tens of ms); past it, each group apart."""


def prefill_peak(layout, prompt: int, chunk: int | None = None) -> int:
    """The most pages a sequence of ``layout`` (a :class:`~cache_backends.hybrid.HybridLayout`) holds writing its
    ``prompt`` tokens in steps of at most ``chunk`` tokens cut anywhere (default: in one step), as
    :meth:`cache_backends.page_plan.TierPlan.prefill_peak` does for one group. Cached on ``layout`` per
    ``(prompt, chunk)``.

    The scheduler's steps start at any position ``p``, between steps every group's tables are those of its ``p``
    tokens whatever the chunking (:meth:`~cache_backends.hybrid.HybridLayout.written`: a window frees the pages,
    and pins the sink pages, that lie wholly before ``p - W + 1``, a quantized one whole code pages, ``first`` a
    page's start), and a
    step holds more the more tokens it writes, so the peak is the most over ``p`` of a step of
    ``min(chunk, prompt - p)`` tokens from there (the groups' pages added in the same step: the sum of each
    group's own peak is a page looser at times, the groups peaking at different ``p``).

    Only some ``p`` need a look. A step that ends at ``prompt`` (``p >= prompt - chunk``) holds less the later
    it starts (every group's pages from what ``p`` still holds to ``prompt``), so ``p = prompt - chunk``. A
    whole chunk from ``p`` holds in each group: a global group the pages of ``p + chunk`` tokens (growing with
    ``p``) and, quantized, exact pages that repeat with ``p`` modulo ``lcm(group_size, exact_tokens)`` once
    ``p >= residual``; a sliding group of window ``W`` and ``s`` sinks, once its window has passed its sinks'
    pages (``p >= W - 1 + s`` rounded up to a page of its tier; a quantized group's window starts at
    ``max(residual, W - 1)``: codes only cover tokens drained), pages that repeat with ``p`` modulo
    ``exact_tokens`` (quantized: ``lcm(group_size, exact_tokens, q_tokens)``), and before, the pages of a
    global group. Between those breaks the sum repeats with ``p`` modulo the periods' ``lcm`` but for a part
    that grows, so the last period before each break holds the most of its stretch; the first ``residual +
    group_size`` starts are all looked at (cached per prompt and chunk). Where the groups' periods make more
    than :data:`MOST_STARTS` starts (page sizes whose ``lcm`` is large), the groups' own peaks are added
    instead: each group's period is its own, and the sum is a page above the joint peak at most on the layouts
    of ``tests/test_window_backend.py``.
    """
    if not chunk or chunk >= prompt:
        return layout.pages_for(prompt)
    return cached_peak(layout, prompt, chunk, lambda: _walk(layout, prompt, chunk))


def _walk(layout, prompt: int, chunk: int) -> int:
    """:func:`prefill_peak` for ``0 < chunk < prompt``, not cached: the starts that can peak, walked in place."""
    starts = peak_starts(layout, prompt, chunk)
    if len(starts) > MOST_STARTS and len(layout.groups) > 1:
        return sum(alone.prefill_peak(prompt, chunk) for alone in _groups_alone(layout))
    most, blocks, at = 0, layout.cached_prefix([]), 0
    for p in sorted(starts):
        if p > at:  # the tables of p tokens (any chunking's), written in place
            plan = layout.plan(blocks, p - at)
            layout.extend(blocks, plan, [NULL_PAGE] * plan.new_exact_pages, [NULL_PAGE] * plan.new_q_pages)
            layout.commit(blocks, plan)
            at = p
        held = sum(len(g.exact) + len(g.q) + len(g.sink) for g in blocks.groups)
        most = max(most, held + layout.plan(blocks, min(chunk, prompt - p)).pages_needed)
    return most


def _groups_alone(layout) -> list:
    """Each group as a layout of its own (:func:`prefill_peak`)."""
    if "_alone" not in layout.__dict__:
        layout._alone = [type(layout)([g], [w], [list(range(len(layers)))], [s])
                         for g, w, layers, s in zip(layout.groups, layout.windows, layout.layers, layout.sinks)]
    return layout._alone


def peak_starts(layout, prompt: int, chunk: int) -> set[int]:
    """The starts :func:`prefill_peak` looks at for steps of ``chunk < prompt`` tokens."""
    last = prompt - chunk  # the last start of a whole chunk: later ones hold less
    head, breaks, period = 0, {last + 1}, 1
    for group, window, sinks in zip(layout.groups, layout.windows, layout.sinks):
        te, q = group.exact_tokens, group.quantization
        if q:
            head = max(head, q.residual + q.group_size)
            period = math.lcm(period, q.group_size, te)
        if window is not None:
            tier = group.q_tokens if q else te
            opens = max(q.residual, window - 1) if q else window - 1
            breaks |= {opens, opens + math.ceil((sinks or 0) / tier) * tier}
            period = math.lcm(period, te, tier)
    starts, low = set(range(min(head, last) + 1)), 0
    for end in sorted(b for b in breaks if b <= last + 1):
        starts.update(range(max(low, end - period), end))
        low = end
    return starts
