"""The folder of an engine core's sockets: one per server, ``kvserve-core-<server pid>-<random>`` in the temporary
directory, made at start and removed at exit; :func:`new_socket_dir` first sweeps the folders that servers killed
with SIGKILL (which cannot remove their own) left behind."""

from __future__ import annotations

import logging
import os
import re
import shutil
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


def new_socket_dir() -> str:
    """A new sockets' folder for this server's core (mode 0700, as :func:`tempfile.mkdtemp` makes it), after
    :func:`sweep_socket_dirs`; its path."""
    sweep_socket_dirs()
    return tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
