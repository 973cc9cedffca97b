"""The HTTP side's record of one generation: what the routes, the metrics and the engine core's client
(:mod:`server.engine.core_client`) read and write of it (no torch import).

The engine core keeps its own :class:`~server.engine.sequence.Sequence` of the same request (block tables, its
KV store, the sampler's generator); only messages pass between the two. A :class:`RequestState` belongs to the
server's event loop: the client's reader task (on that loop) appends its tokens, copies the core's per-request
figures onto it when the core's :class:`~server.engine.messages.Finished` arrives and puts each
:class:`~server.engine.sequence.TokenEvent` in its :attr:`RequestState.events` queue; the routes read it on the
same loop. :meth:`RequestState.cancel` (a plain flag) is the one call safe from another thread (a shutdown's
drain).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from server.engine.sequence import FinishReason, RequestSpec, RequestTimes, TokenEvent


class TokenRecord(Protocol):
    """What :mod:`server.engine.output_processor` reads and writes of a request, the engine's
    :class:`~server.engine.sequence.Sequence` and the HTTP side's :class:`RequestState` alike."""

    output_ids: list[int]
    times: RequestTimes


@dataclass
class RequestState(RequestSpec):
    """One generation as the HTTP side sees it; its first fields are :class:`~server.engine.sequence.RequestSpec`'s
    (``request_id``, the core's key for the request; ``prompt_ids``; ``max_new_tokens``; ``params``; ``stop``, the
    stop strings, matched here on the detokenized text; ``backend_name``).

    Attributes:
        group: the HTTP request it belongs to (``n`` > 1, ``best_of``, prompt lists); ``None``: its own.
        cache_salt: mixed into its prefix-cache block keys (vLLM's ``cache_salt``), or ``None``.
        want_prompt_logprobs: whether the core computes its prompt tokens' log-probabilities.
        output_ids: the tokens generated so far, as their events arrived.
        times: arrival, prefill start (the core's), first, last and every token's time (``time.perf_counter``
            seconds; the core's clock is the same monotonic clock on this machine).
        finish_reason: why it ended, once it has.
        cancelled: set by :meth:`cancel`; the client then sends the core an ``Abort``.
        cached_tokens: prompt tokens served from the prefix cache (from the core's ``Finished``).
        kv_stored_bytes: its KV in stored form at the core's last measurement (bytes).
        peak_kv_stored_bytes: the largest of those measurements (bytes).
        kv_stats: its backend's own figures (e.g. ``compressed_fraction``).
        prompt_logprobs: log-probability of each prompt token (``None`` for the first), when asked.
        prompt_top_logprobs: the most likely ``(token_id, logprob)`` pairs at each prompt position, when asked.
        preemptions: times the core preempted it.
        events: its :class:`~server.engine.sequence.TokenEvent` stream, the last one carrying ``finish_reason``
            (filled on the event loop by the client's reader task).
    """

    group: str | None = None
    cache_salt: str | None = None
    want_prompt_logprobs: bool = False
    output_ids: list[int] = field(default_factory=list)
    times: RequestTimes = field(default_factory=RequestTimes)
    finish_reason: FinishReason | None = None
    cancelled: bool = False
    cached_tokens: int = 0
    kv_stored_bytes: int = 0
    peak_kv_stored_bytes: int = 0
    kv_stats: dict = field(default_factory=dict)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    preemptions: int = 0
    events: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue, repr=False, compare=False)

    @property
    def total_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    def emit(self, event: TokenEvent) -> None:
        """Queue ``event`` for the request's reader (on the event loop that reads :attr:`events`)."""
        self.events.put_nowait(event)

    def cancel(self) -> None:
        """Ask for the request's end (thread-safe: a plain flag; the client's ``wake`` sends the ``Abort``)."""
        self.cancelled = True
