"""The folder of an engine core's sockets: one per server, ``kvserve-core-<server pid>-<random>`` in the temporary
directory, made at start and removed at exit. A server that cannot run its exit (SIGKILL, or a signal it does not
handle: SIGHUP when its terminal closes) has its folder removed by its janitor (:data:`JANITOR`), a small process
that outlives it; and :func:`new_socket_dir` first sweeps the folders left behind all the same (a janitor killed
with its server's process group)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile

log = logging.getLogger("kvserve.core_client")

SOCKET_DIR_PREFIX = "kvserve-core-"
"""The sockets' folder of a core process: ``kvserve-core-<server pid>-<random>`` in the temporary directory."""
_SOCKET_DIR = re.compile(re.escape(SOCKET_DIR_PREFIX) + r"(\d+)-[A-Za-z0-9_]+")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def sweep_socket_dirs(parent: str | None = None) -> list[str]:
    """Remove the sockets' folders (``kvserve-core-<pid>-*``) that servers now gone left in ``parent`` (the temporary
    directory): a server killed with SIGKILL cannot remove its own. Only this user's folders whose server pid no
    longer exists are removed (a folder whose pid was reused stays until that process is gone); the paths removed.
    """
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        match = _SOCKET_DIR.fullmatch(entry.name)
        try:
            if not match or not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != \
                    os.getuid() or _pid_alive(int(match.group(1))):
                continue
        except OSError:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    if removed:
        log.info("removed %d engine core socket folder(s) left by servers that are gone: %s", len(removed),
                 ", ".join(removed))
    return removed


JANITOR = """
import os, select, shutil, sys, time
server, folder, poll = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
try:
    gone = os.pidfd_open(server)
except (AttributeError, OSError):  # no pidfd (Linux < 5.3): the pid is polled
    gone = None
if os.getppid() != server:  # the server died before the pidfd was open: it may name another process
    shutil.rmtree(folder, ignore_errors=True)
    sys.exit(0)
if os.fork():
    sys.exit(0)  # the server reaps this one at once; the janitor is no child of the server
print(os.getpid(), flush=True)
os.close(1)
while os.path.isdir(folder):
    if gone is not None:
        if select.select([gone], [], [], poll)[0]:
            break
    else:
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            break
        except OSError:
            pass
        time.sleep(poll)
shutil.rmtree(folder, ignore_errors=True)
"""
"""The janitor's program (``python -c JANITOR SERVER_PID FOLDER POLL_S``; standard library only, so it starts in
milliseconds). It opens a pidfd of the server while it is still the server's child (so that a reused pid cannot
fool it), forks and lets the server reap its first process: the janitor is then no child of the server (whose
children a benchmark counts as the engine core's). It prints its pid, waits while the server lives and the folder
is there (a server that removed its own folder ends its janitor too), then removes the folder."""
JANITOR_POLL_S = 0.5
"""How often a janitor looks whether its folder is still there (seconds); the server's end wakes it at once."""
janitor_pids: list[int] = []
"""The janitors this process started."""


def _start_janitor(folder: str) -> None:
    """Start the janitor of ``folder`` (:data:`JANITOR`), in a session of its own (a terminal's SIGINT or SIGHUP to
    the server's process group does not end it before it has done its work); without one, the next start sweeps."""
    try:
        proc = subprocess.Popen([sys.executable, "-c", JANITOR, str(os.getpid()), folder, str(JANITOR_POLL_S)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True)
        with proc.stdout:
            pid = proc.stdout.readline().strip()
        proc.wait(10)
        janitor_pids.append(int(pid))
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        log.warning("cannot start the janitor of the engine core's socket folder (%s); a server killed with SIGKILL "
                    "leaves it to the next start", exc)


def new_socket_dir() -> str:
    """A new sockets' folder for this server's core (mode 0700, as :func:`tempfile.mkdtemp` makes it), after
    :func:`sweep_socket_dirs`, with its janitor (:func:`_start_janitor`); its path."""
    sweep_socket_dirs()
    folder = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
    _start_janitor(folder)
    return folder
