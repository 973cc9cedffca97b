"""Where the engine core runs (``ENGINE_PROCESS``): its own process, or a thread of the HTTP process.

Either way the core is :func:`server.engine.core.load_and_serve` on two ZMQ sockets connected to the client's
(:class:`server.engine.core_client.CoreClient`), and the client sees the same three things of it: whether it
has ended and why (:meth:`CoreProcess.ended`), a wait for its end, and a last resort when it does not end.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import zmq

from server.engine import messages as m

log = logging.getLogger("kvserve.core_client")

OUTBOX_LINGER_MS = 2000
"""How long the core's output socket may hold its last messages (its ``Failed``, its last step) at close (ms)."""
SERVER_ONLY = ("api_key", "api_key_file", "chat_template", "tool_call_parser")
"""Settings a core process is not given, in its settings or its environment (``API_KEY``, ``API_KEY_FILE``,
``CHAT_TEMPLATE``, ``TOOL_CALL_PARSER``, in any case): the HTTP side checks the key, renders chats and parses tool
calls; the core, whose environment other tools read (``/proc/<pid>/environ``, crash reports), never needs the key,
and a chat template's text can pass the 128 KiB the kernel allows one environment string."""


class CoreProcess:
    """``python -m server.engine.core IN_ADDR OUT_ADDR`` with the settings in its environment; it connects to the
    client's ``ipc://`` sockets and exits when the HTTP process is gone.

    Args:
        settings: the server's :class:`~server.config.Settings` (sent as JSON: the fields that were given alone,
            so that the core's rebuilt settings tell a given option from a default as this process's do; the
            quality budget searches only options left at their defaults, ``Settings.explicit_options``), less
            :data:`SERVER_ONLY`.
        in_addr, out_addr: the client's bound addresses, for the core's inputs and its outputs.
    """

    def __init__(self, settings, in_addr: str, out_addr: str):
        # every field dumped would be a field set in the core: explicit_options would name every option there
        given = settings.model_dump_json(exclude_unset=True, exclude=set(SERVER_ONLY))  # the rest are the defaults
        env = {name: value for name, value in os.environ.items() if name.lower() not in SERVER_ONLY}
        env.update({m.SETTINGS_ENV: given, m.PARENT_ENV: str(os.getpid())})
        # a session of its own: a terminal's Ctrl-C (SIGINT to the foreground process group) reaches the server,
        # which drains and then ends the core; the core ignores SIGINT and SIGTERM sent to it all the same
        # (systemd's control-group kill), and ends with its server (server.engine.core.main)
        self.proc = subprocess.Popen([sys.executable, "-m", "server.engine.core", in_addr, out_addr], env=env,
                                     start_new_session=True)

    def ended(self) -> str | None:
        """``None`` while the process runs; once it has exited, why, in one line."""
        code = self.proc.poll()
        if code is None:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"the engine core process {how}"

    def stopped(self) -> bool:
        """Whether the process is stopped by a signal (SIGSTOP, SIGTSTP) or a tracer: state ``T`` or ``t`` in
        ``/proc/<pid>/stat`` (Linux; ``False`` where that cannot be read)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
        except (OSError, IndexError):
            return False

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the process to exit; whether it has."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self, timeout: float) -> None:
        """Kill the process (it did not end when asked) and reap it."""
        self.proc.kill()
        self.proc.wait(timeout)


class CoreThread:
    """The engine core in a daemon thread of this process, on ``inproc://`` sockets of the client's ZMQ context
    (inproc connects only within one context); it watches no parent process.

    Args:
        settings: the server's :class:`~server.config.Settings`.
        ctx: the client's ZMQ context.
        in_addr, out_addr: the client's bound addresses, for the core's inputs and its outputs.
    """

    def __init__(self, settings, ctx: zmq.Context, in_addr: str, out_addr: str):
        self.settings = settings
        self.reason: str | None = None
        """Why the thread ended, set by the thread itself as its last act."""
        self.thread = threading.Thread(target=self._run, args=(ctx, in_addr, out_addr), name="kvserve-engine-core",
                                       daemon=True)
        self.thread.start()

    def _run(self, ctx: zmq.Context, in_addr: str, out_addr: str) -> None:
        from server.engine.core import load_and_serve  # the model's libraries: only where the core runs

        inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)  # made here: a socket is its thread's alone
        inbox.connect(in_addr)
        outbox.connect(out_addr)
        outbox.setsockopt(zmq.LINGER, OUTBOX_LINGER_MS)
        try:
            code = load_and_serve(self.settings, inbox, outbox)
            self.reason = f"the engine core thread ended with status {code}"
        except BaseException as exc:  # noqa: BLE001 - reported to the client as the core's death
            log.exception("the engine core thread failed")
            self.reason = f"the engine core thread failed: {type(exc).__name__}: {' '.join(str(exc).split())}"
        finally:
            outbox.close()
            inbox.close(0)

    def ended(self) -> str | None:
        """``None`` while the thread runs; once it has ended, why, in one line."""
        if self.thread.is_alive():
            return None
        return self.reason or "the engine core thread ended"

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end; whether it has."""
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def kill(self, timeout: float) -> None:
        """A thread cannot be killed: it is left to end with the process (its sockets keep the context open)."""
        log.warning("the engine core thread did not end when asked; it ends with the process")


def start_core(settings, ctx: zmq.Context, in_addr: str, out_addr: str) -> CoreProcess | CoreThread:
    """Start the engine core where ``settings.engine_process`` says: its own process (``true``) or a thread."""
    if settings.engine_process:
        return CoreProcess(settings, in_addr, out_addr)
    return CoreThread(settings, ctx, in_addr, out_addr)
