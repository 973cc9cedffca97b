"""torch's intra-op thread count, chosen while the engine runs by timing its own steps (``TORCH_NUM_THREADS=0``).

No fixed count is best both on a quiet CPU and beside a busy process, nor for every batch: on 2 cores two threads
made 16 streams 1.1-1.4x faster quiet and 3-4x slower beside one process busy on one core (each parallel region
then waits for the thread the busy process displaced), and one stream was no faster with two (docs/benchmarks.md,
"Threads"). So the engine measures instead of guessing: :class:`ThreadTuner` runs a few steps of each size with
each candidate count, alternately, and keeps the fastest for that size; it measures again from time to time, and
at once when a size's steps slow down.

Plain Python (no torch): the engine hands it a function that sets the count.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


def size_class(tokens: int) -> int:
    """The class of a step of ``tokens`` tokens (its decode rows and prefill chunks): 1-3, 4-15, 16-63, 64-255, ...
    tokens (a factor of 4 each) are one class each (0, 1, 2, 3, ...)."""
    return (max(1, tokens).bit_length() - 1) // 2


@dataclass
class _Size:
    """One size class's choice and its measurements.

    Attributes:
        current: the count its steps run with outside a probe.
        probe: ``choice -> step times (s)`` of the probe under way, or ``None``; ``steps``: its steps so far.
        reference: the median step time of ``current`` at the last probe (s), or ``None``.
        recent: the latest step times outside a probe.
    """

    current: int
    interval: float
    next_probe: float
    probe: dict[int, list[float]] | None = None
    started: float = 0.0
    steps: int = 0
    order: list[int] = field(default_factory=list)
    reference: float | None = None
    recent: deque = field(default_factory=deque)


class ThreadTuner:
    """Chooses torch's intra-op thread count among ``choices`` for each size of step, from the engine's own step
    times.

    Steps are told apart by their size (:func:`size_class` of their tokens). For each size, a *probe* runs its next
    steps alternately with each choice (A, B, A, B, ...: both see the same load and contexts one token apart) until
    every choice has ``probe_steps`` of them; it then keeps the choice with the lowest median step time, unless the
    current one is within ``margin`` of it (a switch must pay); it stops early when the other choices' first steps
    are each slower than the current choice's median by ``2 * margin`` (two steps) or twice as slow (one). A size is probed at its first step, then every
    ``interval`` seconds: ``min_interval`` after a switch, doubling up to ``max_interval`` while the choice holds.
    Between probes, when a size's last ``probe_steps`` steps have a median ``slowdown`` times its probe's (a
    neighbour started), its next probe comes at its next step. A size seen for the first time starts from the
    choice of the nearest size probed already (the fewest threads if none). A probe that has not completed after
    ``max_probe_steps`` steps or ``max_interval`` seconds (a size seldom seen: its steps would be compared across
    changing conditions) ends without a change.

    Args:
        choices: the candidate thread counts (e.g. ``[1, 2]`` on 2 cores); one choice: nothing to tune.
        set_threads: sets the count (``torch.set_num_threads``); called only when the count changes.
        clock: seconds, monotonic (injected by the tests).

    Attributes:
        sizes: each size class's state.
        switches: how many times a probe changed a size's choice.
        probes: probes finished.
    """

    def __init__(self, choices: list[int], set_threads: Callable[[int], None], clock: Callable[[], float] = time.monotonic,
                 probe_steps: int = 6, margin: float = 0.05, min_interval: float = 4.0, max_interval: float = 64.0,
                 slowdown: float = 1.5, max_probe_steps: int = 100):
        if not choices or min(choices) < 1:
            raise ValueError(f"thread counts must be >= 1, got {choices}")
        self.choices = sorted(set(choices))
        self._set, self._clock = set_threads, clock
        self.probe_steps, self.margin, self.slowdown = probe_steps, margin, slowdown
        self.min_interval, self.max_interval, self.max_probe_steps = min_interval, max_interval, max_probe_steps
        self.sizes: dict[int, _Size] = {}
        self.switches = self.probes = 0
        self._applied = self.choices[0]
        self._step: tuple[_Size, int] | None = None
        set_threads(self._applied)

    @property
    def tuning(self) -> bool:
        """Whether there is anything to choose."""
        return len(self.choices) > 1

    def current(self, tokens: int) -> int:
        """The count steps of ``tokens`` tokens run with outside a probe."""
        size = self.sizes.get(size_class(tokens))
        return size.current if size is not None else self._nearest(size_class(tokens))

    def before_step(self, tokens: int) -> int:
        """Set the thread count for a step of ``tokens`` tokens about to run and return it."""
        if not self.tuning:
            return self._applied
        key = size_class(tokens)
        size = self.sizes.get(key)
        if size is None:
            size = self.sizes[key] = _Size(self._nearest(key), self.min_interval, self._clock(),
                                           recent=deque(maxlen=self.probe_steps))
        if size.probe is None and self._clock() >= size.next_probe:
            size.order = [size.current] + [c for c in self.choices if c != size.current]
            size.probe, size.steps, size.started = {c: [] for c in size.order}, 0, self._clock()
        choice = size.order[size.steps % len(size.order)] if size.probe is not None else size.current
        self._apply(choice)
        self._step = (size, choice)
        return choice

    def after_step(self, seconds: float) -> None:
        """Account the step :meth:`before_step` announced: it took ``seconds`` (forward and sampling)."""
        if self._step is None:
            return
        size, choice = self._step
        self._step = None
        if size.probe is not None:
            size.probe[choice].append(seconds)
            size.steps += 1
            if all(len(t) >= self.probe_steps for t in size.probe.values()):
                self._decide(size)
            elif (size.steps >= self.max_probe_steps or self._clock() - size.started > self.max_interval
                  or self._clearly_worse(size)):
                self._end_probe(size, switched=False)
            return
        size.recent.append(seconds)
        if (size.reference is not None and len(size.recent) == size.recent.maxlen
                and statistics.median(size.recent) > self.slowdown * size.reference):
            size.next_probe = self._clock()
            size.recent.clear()

    def _clearly_worse(self, size: _Size) -> bool:
        """Every other choice's steps so far were each slower than the current choice's median: by twice the margin
        over two steps at least, or twice as slow in one: the probe can stop early (a count that is 3x slower
        beside a busy process costs every step it is tried on)."""
        mine = size.probe[size.current]
        if not mine:
            return False
        median = statistics.median(mine)
        others = [t for c, t in size.probe.items() if c != size.current]
        return all(t and (min(t) > 2 * median or (len(t) >= 2 and min(t) > (1 + 2 * self.margin) * median))
                   for t in others)

    def _decide(self, size: _Size) -> None:
        medians = {c: statistics.median(t) for c, t in size.probe.items()}
        best = min(medians, key=medians.get)
        switched = best != size.current and medians[best] < (1 - self.margin) * medians[size.current]
        if switched:
            size.current = best
            self.switches += 1
        self._end_probe(size, switched)

    def _end_probe(self, size: _Size, switched: bool) -> None:
        mine = size.probe[size.current]
        if mine:
            size.reference = statistics.median(mine)
        size.probe = None
        size.recent.clear()
        self.probes += 1
        size.interval = self.min_interval if switched else min(2 * size.interval, self.max_interval)
        size.next_probe = self._clock() + size.interval
        self._apply(size.current)

    def _nearest(self, key: int) -> int:
        """The choice of the probed size class nearest ``key`` (the smaller on a tie), else the fewest threads (the
        safe guess beside a busy process: the probe finds out whether more pay)."""
        probed = [k for k, s in self.sizes.items() if s.reference is not None]
        if not probed:
            return self.choices[0]
        return self.sizes[min(probed, key=lambda k: (abs(k - key), k))].current

    def _apply(self, n: int) -> None:
        if n != self._applied:
            self._set(n)
            self._applied = n
