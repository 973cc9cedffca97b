"""``ENGINE_PROCESS=false``: the engine core (:mod:`server.engine.core`) runs in a thread of the server's process,
fed by the same client over ZMQ ``inproc://`` sockets with the same messages as the core process. The HTTP side's
request state is never the core's (before, the routes and the engine thread shared each ``Sequence``); a core
thread that ends unasked is reported as a dead core process is: ``/health`` 503 with the reason, running streams
end with an error event, and ``kvserve serve`` exits 1 saying why; stopping the server ends the thread."""

from __future__ import annotations

import json
import sys
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.config import Settings
from server.engine.core import EngineCore
from server.engine.engine import Engine
from server.engine.request_state import RequestState
from server.engine.sequence import Sequence
from server.service import GenerationService
from tests.conftest import MODEL_DIR, RunningServer

SETTINGS = {"model_id": str(MODEL_DIR), "kv_backends": "full", "engine_process": False, "log_level": "warning"}
REASON = "the engine core thread failed: RuntimeError: a failure that escapes the engine core's loop"


def failing_at_the_third(step):
    """:meth:`EngineCore.step` whose third call raises past the method's own guard (a step that raises inside is
    only logged): the loop ends, and with it the core thread."""
    calls = []

    def failing_step(self):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a failure that escapes the engine core's loop")
        return step(self)

    return failing_step


FAILING_SERVE = """import sys
from server.cli import main
from server.engine.core import EngineCore
from tests.test_engine_core_thread import failing_at_the_third
EngineCore.step = failing_at_the_third(EngineCore.step)
sys.exit(main(["serve"]))
"""
"""``kvserve serve`` with :func:`failing_at_the_third` in place of the core's step."""


def test_the_http_sides_sequences_are_never_the_cores(monkeypatch):
    http_side, core_side = [], []
    build, submit = GenerationService.build_request, Engine.submit

    def built(self, req):
        http_side.append(seq := build(self, req))
        return seq

    def submitted(self, seq):  # in the core thread: the sequence the scheduler queues
        core_side.append(seq)
        return submit(self, seq)

    monkeypatch.setattr(GenerationService, "build_request", built)
    monkeypatch.setattr(Engine, "submit", submitted)
    app = create_app(Settings(**SETTINGS), load_in_background=False)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": str(MODEL_DIR), "prompt": "And God said", "max_tokens": 6,
                                                 "n": 2, "seed": 7})
        assert r.status_code == 200, r.text
        assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]
    assert len(http_side) == len(core_side) == 2
    assert sorted(s.request_id for s in http_side) == sorted(s.request_id for s in core_side)
    for mine in http_side:
        theirs = next(s for s in core_side if s.request_id == mine.request_id)
        assert type(mine) is RequestState and type(theirs) is Sequence  # the HTTP side's own record, not the engine's
        assert not hasattr(theirs, "emit")  # the core's step returns its events: no callback
        assert [f for f in ("prompt_ids", "output_ids", "params", "times", "kv_stats", "stop")
                if getattr(theirs, f) is getattr(mine, f)] == []
        assert theirs.output_ids == mine.output_ids and len(mine.output_ids) == 6  # the same tokens, each its own
    assert not app.state.kvserve.core.host.thread.is_alive()  # the server's shutdown drained and ended the core
    assert "kvserve-engine-core" not in {t.name for t in threading.enumerate()}


def test_the_core_is_read_by_a_task_on_the_servers_event_loop(monkeypatch):
    """The core's outputs are read by an asyncio task on the server's event loop (from start-up, before any
    request), which owns every request's state: no reader thread while a request streams; the requests are
    submitted on the same loop, and a second running loop cannot submit beside it."""
    import asyncio

    from server.engine.core_client import READER, CoreClient
    from server.engine.sampling import SamplingParams

    loops, submit = [], CoreClient.submit

    def submitted(self, req):
        loops.append(asyncio.get_running_loop())
        return submit(self, req)

    monkeypatch.setattr(CoreClient, "submit", submitted)
    app = create_app(Settings(**SETTINGS), load_in_background=False)
    with TestClient(app) as client:
        core = app.state.kvserve.core
        reader = core._task
        assert reader is not None and reader.get_name() == READER and not reader.done()  # from start-up
        with client.stream("POST", "/generate_stream",
                           json={"inputs": "In the beginning", "parameters": {"max_new_tokens": 40}}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            threads = {t.name for t in threading.enumerate()}
            live = core.live_requests()
            assert core._task is reader and not reader.done()
            rest = [line for line in lines if line.startswith("data:")]
        assert READER not in threads and "kvserve-core-reader" not in threads
        assert [type(req) for req in live] == [RequestState]
        assert loops == [reader.get_loop()] and reader.get_loop().is_running()
        assert json.loads(rest[-1][5:])["details"]["generated_tokens"] == 40

        async def beside():
            req = RequestState(request_id="beside", prompt_ids=[1, 2, 3], max_new_tokens=2, params=SamplingParams(),
                               stop=[], backend_name="full")
            core.submit(req)

        with pytest.raises(RuntimeError, match="another running event loop"):
            asyncio.run(beside())
        assert core.live_requests() == []
    assert reader.done()  # the server's stop ended it


def test_a_core_thread_that_fails_ends_the_stream_with_an_error_and_health_says_why(monkeypatch):
    monkeypatch.setattr(EngineCore, "step", failing_at_the_third(EngineCore.step))
    app = create_app(Settings(**SETTINGS), load_in_background=False)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        r = client.post("/generate_stream", json={"inputs": "In the beginning", "parameters": {"max_new_tokens": 900}})
        events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
        assert events[-1].get("error") == REASON, events[-1]
        assert app.state.kvserve.load_error == REASON
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"] == REASON
        refused = client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1}})
        assert refused.status_code == 503


def test_a_core_thread_that_fails_makes_the_server_exit_1_saying_why():
    srv = RunningServer({"KV_BACKENDS": "full", "ENGINE_PROCESS": "false"},
                        argv=[sys.executable, "-c", FAILING_SERVE])
    try:
        events = []
        with httpx.stream("POST", srv.url + "/generate_stream", timeout=60,
                          json={"inputs": "In the beginning", "parameters": {"max_new_tokens": 900}}) as r:
            events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        assert events[-1].get("error") == REASON, events[-1]
        assert srv.proc.wait(30) == 1
        assert f"kvserve: cannot serve: {REASON}" in srv.proc.stdout.read()
    finally:
        srv.stop()


def test_a_stop_while_the_core_loads_ends_the_start_and_the_core(held_pricing):
    """A server stopped while its core loads (Ctrl-C at start-up): the start gives up, and the core, once loaded,
    drains and ends; the start's sockets are closed by its own thread, never under its wait by the stopping one
    (before, stop() closed them beneath it, and a core that became ready meanwhile was served by a closed client)."""
    from server.engine.core_client import STOPPED, CoreClient

    entered, release = held_pricing
    client = CoreClient(Settings(**SETTINGS))
    result = {}

    def start():
        try:
            result["ready"] = client.start()
        except RuntimeError as exc:
            result["error"] = str(exc)

    starter = threading.Thread(target=start)
    starter.start()
    assert entered.wait(120)
    client.stop()  # returns at once: the starting thread owns the sockets
    release.set()
    starter.join(60)
    assert result == {"error": STOPPED}
    assert not client.host.thread.is_alive()


def test_a_tgi_stream_the_core_ended_says_unhealthy(monkeypatch):
    """A ``/generate_stream`` the engine core's end cut short closes with ``error_type`` ``unhealthy`` (as the
    non-streamed route's 503 says), not ``generation``: neither the request nor its generation failed."""
    import json

    monkeypatch.setattr(EngineCore, "step", failing_at_the_third(EngineCore.step))
    app = create_app(Settings(**SETTINGS), load_in_background=False)
    with TestClient(app) as client, client.stream("POST", "/generate_stream", json={
            "inputs": "In the beginning", "parameters": {"max_new_tokens": 900}}) as r:
        data = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert data[-1] == {"error": REASON, "error_type": "unhealthy"}, data[-1]


def test_an_openai_stream_the_core_ended_says_service_unavailable(monkeypatch):
    """A chat stream the engine core's end cut short says so as the non-streamed 503 does
    (``service_unavailable_error``, code ``unhealthy``), not ``server_error``."""
    import json

    monkeypatch.setattr(EngineCore, "step", failing_at_the_third(EngineCore.step))
    app = create_app(Settings(**SETTINGS), load_in_background=False)
    with TestClient(app) as client, client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 900, "stream": True}) as r:
        data = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"] == {"message": REASON, "type": "service_unavailable_error", "param": None,
                                             "code": "unhealthy"}, data[-2]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": str(MODEL_DIR), "prompt": "In the beginning", "max_tokens": 900}),
    ("/v1/chat/completions", {"model": str(MODEL_DIR), "messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 900}),
    ("/v1/responses", {"model": str(MODEL_DIR), "input": "In the beginning", "max_output_tokens": 900}),
    ("/generate", {"inputs": "In the beginning", "parameters": {"max_new_tokens": 900}})])
def test_a_generation_the_core_ended_is_a_503_saying_why(monkeypatch, path, body):
    """A non-streaming answer whose generation the engine core's end cut short is 503 (the server is going; another
    replica can answer) naming the cause, in OpenAI's error object or TGI's body: not a 500 (TGI's route answered
    500 with ``error_type`` ``generation``), since neither the request nor its generation failed."""
    monkeypatch.setattr(EngineCore, "step", failing_at_the_third(EngineCore.step))
    app = create_app(Settings(**SETTINGS), load_in_background=False)
    with TestClient(app) as client:
        r = client.post(path, json=body)
    assert r.status_code == 503, r.text
    if path == "/generate":
        assert r.json() == {"error": REASON, "error_type": "unhealthy"}, r.text
    else:
        assert r.json()["error"]["message"] == REASON, r.text
        assert r.json()["error"]["type"] == "service_unavailable_error", r.text
