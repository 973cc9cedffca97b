"""The thread tuner (server/engine/threads.py): for each size of step it keeps the thread count whose steps are
faster, measured alternately; it measures again as time goes on, and at once when a size's steps slow down. Step
times and the clock are given, so every decision is exact."""

from __future__ import annotations

import pytest

from server.engine.threads import ThreadTuner, size_class


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Machine:
    """A fake CPU: a step of ``tokens`` tokens on ``threads`` threads takes ``cost(tokens, threads)`` seconds (or
    ``cost[threads]`` whatever the size); records every count set."""

    def __init__(self, cost):
        self.cost = cost
        self.threads = None
        self.sets: list[int] = []

    def set(self, n: int) -> None:
        self.threads = n
        self.sets.append(n)

    def seconds(self, tokens: int, n: int) -> float:
        return self.cost(tokens, n) if callable(self.cost) else self.cost[n]


def run(tuner: ThreadTuner, machine: Machine, clock: Clock, steps: int, tokens: int = 16,
        step_s: float = 0.01) -> list[int]:
    """``steps`` engine steps of ``tokens`` tokens; each advances the clock by ``step_s``; the counts they ran with."""
    used = []
    for _ in range(steps):
        n = tuner.before_step(tokens)
        assert machine.threads == n
        used.append(n)
        tuner.after_step(machine.seconds(tokens, n))
        clock.now += step_s
    return used


def tuner_on(machine: Machine, clock: Clock, choices=(1, 2), **kw) -> ThreadTuner:
    return ThreadTuner(list(choices), machine.set, clock, **kw)


def test_sizes_are_classes_of_a_power_of_four():
    assert [size_class(t) for t in (0, 1, 3, 4, 15, 16, 63, 64, 255, 256, 272)] == [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_a_quiet_machine_keeps_the_faster_count():
    clock, machine = Clock(), Machine({1: 0.020, 2: 0.012})
    t = tuner_on(machine, clock)
    used = run(t, machine, clock, 12)
    assert used == [1, 2] * 6  # the first probe alternates, from the fewest threads
    assert t.current(16) == 2 and t.switches == 1 and t.probes == 1
    assert set(run(t, machine, clock, 20)) == {2}  # until the next probe


def test_beside_a_busy_process_it_switches_to_the_count_that_is_faster_there():
    clock, machine = Clock(), Machine({1: 0.020, 2: 0.060})
    t = tuner_on(machine, clock)
    used = run(t, machine, clock, 2)
    assert used == [1, 2]  # two threads three times slower in one step: the probe stops
    assert t.current(16) == 1 and t.switches == 0 and t.probes == 1
    assert t.sizes[2].reference == 0.020  # what a slowdown is measured against
    assert machine.threads == 1
    assert set(run(t, machine, clock, 20)) == {1}


def test_a_quiet_machine_that_turns_busy_goes_back_to_fewer_threads():
    clock, machine = Clock(), Machine({1: 0.020, 2: 0.012})
    t = tuner_on(machine, clock)
    run(t, machine, clock, 12)
    assert t.current(16) == 2
    machine.cost = {1: 0.020, 2: 0.060}
    run(t, machine, clock, 6 + 12)  # six slow steps bring the probe forward, which takes 12 (the other is faster)
    assert t.current(16) == 1 and t.switches == 2


def test_each_size_of_step_gets_its_own_count():
    """One stream is faster on one thread, sixteen on two (as measured on 2 cores): each keeps its own."""
    clock = Clock()
    machine = Machine(lambda tokens, n: {1: 0.008, 2: 0.010}[n] if tokens == 1 else {1: 0.020, 2: 0.012}[n])
    t = tuner_on(machine, clock)
    run(t, machine, clock, 12, tokens=1)
    run(t, machine, clock, 12, tokens=16)
    assert (t.current(1), t.current(16)) == (1, 2)
    assert set(run(t, machine, clock, 5, tokens=1)) == {1} and set(run(t, machine, clock, 5, tokens=16)) == {2}
    assert t.current(17) == 2  # one class: 16-31 tokens


def test_a_new_size_starts_from_the_nearest_size_probed():
    clock, machine = Clock(), Machine({1: 0.020, 2: 0.012})
    t = tuner_on(machine, clock)
    assert t.current(16) == 1  # nothing probed yet: the fewest threads
    run(t, machine, clock, 12, tokens=16)
    assert t.current(64) == 2 and t.current(2) == 2
    assert run(t, machine, clock, 1, tokens=64) == [2]  # its probe starts from that choice


def test_a_probe_stops_after_two_steps_of_each_when_the_other_count_is_clearly_slower():
    clock, machine = Clock(), Machine({1: 0.020, 2: 0.030})  # 1.5x: more than twice the margin, less than 2x
    t = tuner_on(machine, clock)
    assert run(t, machine, clock, 4) == [1, 2, 1, 2]
    assert t.sizes[2].probe is None and t.current(16) == 1


def test_a_gain_within_the_margin_is_not_worth_a_switch():
    clock, machine = Clock(), Machine({1: 0.020, 2: 0.0196})  # two threads 2% faster
    t = tuner_on(machine, clock, margin=0.05)
    assert run(t, machine, clock, 12) == [1, 2] * 6
    assert t.current(16) == 1 and t.switches == 0


def test_probes_back_off_while_the_choice_holds_and_come_back_after_a_switch():
    clock, machine = Clock(), Machine({1: 0.020, 2: 0.012})
    t = tuner_on(machine, clock, min_interval=2.0, max_interval=8.0)
    starts = []
    for _ in range(3000):  # 30 s of steps of 10 ms
        probing = t.sizes.get(2) is not None and t.sizes[2].probe is not None
        run(t, machine, clock, 1)
        if t.sizes[2].probe is not None and not probing:
            starts.append(clock.now - 0.01)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # the first probe takes 12 steps (0.12 s) and switches: the next starts 2 s after it; the later ones stop after
    # 4 steps (0.04 s; one thread clearly slower) and the choice holds: 4, 8, 8 s
    assert [g - d for g, d in zip(gaps[:4], (0.12, 0.04, 0.04, 0.04))] == pytest.approx([2.0, 4.0, 8.0, 8.0], abs=0.015)
    machine.cost = {1: 0.020, 2: 0.060}  # a neighbour starts: two threads become slow
    run(t, machine, clock, 6 + 12)  # six slow steps bring the probe forward; it takes 12
    assert t.current(16) == 1 and t.sizes[2].interval == 2.0


def test_a_slowdown_between_probes_brings_the_next_probe_forward():
    clock, machine = Clock(), Machine({1: 0.020, 2: 0.012})
    t = tuner_on(machine, clock, min_interval=100.0, max_interval=400.0, slowdown=1.5)
    run(t, machine, clock, 12)
    assert t.current(16) == 2 and t.sizes[2].next_probe > clock.now + 50
    machine.cost = {1: 0.020, 2: 0.040}
    run(t, machine, clock, 6)
    assert t.sizes[2].next_probe <= clock.now  # six steps over 1.5x the probe's median
    run(t, machine, clock, 12)
    assert t.current(16) == 1


def test_a_probe_that_does_not_complete_ends_without_a_change():
    clock, machine = Clock(), Machine({1: 0.020, 2: 0.012})
    t = tuner_on(machine, clock, probe_steps=6, max_probe_steps=10)
    # a probe needs 6 steps of each of two counts: 10 steps cannot complete it
    run(t, machine, clock, 10)
    assert t.sizes[2].probe is None and t.probes == 1 and t.switches == 0 and t.current(16) == 1


def test_a_probe_of_a_size_seldom_seen_ends_after_max_interval_seconds():
    clock, machine = Clock(), Machine({1: 0.020, 2: 0.012})
    t = tuner_on(machine, clock, max_interval=8.0)
    run(t, machine, clock, 3, tokens=300)
    clock.now += 9  # its next step comes later than max_interval after the probe began
    run(t, machine, clock, 1, tokens=300)
    assert t.sizes[4].probe is None and t.current(300) == 1 and t.switches == 0


def test_one_choice_sets_it_once_and_never_probes():
    clock, machine = Clock(), Machine({1: 0.02})
    t = tuner_on(machine, clock, choices=(1,))
    assert run(t, machine, clock, 50) == [1] * 50
    assert machine.sets == [1] and t.probes == 0


def test_the_count_is_set_only_when_it_changes():
    clock, machine = Clock(), Machine({1: 0.020, 2: 0.012})
    t = tuner_on(machine, clock)
    run(t, machine, clock, 12 + 30)
    assert machine.sets == [1] + [2, 1] * 5 + [2]  # start, then each probe step that changes it


def test_a_step_not_announced_is_not_counted():
    clock, machine = Clock(), Machine({1: 0.020, 2: 0.012})
    t = tuner_on(machine, clock)
    t.after_step(5.0)  # nothing announced: ignored
    assert t.sizes == {}


@pytest.mark.parametrize("choices", [[], [0, 1]])
def test_thread_counts_below_one_are_refused(choices):
    with pytest.raises(ValueError, match=">= 1"):
        ThreadTuner(choices, lambda n: None)
