"""The engine core's recorder (:mod:`server.engine.core`): the engine's metrics as plain numbers for the step's
output, which the HTTP side replays into Prometheus (:class:`server.metrics.Recorder`,
:mod:`server.engine.core_client`)."""

from __future__ import annotations

from server.engine import messages as m


class CoreRecorder:
    """The core's engine recorder: what :class:`server.metrics.Recorder` would be told, kept as plain numbers for
    the step's output (the HTTP side replays them into its own ``Recorder``, :mod:`server.engine.core_client`).
    A finished request's own figures travel in its :class:`~server.engine.messages.Finished`."""

    def __init__(self):
        self.counters: list[m.Counter] = []
        self.prefilled: list[tuple[str, float]] = []
        self.state: tuple | None = None  # live_rows of the latest step_state
        self.waiting: dict[str, int] = {}
        self.usage: float | None = None
        self.cached_blocks = 0

    def prefix_cache(self, seq, queried: int, hit: int) -> None:
        self.counters.append(m.Counter("prefix_cache", seq.backend_name, queried, hit))

    def count(self, seq, key: str, value: int = 1) -> None:
        self.counters.append(m.Counter(key, seq.backend_name, value))

    def preempted(self, seq) -> None:
        self.counters.append(m.Counter("preempted", seq.backend_name))

    def prefill_done(self, seq) -> None:
        self.prefilled.append((seq.request_id, seq.times.prefill_start))

    def request_done(self, seq) -> None:
        pass  # the HTTP side counts it from the Finished message

    def step_state(self, running: list, waiting: dict[str, int] | None, usage: float | None = None,
                   cached_blocks: int | None = None, *, store) -> None:
        from server.metrics import live_rows

        self.state = live_rows(running, store)
        if waiting is not None:
            self.waiting = waiting
        if usage is not None:
            self.usage = usage
        if cached_blocks is not None:
            self.cached_blocks = cached_blocks
