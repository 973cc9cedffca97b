"""The engine core in its own process behind :class:`~server.engine.core_client.CoreClient`, driven through
:class:`~server.service.GenerationService` as the routes drive it: the events (token ids, text, log-probabilities,
finish reasons) are those of the in-process engine; a stop string ends the stream and the core frees the KV; a
departed client's request is aborted and its KV freed; the core process dying ends running requests with an
error and reports why."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from server.config import Settings
from server.engine.core_client import CoreClient, CoreDied
from server.engine.request_state import RequestState
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason
from server.service import GenerationRequest, GenerationService, Limits
from tests.conftest import MODEL_DIR, REPO
from tests.engine_helpers import make_engine, make_seq, run_all

PROMPTS = ["In the beginning God created", "And the earth was without form"]


@pytest.fixture(scope="module")
def client():
    deaths = []
    c = CoreClient(Settings(model_id=str(MODEL_DIR), kv_backends="full", device="cpu", dtype="float32",
                            log_level="warning", engine_process=True), on_death=deaths.append)
    c.stages = []
    c.start(on_stage=c.stages.append)
    c.deaths = deaths
    yield c
    c.stop()


def service(client) -> GenerationService:
    return GenerationService(client, client.tokenizer, Limits(1000, 1024, 4), "full")


def in_process_events(ref_model, prompt: str, n: int, params=None, stop=()):
    model, tok = ref_model
    events = []
    run_all(make_engine(model, tok), [make_seq(tok, prompt, n, params=params, stop=stop, events=events)])
    return events


async def collect(svc, req, receive=None):
    seq, events = await svc.run(req, receive)
    return seq, [e async for e in events]


def fields(events):
    return [(e.index, e.token_id, e.text, e.special, e.finish_reason, e.generated_text, e.error) for e in events]


def test_the_core_reports_its_start_up_stage_before_ready(client):
    """``/health`` says that the model is loaded and the backends are being priced."""
    from server.engine_loading import PRICING

    assert client.stages == [PRICING]


def test_events_are_the_in_process_engines(ref_model, client):
    async def main():
        svc = service(client)
        reqs = [GenerationRequest(p, 12, SamplingParams(top_n=2), [], "full") for p in PROMPTS]
        return await asyncio.gather(*(collect(svc, r) for r in reqs))

    for prompt, (seq, got) in zip(PROMPTS, asyncio.run(main())):
        want = in_process_events(ref_model, prompt, 12, SamplingParams(top_n=2))
        assert fields(got) == fields(want)
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-5)
        assert [[i for i, _ in e.top] for e in got] == [[i for i, _ in e.top] for e in want]
        assert got[-1].finish_reason == FinishReason.LENGTH and len(seq.output_ids) == 12
        assert seq.peak_kv_stored_bytes > 0 and seq.times.prefill_start is not None
    assert client.last_stats.running == 0 and client.last_stats.kv_stored_bytes == 0


def test_stop_string_ends_the_stream_as_in_process_and_frees_the_kv(ref_model, client):
    want = in_process_events(ref_model, PROMPTS[0], 40, stop=["LORD,"])
    assert want[-1].finish_reason == FinishReason.STOP, "the reference output must contain the stop string"
    seq, got = asyncio.run(collect(service(client), GenerationRequest(PROMPTS[0], 40, SamplingParams(), ["LORD,"],
                                                                      "full")))
    assert fields(got) == fields(want)
    assert seq.finish_reason == FinishReason.STOP and seq.peak_kv_stored_bytes > 0  # the core's stats came back
    assert client.last_stats.running == 0 and client.last_stats.kv_stored_bytes == 0


def test_a_departed_client_is_aborted_and_its_kv_freed_at_once(client):
    async def main():
        svc = service(client)
        first = asyncio.Event()

        async def receive():
            await first.wait()
            return {"type": "http.disconnect"}

        seq, events = await svc.run(GenerationRequest(PROMPTS[0], 900, SamplingParams(ignore_eos=True), [], "full"),
                                    receive)
        got = []
        async for e in events:
            got.append(e)
            if len(got) == 2:
                assert client.last_stats.running == 1 and client.last_stats.kv_stored_bytes > 0
                first.set()
        return seq, got

    seq, got = asyncio.run(main())
    assert got[-1].finish_reason == FinishReason.CANCELLED and len(got) < 100
    stats = client.last_stats  # the core's numbers after the step that dropped it
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_stored_bytes == 0


def test_a_submitter_that_stops_waiting_for_the_answer_aborts_the_request(ref_model, client):
    _, tok = ref_model

    async def main():
        seq = RequestState(request_id="gave-up", prompt_ids=tok.encode(PROMPTS[0]), max_new_tokens=900,
                           params=SamplingParams(ignore_eos=True), stop=[], backend_name="full")
        client.submit(seq).cancel()  # the route was cancelled while it awaited the core's answer
        while (e := await asyncio.wait_for(seq.events.get(), 60)).finish_reason is None:
            pass
        return seq, e

    seq, last = asyncio.run(main())
    assert last.finish_reason == FinishReason.CANCELLED and len(seq.output_ids) < 100


def test_refusals_come_back_as_the_in_process_errors(client):
    from server.service import InvalidRequest

    svc = service(client)
    svc.limits = Limits(1000, 10**6, 4)  # past the HTTP side's limits: the core's KV budget refuses it

    async def main():
        with pytest.raises(InvalidRequest, match="KV blocks"):
            await svc.run(GenerationRequest([1] * 10, 100_000, SamplingParams(), [], "full"))

    asyncio.run(main())


def test_the_core_dying_ends_running_requests_with_an_error(client):  # last: it kills the module's core
    async def main():
        svc = service(client)
        seq, events = await svc.run(GenerationRequest(PROMPTS[0], 900, SamplingParams(ignore_eos=True), [], "full"))
        got = []
        async for e in events:
            got.append(e)
            if len(got) == 2:
                os.kill(client.host.proc.pid, signal.SIGKILL)
        return got

    got = asyncio.run(main())
    assert got[-1].finish_reason == FinishReason.ERROR
    assert got[-1].error == "the engine core process was killed by signal 9"
    assert client.deaths == ["the engine core process was killed by signal 9"]

    async def later():
        with pytest.raises(CoreDied, match="killed by signal 9"):
            await service(client).run(GenerationRequest(PROMPTS[0], 4, SamplingParams(), [], "full"))

    asyncio.run(later())


def test_a_request_after_the_core_died_gets_503():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from server.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/x")
    async def x():
        raise CoreDied("the engine core process was killed by signal 9")

    r = TestClient(app).get("/x")
    assert r.status_code == 503 and r.json() == {"error": "the engine core process was killed by signal 9",
                                                 "error_type": "unhealthy"}


PARENT = """
import sys, time
from server.config import Settings
from server.engine.core_client import CoreClient
c = CoreClient(Settings(model_id=sys.argv[1], kv_backends="full", device="cpu", dtype="float32", log_level="warning",
                        engine_process=True))
c.start()
print(c.host.proc.pid, flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped by its new parent
    except FileNotFoundError:
        return True


def test_the_core_exits_when_the_server_process_is_killed():
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(MODEL_DIR)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        core_pid = int(parent.stdout.readline())
        assert not gone(core_pid)
        parent.kill()
        parent.wait(10)
        deadline = time.time() + 10
        while not gone(core_pid) and time.time() < deadline:
            time.sleep(0.1)
        assert gone(core_pid), "the core outlived its server"
    finally:
        parent.kill()


def test_the_core_process_fixes_glibcs_allocator_thresholds_before_it_loads(monkeypatch, tmp_path):
    """The engine core steps on its process's main thread, where glibc can settle on unmapping a step's transients
    at every free (server/engine/malloc_tuning.py): the process fixes the thresholds first thing."""
    import zmq

    from server.config import Settings
    from server.engine import core, malloc_tuning
    from server.engine import messages as m

    calls = []
    monkeypatch.setattr(malloc_tuning, "keep_step_memory", lambda: calls.append("keep") or True)
    settings = Settings(model_id=str(tmp_path / "no-such-model"), kv_backends="full")
    monkeypatch.setenv(m.SETTINGS_ENV, settings.model_dump_json())
    ctx = zmq.Context()
    out = ctx.socket(zmq.PULL)
    out.bind(f"ipc://{tmp_path}/out")
    try:
        assert core.main([f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"]) == 1  # no such model: Failed, status 1
        assert isinstance(m.decode_output(out.recv()), (m.Loading, m.Failed))
    finally:
        out.close(0)
        ctx.term()
    assert calls == ["keep"]


def test_the_core_process_watches_its_server_from_before_it_loads(monkeypatch, tmp_path):
    """The server process's pid comes in the core's environment, and the core watches it before it loads: a server
    killed while its core loads and prices the backends (minutes on a real model) leaves no core behind."""
    import zmq

    from server.config import Settings
    from server.engine import core
    from server.engine import messages as m

    watched = []
    monkeypatch.setattr(core, "watch_parent", lambda pid: watched.append(pid))
    monkeypatch.setattr(core, "load_and_serve", lambda *a: watched.append("load") or 1)
    monkeypatch.setenv(m.SETTINGS_ENV, Settings(model_id=str(tmp_path), kv_backends="full").model_dump_json())
    monkeypatch.setenv(m.PARENT_ENV, "4242")
    ctx = zmq.Context()
    try:
        assert core.main([f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"]) == 1
    finally:
        ctx.term()
    assert watched == [4242, "load"]


@pytest.mark.parametrize("given", [{}, {"KV_MLA_RANK": "32", "KV_INT4_ROTATE": "false", "KV_DCA_WINDOW": "64"}])
def test_the_core_process_tells_a_given_option_from_a_default(monkeypatch, tmp_path, given):
    """The quality budget searches only the options left at their defaults (``Settings.explicit_options``). The
    core process rebuilt its settings from every field, so every option read as given there (``mla``: ``set()``
    in the server, ``{'rank'}`` in the core) and the budget never searched in the default mode."""
    import types

    from server.config import BACKEND_OPTIONS, load_settings
    from server.engine import core, core_host
    from server.engine import messages as m

    for name, value in given.items():
        monkeypatch.setenv(name, value)
    settings = load_settings(model_id=str(tmp_path), kv_backends="full", port=8123)
    env = {}
    popen = lambda argv, **kw: env.update(kw["env"])  # noqa: E731 - the core's environment, no process
    monkeypatch.setattr(core_host, "subprocess", types.SimpleNamespace(Popen=popen))
    core_host.CoreProcess(settings, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    rebuilt = []
    monkeypatch.setattr(core, "watch_parent", lambda pid: None)
    monkeypatch.setattr(core, "load_and_serve", lambda s, *a: rebuilt.append(s) or 1)
    monkeypatch.setenv(m.SETTINGS_ENV, env[m.SETTINGS_ENV])
    assert core.main([f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"]) == 1
    (core_settings,) = rebuilt
    assert core_settings == settings  # the same values, defaults included
    for name in [*BACKEND_OPTIONS, "mla+int4", "gqa+int8", "dca+mla"]:
        assert core_settings.explicit_options(name) == settings.explicit_options(name), name
    assert settings.explicit_options("mla") == ({"rank"} if given else set())


BLOCKED_CORE = r"""
import os, sys
from server.engine.core import watch_parent
from safetensors import safe_open

watch_parent(os.getppid())
print(os.getpid(), flush=True)
safe_open(sys.argv[1], framework="pt")  # waits for a writer to the pipe, keeping the interpreter's lock
"""
SERVER_OF_A_BLOCKED_CORE = r"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
time.sleep(600)
"""


def test_a_core_blocked_holding_the_interpreters_lock_ends_with_its_server(tmp_path):
    """The watcher thread cannot run while the core's main thread keeps the interpreter's lock (safetensors opening a
    named pipe did, for ever): the core outlived its server, ignoring SIGTERM. Its guard process kills it."""
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    fifo = tmp_path / "entry.safetensors"
    os.mkfifo(fifo)
    parent = subprocess.Popen([sys.executable, "-c", SERVER_OF_A_BLOCKED_CORE, BLOCKED_CORE, str(fifo)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    core_pid = None
    try:
        core_pid = int(parent.stdout.readline())
        time.sleep(1.0)  # into the open
        assert not gone(core_pid)
        parent.kill()
        parent.wait(10)
        deadline = time.time() + 10  # the guard's grace (2 s) and a loaded machine's delays
        while not gone(core_pid) and time.time() < deadline:
            time.sleep(0.1)
        assert gone(core_pid), "the blocked core outlived its server"
        time.sleep(1.0)
        guards = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(int(p)).startswith(
            f"{sys.executable} -m server.engine.core_guard {core_pid} ")]
        assert not guards, "the guard outlived its core"
    finally:
        parent.kill()
        if core_pid is not None and not gone(core_pid):
            os.kill(core_pid, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_a_core_whose_server_is_gone_exits():
    import subprocess
    import sys

    code = "from server.engine.core import watch_parent; import time; watch_parent(1 << 22); time.sleep(60)"
    proc = subprocess.run([sys.executable, "-c", code], timeout=30, capture_output=True, text=True)
    assert proc.returncode == 1 and "the engine core exits" in proc.stderr


def test_a_total_length_past_the_models_positions_is_served_with_a_warning(caplog):
    from server.config import Settings
    from server.engine.core_loading import load_core
    from tests.conftest import MODEL_DIR

    engine, ready = load_core(Settings(model_id=str(MODEL_DIR), kv_backends="full", max_total_tokens=2048,
                                       log_level="warning"))
    assert any("MAX_TOTAL_TOKENS=2048 is more than the model's max_position_embeddings (1024)" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")


@pytest.mark.parametrize("timeout,why", [(120.0, "stopped by a signal"), (2.0, "finished no step in")])
def test_a_hung_core_is_ended_and_its_requests_end_with_an_error(timeout, why):
    """A core that sends nothing while requests wait (here stopped with SIGSTOP) is hung: after
    ENGINE_STEP_TIMEOUT_S (or 5 s once its process is seen stopped) it is killed, its requests end with an error
    saying so, and the server is told (``on_death``: /health 503, then exit 1), not left waiting for ever."""
    import time

    deaths = []
    c = CoreClient(Settings(model_id=str(MODEL_DIR), kv_backends="full", device="cpu", dtype="float32",
                            log_level="warning", engine_process=True, engine_step_timeout_s=timeout),
                   on_death=deaths.append)
    c.start()
    try:
        async def main():
            seq, events = await service(c).run(GenerationRequest(PROMPTS[0], 900, SamplingParams(ignore_eos=True),
                                                                 [], "full"))
            got = []
            async for e in events:
                got.append(e)
                if len(got) == 2:
                    os.kill(c.host.proc.pid, signal.SIGSTOP)
            return got

        t0 = time.monotonic()
        got = asyncio.run(asyncio.wait_for(main(), 60))
        assert got[-1].finish_reason == FinishReason.ERROR and why in got[-1].error, got[-1].error
        assert deaths == [got[-1].error] and time.monotonic() - t0 < 30
        assert c.host.proc.wait(10) == -signal.SIGKILL
    finally:
        c.stop()


def test_an_idle_core_stopped_by_a_signal_is_ended_too():
    """A core process stopped (SIGSTOP) while no request runs would take the next request and never answer: the
    reader sees it stopped for 5 s and reports its death (``on_death``: /health 503, then exit 1) without waiting
    for a request."""
    import time

    deaths = []
    c = CoreClient(Settings(model_id=str(MODEL_DIR), kv_backends="full", device="cpu", dtype="float32",
                            log_level="warning", engine_process=True), on_death=deaths.append)
    c.start()
    try:
        async def main():
            c.listen(asyncio.get_running_loop())
            os.kill(c.host.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            while not deaths and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.1)
            return time.monotonic() - t0

        waited = asyncio.run(main())
        assert deaths and "stopped by a signal" in deaths[0], deaths
        assert 5 <= waited < 15
        assert c.host.proc.wait(10) == -signal.SIGKILL
    finally:
        c.stop()


def test_socket_folders_of_servers_that_are_gone_are_swept_at_the_next_start(tmp_path, monkeypatch):
    """A server killed with SIGKILL cannot remove its sockets' folder: the next one does, and only those whose server
    pid is gone (the pid is in the folder's name)."""
    import subprocess
    import sys
    import tempfile

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone_dir = tmp_path / f"kvserve-core-{dead.pid}-abc123_x"
    live_dir = tmp_path / f"kvserve-core-{os.getpid()}-def456"
    other = [tmp_path / "kvserve-core-q1w2e3r4", tmp_path / f"kvserve-core-{dead.pid}"]  # not this naming: left
    for d in [gone_dir, live_dir, *other]:
        d.mkdir()
    (gone_dir / "in").write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    c = CoreClient(Settings(model_id=str(MODEL_DIR), kv_backends="full", engine_process=True))
    try:
        assert not gone_dir.exists() and live_dir.exists() and all(d.exists() for d in other)
        [own] = [d for d in tmp_path.glob(f"kvserve-core-{os.getpid()}-*") if d != live_dir]
    finally:
        c.stop()
    assert not own.exists()  # stopped before it started: its folder goes too


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_the_socket_folder_of_a_server_killed_goes_at_once(tmp_path, sig):
    """A server killed with SIGKILL, or by a signal it does not handle (SIGHUP: its terminal closed), left its
    sockets' folder behind until some later server's start swept it: its janitor removes it within a second."""
    import subprocess
    import sys

    # SIGHUP's default action, as a server started from a terminal has it (a suite run under nohup ignores it, and
    # its children would inherit that)
    code = ("import signal, time\nsignal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
            "from server.engine.core_sockets import new_socket_dir\nprint(new_socket_dir(), flush=True)\n"
            "time.sleep(120)")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        folder = server.stdout.readline().strip()
        assert os.path.dirname(folder) == str(tmp_path) and os.path.isdir(folder)
        server.send_signal(sig)
        assert server.wait(10) == -sig
        deadline = time.monotonic() + 5
        while os.path.isdir(folder) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(folder), "the socket folder was left behind"
    finally:
        if server.poll() is None:
            server.kill()


def test_a_server_that_removed_its_socket_folder_ends_its_janitor(tmp_path, monkeypatch):
    """The janitor is no child of the server (whose children are counted as its engine core's), and it ends once
    the server has removed the folder itself."""
    import shutil
    import tempfile

    from bench.serving import child_pids
    from server.engine import core_sockets

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = core_sockets.new_socket_dir()
    janitor = core_sockets.janitor_pids[-1]
    assert janitor not in child_pids(os.getpid())
    shutil.rmtree(folder)
    deadline = time.monotonic() + 5
    while _running(janitor) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(janitor)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.parametrize("how", ["environment", "file", "flag"])
def test_the_core_process_is_not_given_the_api_key(monkeypatch, tmp_path, how):
    """The core's ``KVSERVE_CORE_SETTINGS`` carried the key in plain text (and its environment ``API_KEY``); it never
    needs it: only the HTTP side checks it."""
    import types

    from server.config import load_settings
    from server.engine import core_host
    from server.engine import messages as m

    key = tmp_path / "key"
    key.write_text("s3cret-key\n")
    monkeypatch.delenv("API_KEY", raising=False)
    monkeypatch.delenv("API_KEY_FILE", raising=False)
    if how == "environment":
        monkeypatch.setenv("api_key", "s3cret-key")  # any case, as the settings read it
        settings = load_settings(model_id=str(tmp_path), kv_backends="full")
    elif how == "file":
        monkeypatch.setenv("API_KEY_FILE", str(key))
        settings = load_settings(model_id=str(tmp_path), kv_backends="full")
    else:
        settings = load_settings(model_id=str(tmp_path), kv_backends="full", api_key="s3cret-key")
    assert settings.api_key == "s3cret-key"
    env = {}
    popen = lambda argv, **kw: env.update(kw["env"])  # noqa: E731 - the core's environment, no process
    monkeypatch.setattr(core_host, "subprocess", types.SimpleNamespace(Popen=popen))
    core_host.CoreProcess(settings, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    assert not [name for name, value in env.items() if "s3cret-key" in value or name.lower().startswith("api_key")]
    assert '"model_id"' in env[m.SETTINGS_ENV] and "api_key" not in env[m.SETTINGS_ENV]


def test_the_core_process_is_not_given_the_chat_template(monkeypatch, tmp_path):
    """A chat template passed in the core's environment (its text in ``KVSERVE_CORE_SETTINGS``) past 128 KiB
    stopped the start with "Argument list too long" reported as a model that failed to load; the core never renders
    a chat, so it is given neither the template nor ``CHAT_TEMPLATE``."""
    import types

    from server.config import load_settings
    from server.engine import core_host
    from server.engine import messages as m

    template = "{#" + "x" * 200_000 + "#}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    monkeypatch.setenv("CHAT_TEMPLATE", str(tmp_path / "t.jinja"))
    settings = load_settings(model_id=str(tmp_path), kv_backends="full", tool_call_parser="none")
    assert settings.chat_template == template
    env = {}
    popen = lambda argv, **kw: env.update(kw["env"])  # noqa: E731 - the core's environment, no process
    monkeypatch.setattr(core_host, "subprocess", types.SimpleNamespace(Popen=popen))
    core_host.CoreProcess(settings, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    assert "CHAT_TEMPLATE" not in env and "chat_template" not in env[m.SETTINGS_ENV]
    assert max(len(v) for v in env.values()) < 128 * 1024


def test_a_stream_a_stop_string_ended_closes_with_stop_when_the_core_dies_before_its_finished():
    """A stop string ends the stream on the HTTP side, which holds the last event until the core's ``Finished``; a
    core that dies meanwhile closes that stream with ``stop_sequence`` (its text is whole), and the others with an
    error, each counted once."""
    from server.engine.core_streams import _Live
    from server.engine.detokenize import IncrementalDetokenizer
    from server.engine.sequence import TokenEvent

    class Counted:
        def __init__(self):
            self.reasons = []

        def request_done(self, seq):
            self.reasons.append(seq.finish_reason)

    c = CoreClient(Settings(model_id=str(MODEL_DIR), kv_backends="full", device="cpu", dtype="float32",
                            log_level="warning", engine_process=False))
    c.recorder = Counted()
    loop = asyncio.new_event_loop()
    try:
        reqs = {}
        for rid, stopped in (("stopped", TokenEvent(0, 5, "Amen", 0.0, False)), ("running", None)):
            reqs[rid] = RequestState(request_id=rid, prompt_ids=[1], max_new_tokens=4, params=SamplingParams(),
                                     stop=[], backend_name="full", output_ids=[5])
            c._live[rid] = _Live(reqs[rid], IncrementalDetokenizer(None, [], set()), loop, loop.create_future(),
                                 stopped=stopped)
        c._died("the engine core process was killed by signal 9")
        events = {rid: req.events.get_nowait() for rid, req in reqs.items()}
        assert all(req.events.empty() for req in reqs.values())  # one closing event each
        assert events["stopped"].finish_reason == FinishReason.STOP and events["stopped"].text == "Amen"
        assert events["running"].finish_reason == FinishReason.ERROR and events["running"].error.endswith("signal 9")
        assert sorted(c.recorder.reasons) == sorted([FinishReason.STOP, FinishReason.ERROR])
    finally:
        loop.close()
        c.stop()
