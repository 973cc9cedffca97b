"""``kvserve serve`` as a user runs it at a terminal: Ctrl-C, a mistyped flag, a host that does not resolve."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import MODEL_DIR, REPO, RunningServer, free_port


def test_ctrl_c_exits_130_with_no_traceback():
    """Ctrl-C printed ~30 lines of asyncio CancelledError ... KeyboardInterrupt after uvicorn's clean
    "Finished server process"; like uvicorn and vLLM it now stops quietly (status 130: stopped by SIGINT)."""
    # A shell without job control starts background jobs with SIGINT ignored, and the server would inherit that:
    # it is started with Python's own SIGINT handler, as from a terminal.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        srv = RunningServer({"LOG_LEVEL": "info"})
    finally:
        signal.signal(signal.SIGINT, inherited)
    try:
        srv.proc.send_signal(signal.SIGINT)
        code = srv.proc.wait(60)
    finally:
        srv.stop()
    log = srv.proc.stdout.read()
    assert code == 130, (code, log[-3000:])
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    assert "Finished server process" in log, log[-3000:]


@pytest.mark.parametrize("args,line", [
    (["serve", "--nosuch"], "kvserve serve: error: unrecognized arguments: --nosuch (see kvserve serve --help)"),
    (["serve", "--bogus-flag", "1"], "kvserve serve: error: unrecognized arguments: --bogus-flag 1 (see kvserve "
     "serve --help)"),
    (["estimate", "--nosuch"], "kvserve estimate: error: unrecognized arguments: --nosuch (see kvserve estimate "
     "--help)"),
    (["serve", "--port"], "kvserve serve: error: argument --port: expected one argument (see kvserve serve --help)"),
    (["nosuch"], "kvserve: error: argument command: invalid choice: 'nosuch' (choose from 'serve', 'calibrate', "
     "'estimate', 'advise', 'fetch-model', 'bench') (see kvserve --help)"),
])
def test_an_unknown_flag_is_one_line_naming_it(args, line):
    """``kvserve serve --nosuch`` printed serve's usage, 29 lines, above the error (before that the top-level
    usage): one line names the subcommand and the flag, and where the flags are listed."""
    proc = subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [line] and proc.stdout == ""


def test_a_host_that_does_not_resolve_exits_2_naming_host():
    """``--host 256.1.1.1`` loaded the model, then failed in uvicorn with ``[Errno -2] Name or service not known``
    (exit 3) naming no setting."""
    env = {**os.environ, "MODEL_ID": str(MODEL_DIR), "PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--host", "256.1.1.1"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvserve: HOST (--host) '256.1.1.1' is not an address"), lines


def test_the_command_line_parser_imports_no_torch():
    """`kvserve serve --help` and a bad flag answer at once: building every subcommand's parser imports neither
    torch nor transformers (they took 10-20 s to import on a busy 2-core CPU before `--help` printed)."""
    code = ("import sys; from server.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
