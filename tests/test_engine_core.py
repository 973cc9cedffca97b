"""The engine core driven by messages over ZMQ (server/engine/core.py), on the reference model: greedy tokens as the
in-process engine gives them, EOS/length decided in the core, an Abort frees the KV at the next step, and refused
requests are answered."""

from __future__ import annotations

import threading

import pytest
import zmq

from server.engine import messages as m
from server.engine.core import EngineCore, sampling_params
from server.engine.core_client import sampling_fields
from server.engine.sampling import SamplingParams
from tests.engine_helpers import first_compression, make_engine, make_seq, raising_once, run_all
from tests.test_elastic import PAGE


class Wire:
    """An :class:`EngineCore` serving in a thread over ipc sockets, and the test's ends of them."""

    def __init__(self, core: EngineCore, tmp_path):
        self.ctx = zmq.Context()
        self.tx, self.rx = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.tx.bind(f"ipc://{tmp_path}/in")
        self.rx.bind(f"ipc://{tmp_path}/out")
        inbox, outbox = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
        inbox.connect(f"ipc://{tmp_path}/in")
        outbox.connect(f"ipc://{tmp_path}/out")
        self.code = None

        def serve():
            self.code = core.serve(inbox, outbox)
            inbox.close(0)
            outbox.close()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def send(self, msg) -> None:
        self.tx.send(m.encode(msg))

    def recv(self, timeout_ms: int = 60_000) -> m.StepOutput:
        assert self.rx.poll(timeout_ms), "the core sent nothing"
        return m.decode_output(self.rx.recv())

    def until_finished(self, ids: set[str]) -> tuple[dict[str, list[int]], dict[str, m.Finished], list[m.StepOutput]]:
        tokens, done, outs = {i: [] for i in ids}, {}, []
        while set(done) != ids:
            out = self.recv()
            outs.append(out)
            for t in out.new:
                assert t.request_id not in done, "a token after its request finished"
                tokens[t.request_id].append(t.token_id)
            done.update((f.request_id, f) for f in out.finished)
        return tokens, done, outs

    def close(self) -> None:
        self.send(m.Drain())
        self.thread.join(30)
        assert self.code == 0
        self.tx.close(0)
        self.rx.close(0)
        self.ctx.term()


@pytest.fixture
def wire(ref_model, tmp_path):
    model, tok = ref_model
    w = Wire(EngineCore(make_engine(model, tok, prefix_caching=False)), tmp_path)
    yield w
    w.close()


def add(tok, rid: str, prompt: str, n: int, backend: str = "full", **kw) -> m.AddRequest:
    params = kw.pop("params", SamplingParams())
    return m.AddRequest(rid, tok.encode(prompt), n, sampling_fields(params), backend, **kw)


def run_core(core: EngineCore, ids: set[str], max_steps: int = 2_000) -> tuple[dict[str, list[int]], dict[str, m.Finished]]:
    """Step ``core`` (no sockets) until the requests ``ids`` are finished: each request's tokens and ``Finished``."""
    tokens, done = {}, {}
    for _ in range(max_steps):
        out = core.step()
        for t in out.new:
            assert t.request_id not in done, "a token after its request finished"
            tokens.setdefault(t.request_id, []).append(t.token_id)
        done.update((f.request_id, f) for f in out.finished)
        if ids <= set(done):
            return tokens, done
    raise AssertionError("the core did not finish")


def test_sampling_fields_round_trip():
    p = SamplingParams(do_sample=True, temperature=0.7, top_k=5, logit_bias=((3, 1.5),), min_tokens=2,
                       ignore_eos=True, top_n=3, seed=9)
    assert sampling_params(m.decode_input(m.encode(m.AddRequest("r", [1], 1, sampling_fields(p), "full"))).sampling) == p


def test_greedy_tokens_and_logprobs_match_the_in_process_engine(ref_model, wire):
    model, tok = ref_model
    prompts = {"a": "In the beginning God created", "b": "And the earth was"}
    ref = {}
    engine = make_engine(model, tok, prefix_caching=False)
    for rid, prompt in prompts.items():
        events = []
        run_all(engine, [make_seq(tok, prompt, 6, params=SamplingParams(top_n=2), events=events)])
        ref[rid] = events
    for rid, prompt in prompts.items():
        wire.send(add(tok, rid, prompt, 6, params=SamplingParams(top_n=2)))
    tokens, done, outs = wire.until_finished({"a", "b"})
    assert sorted(a for o in outs for a in o.accepted) == ["a", "b"] and not any(o.rejected for o in outs)
    for rid, events in ref.items():
        assert tokens[rid] == [e.token_id for e in events]
        assert done[rid].reason == "length" and done[rid].error is None
    got = [t for o in outs for t in o.new if t.request_id == "a"]
    assert [t.logprob for t in got] == pytest.approx([e.logprob for e in ref["a"]], abs=1e-5)
    assert [[i for i, _ in t.top] for t in got] == [[i for i, _ in e.top] for e in ref["a"]]
    assert all(o.stats is not None for o in outs if o.new)  # a step's output; an answer to adds alone has none
    assert outs[-1].stats.running == 0 and outs[-1].stats.kv_held_bytes == 0  # finished: KV freed
    assert done["a"].peak_kv_stored_bytes > 0 and done["a"].timings.first_token >= done["a"].timings.prefill_start


def test_eos_is_decided_in_the_core(ref_model, wire):
    _, tok = ref_model
    eos = tok.eos_token_id
    wire.send(add(tok, "e", "In the beginning", 20, params=SamplingParams(logit_bias=((eos, 100.0),))))
    tokens, done, _ = wire.until_finished({"e"})
    assert tokens["e"] == [eos] and done["e"].reason == "eos_token"


def test_abort_frees_the_kv_at_the_next_step(ref_model, wire):
    _, tok = ref_model
    wire.send(add(tok, "long", "In the beginning God created the heaven and the earth.", 200,
                  params=SamplingParams(ignore_eos=True)))
    while True:  # until it decodes and holds KV
        out = wire.recv()
        if out.new:
            assert out.stats.kv_held_bytes > 0 and out.stats.running == 1
            break
    wire.send(m.Abort(["long", "nobody"]))  # an id the core does not know is ignored
    while True:
        out = wire.recv()
        if out.finished:
            break
    assert [(f.request_id, f.reason) for f in out.finished] == [("long", "cancelled")]
    assert out.stats.running == 0 and out.stats.kv_held_bytes == 0 and out.stats.kv_stored_bytes == 0


def test_refused_requests_are_answered(ref_model, wire):
    _, tok = ref_model
    wire.send(m.AddRequest("x", tok.encode("hi"), 4, m.Sampling(), "nope"))
    out = wire.recv()
    assert [(r.request_id, r.kind) for r in out.rejected] == [("x", "invalid")] and "nope" in out.rejected[0].message
    wire.send(m.AddRequest("big", [1] * 10, 100_000, m.Sampling(), "full"))
    out = wire.recv()
    assert [(r.request_id, r.kind) for r in out.rejected] == [("big", "invalid")] and "KV blocks" in out.rejected[0].message


def test_drain_refuses_new_requests_and_exits_when_idle(ref_model, tmp_path):
    model, tok = ref_model
    core = EngineCore(make_engine(model, tok, prefix_caching=False))
    w = Wire(core, tmp_path)
    w.send(add(tok, "a", "In the beginning", 3))
    w.send(m.Drain())
    w.send(add(tok, "late", "In the beginning", 3))
    tokens, done, outs = w.until_finished({"a"})
    assert len(tokens["a"]) == 3
    assert [(r.request_id, r.kind) for o in outs for r in o.rejected] == [("late", "draining")]
    w.thread.join(30)
    assert w.code == 0
    w.tx.close(0)
    w.rx.close(0)
    w.ctx.term()


@pytest.mark.parametrize("where", ["forward", "compression"])
def test_a_failed_step_ends_its_requests_with_an_error_and_the_core_goes_on(ref_model, monkeypatch, where):
    """A forward (both requests' decode rows) or a compression (the sequences it compressed) that raises once: those
    requests finish with ``error`` and the failure's message, their KV blocks go back to the pool, the others run to
    their end, and a later request gets a fresh engine's greedy tokens."""
    import server.engine.runner as runner_module

    model, tok = ref_model
    backend, budget, n = ("full", None, 30) if where == "forward" else ("elastic", 12 * PAGE, 200)
    core = EngineCore(make_engine(model, tok, backend, budget=budget))
    free = core.engine.kv.blocks.num_free
    prompts = {"a": "And God said", "b": "The LORD is my shepherd"}
    for rid, prompt in prompts.items():
        core.handle(add(tok, rid, prompt, n, backend))
    request_of = {core.live[rid].seq_id: rid for rid in prompts}
    if where == "forward":
        core.step()  # both prompts, in one forward
        monkeypatch.setattr(core.engine.runner, "model", raising_once(model))
        touched, error = set(prompts), "decode failed: boom"
    else:
        monkeypatch.setattr(runner_module, "drain_layer", raising_once(runner_module.drain_layer))
        compressed, touched, error = first_compression(core.engine), None, "compression failed: boom"
    tokens, done = run_core(core, set(prompts))
    if touched is None:
        touched = {request_of[i] for i in compressed}
        assert touched and len(touched) < len(prompts)
    assert {rid for rid, f in done.items() if f.reason == "error"} == touched
    for rid, f in done.items():
        assert (f.reason, f.error) == (("error", error) if rid in touched else ("length", None))
        assert rid in touched or len(tokens[rid]) == n
    assert core.engine.kv.blocks.num_free == free and not core.live and core.stats().kv_held_bytes == 0
    core.handle(add(tok, "c", "Blessed are the", 20, backend))
    tokens, done = run_core(core, {"c"})
    fresh = make_seq(tok, "Blessed are the", 20, backend=backend)
    run_all(make_engine(model, tok, backend, budget=budget), [fresh])
    assert tokens["c"] == fresh.output_ids and done["c"].reason == "length"


def test_the_events_of_a_step_that_raises_still_go_out(ref_model, monkeypatch):
    """A step that raises past the engine's own guards (here: running its rows) is logged by the core, and the events
    it made before (an aborted request's closing one) are in that step's output."""
    model, tok = ref_model
    core = EngineCore(make_engine(model, tok))
    for rid in ("a", "b"):
        core.handle(add(tok, rid, "And God said", 30))
    core.step()  # both prompts
    core.handle(m.Abort(["a"]))
    monkeypatch.setattr(core.engine, "_execute", raising_once(core.engine._execute))
    out = core.step()
    assert [(f.request_id, f.reason) for f in out.finished] == [("a", "cancelled")] and "a" not in core.live
