"""Client tools that cannot share the project's venv (another Python, or pins that clash with the project's),
each installed once (with uv where the project's venv has it, else pip) into its own venv under the git-ignored
``.venv-clients/<name>`` and run as a subprocess.

A venv is made with the first interpreter in the tool's Python range: the one running the tests, then
``python3.X`` on PATH, then pyenv's versions. A stamp file holds the requirement it was made for; a changed pin
remakes it. Without a suitable interpreter the calling test skips, saying so.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port

CLIENTS = REPO / ".venv-clients"
INSTALL_TIMEOUT = 1200  # seconds: a cold pip install of a tool and its dependencies


def _version(python: str) -> tuple[int, int] | None:
    """The interpreter's (major, minor), or None when it does not run (a pyenv shim for a version that is
    not selected exits non-zero)."""
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    try:
        major, minor = map(int, out.stdout.split())
    except ValueError:
        return None
    return major, minor


def find_python(lowest: tuple[int, int], below: tuple[int, int] = (4, 0)) -> str | None:
    """The first interpreter with ``lowest <= (major, minor) < below`` that runs: this one, then
    ``python3.11`` ... ``python3.14`` on PATH, then pyenv's versions (``$PYENV_ROOT``, else ``~/.pyenv``)."""
    candidates = [sys.executable]
    candidates += [p for minor in range(11, 15) if (p := shutil.which(f"python3.{minor}"))]
    root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates += sorted(glob.glob(f"{root}/versions/*/bin/python3.1[0-9]"))
    for python in candidates:
        version = _version(python)
        if version and lowest <= version < below:
            return python
    return None


def client_script(name: str, requirement: str, script: str, lowest: tuple[int, int],
                  below: tuple[int, int] = (4, 0)) -> Path:
    """The path of ``script`` in the venv ``.venv-clients/<name>`` holding ``requirement`` (``"tool==1.2.3"``),
    made (or remade, when the requirement changed) here. Skips the test when no interpreter in
    ``[lowest, below)`` is found; raises RuntimeError with pip's output when the install fails."""
    venv = CLIENTS / name
    stamp = venv / ".kvserve-installed"
    exe = venv / "bin" / script
    if stamp.exists() and stamp.read_text().strip() == requirement and exe.exists():
        return exe
    python = find_python(lowest, below)
    if python is None:
        wanted = f">= {'.'.join(map(str, lowest))}" + (f", < {'.'.join(map(str, below))}" if below < (4, 0) else "")
        pytest.skip(f"{requirement} needs Python {wanted}: none found (this one, python3.X on PATH, "
                    f"~/.pyenv/versions)")
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
    target = str(venv / "bin" / "python")
    # uv (the project's installer, `make install`) where this venv has it: seconds where pip took a minute (aiperf:
    # 66 s); the venv's pip where uv is missing or fails
    installers = [[target, "-m", "pip", "install"]]
    if importlib.util.find_spec("uv") is not None:
        installers.insert(0, [sys.executable, "-m", "uv", "pip", "install", "--python", target])
    for installer in installers:
        install = subprocess.run([*installer, "-q", requirement], capture_output=True, text=True,
                                 timeout=INSTALL_TIMEOUT)
        if install.returncode == 0:
            break
    else:
        raise RuntimeError(f"pip install {requirement} failed:\n{install.stdout[-3000:]}\n{install.stderr[-3000:]}")
    stamp.write_text(requirement + "\n")
    return exe


def subprocess_env(**changes: str | None) -> dict[str, str]:
    """This process's environment for a tool in its own venv: without ``VIRTUAL_ENV`` (the project's), with
    ``changes`` applied (``None`` removes a variable)."""
    env = {**os.environ}
    env.pop("VIRTUAL_ENV", None)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def closed_url() -> str:
    """``http://127.0.0.1:<port>`` with nothing listening (a port just freed): a request there fails at once,
    where a hub lookup with no network may wait for a timeout."""
    return f"http://127.0.0.1:{free_port()}"
