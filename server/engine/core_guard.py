"""``python -m server.engine.core_guard CORE_PID SERVER_PID GRACE_S``: the engine core process's guard, a small
process of its own that kills the core (SIGKILL) once the core's server process has been gone for ``GRACE_S``
seconds, and ends when the core ends.

The core ends itself when its server is gone (:func:`server.engine.core.watch_parent`, a thread that logs why),
but a thread runs only while the interpreter lets it: a main thread blocked in a call that keeps the interpreter's
lock (a C extension opening a named pipe, a kernel that never returns) stops it too, and the core outlived its
server, ignoring SIGTERM. This process shares no lock with the core. Standard library only, and nothing of the
server's is imported, so it starts in milliseconds and holds a few megabytes.

The server is gone when the core's parent is no longer ``SERVER_PID`` (``/proc/<core>/stat``: the core is then
re-parented, which a reused pid cannot undo); without ``/proc``, when ``SERVER_PID`` no longer exists.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.5
"""How often the guard looks (seconds)."""


def parent_of(pid: int) -> int | None:
    """``pid``'s parent process id from ``/proc`` (Linux), or ``None`` where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def server_gone(core: int, server: int) -> bool:
    parent = parent_of(core)
    if parent is not None:
        return parent != server
    try:
        os.kill(server, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: it exists
        return False
    return False


def guard(core: int, server: int, grace_s: float, poll_s: float = POLL_S) -> int:
    """Watch until the core ends (0), or kill it once its server has been gone for ``grace_s`` seconds (1)."""
    gone_since: float | None = None
    while os.getppid() == core:
        if server_gone(core, server):
            now = time.monotonic()
            gone_since = now if gone_since is None else gone_since
            if now - gone_since >= grace_s:
                os.write(2, (f"kvserve: the engine core (pid {core}) did not end within {grace_s:g} s of its server "
                             f"(pid {server}); killing it\n").encode())
                try:
                    os.kill(core, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return 1
        time.sleep(poll_s)
    return 0


def main(argv: list[str] | None = None) -> int:
    core, server, grace_s = (argv if argv is not None else sys.argv[1:])[:3]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as the core: a terminal's Ctrl-C is the server's to handle
    return guard(int(core), int(server), float(grace_s))


if __name__ == "__main__":
    sys.exit(main())
