"""Several generations for one HTTP request (prompt lists, ``n``, ``best_of``): submit, collect, merge."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from server.engine.request_state import RequestState
from server.engine.sequence import TokenEvent
from server.service import ClientGone, GenerationRequest, GenerationService

Started = list[tuple[RequestState, AsyncIterator[TokenEvent]]]


async def submit_all(service: GenerationService, requests: list[GenerationRequest],
                     receive: Callable[[], Awaitable[dict]] | None = None) -> Started:
    """Submit every request; if one is refused, cancel those already submitted and re-raise.

    Args:
        receive: the HTTP request's ASGI receive channel: one watcher reads it, from before the first submit, and
            cancels every generation of the request when the client disconnects (a channel has one reader). A
            disconnect while the requests are being submitted cancels those submitted and submits no more.

    Returns:
        ``(state, events)`` per request, in order (see :meth:`GenerationService.run`).

    Raises:
        ClientGone: the client disconnected before every request was submitted.
    """
    started: Started = []
    seqs: list[RequestState] = []  # the watcher's list: it cancels those in it when the client leaves
    group = uuid.uuid4().hex
    watcher = asyncio.create_task(service.cancel_on_disconnect(seqs, receive)) if receive is not None else None
    try:
        for req in requests:
            req.group = group
            started.append(await service.run(req))
            seqs.append(started[-1][0])
            if watcher is not None and watcher.done():  # gone: this one was submitted after the watcher's cancel
                raise ClientGone("client closed request")
    except BaseException:
        if watcher is not None:
            watcher.cancel()
        for seq, _ in started:
            seq.cancel()
        service.engine.wake()
        raise
    if watcher is not None:
        _WATCHERS[id(started)] = watcher
    return started


_WATCHERS: dict[int, asyncio.Task] = {}  # per started list: its disconnect watcher, stopped by the readers


def _stop_watcher(started: Started) -> None:
    task = _WATCHERS.pop(id(started), None)
    if task is not None:
        task.cancel()


async def collect_all(started: Started) -> list[list[TokenEvent]]:
    """Every generation's events, in order (waits for all to finish)."""

    async def collect(events: AsyncIterator[TokenEvent]) -> list[TokenEvent]:
        return [ev async for ev in events]

    try:
        return list(await asyncio.gather(*(collect(events) for _, events in started)))
    finally:
        _stop_watcher(started)


async def merged(started: Started) -> AsyncIterator[tuple[int, TokenEvent]]:
    """``(k, event)`` as the generations produce them, ``k`` the generation's position in ``started``.

    Closing the iterator early (client gone) cancels every generation still running.
    """
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, events: AsyncIterator[TokenEvent]) -> None:
        try:
            async for ev in events:
                queue.put_nowait((k, ev))
        finally:
            queue.put_nowait((k, done))

    tasks = [asyncio.create_task(pump(k, events)) for k, (_, events) in enumerate(started)]
    try:
        remaining = len(tasks)
        while remaining:
            k, ev = await queue.get()
            if ev is done:
                remaining -= 1
                continue
            yield k, ev
    finally:
        for task in tasks:
            task.cancel()
        _stop_watcher(started)
