"""The Makefile's installs: `make serve` installs the runtime dependencies only, with pip's progress shown;
`make test` installs the test extras, also after `make serve` (each has its stamp); `TORCH_INDEX_URL` picks
where torch comes from; `make test-fast`'s selection (docs/development.md#test-tiers). Checked with `make -n`
(what make would run) on a stand-in virtual environment."""

import os
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")


def dry_run(target: str, venv, **variables: str) -> list[str]:
    args = ["make", "-n", "-C", str(REPO), target, f"VENV={venv}", *(f"{k}={v}" for k, v in variables.items())]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX_URL"}
    return subprocess.run(args, capture_output=True, text=True, check=True, env=env, timeout=60).stdout.splitlines()


def pip_lines(lines: list[str]) -> list[str]:
    """The install commands, pip's and uv's, in order."""
    return [line for line in lines if "pip install" in line]


def project_line(lines: list[str]) -> str:
    """The one command that installs kvserve itself (uv, falling back to pip)."""
    (line,) = [line for line in pip_lines(lines) if '-e ".[' in line]
    return line


@pytest.fixture
def venv(tmp_path):
    """A virtual environment's stand-in: bin/python newer than the dependency files, no stamp yet."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    return tmp_path


def test_serve_installs_the_runtime_dependencies_only_with_progress(venv):
    lines = dry_run("serve", venv)
    pip = pip_lines(lines)
    # pip takes torch (a machine's own wheel, or TORCH_INDEX_URL's), then uv the rest; pip where uv fails
    assert len(pip) == 2 and pip[0].endswith("-m pip install -c constraints.txt torch")
    line = project_line(lines)
    uv, fallback = line.split(" || ")
    # installing uv is inside the attempt: a mirror without uv's wheel falls back to pip too
    assert "-m pip install -c constraints.txt uv &&" in uv and "-m uv pip install" in uv, line
    assert "-c constraints.txt" in uv and '-e ".[real]"' in uv  # not ".[test]": the test stack is 2.6 GB
    assert "pip installs them instead" in fallback and '-m pip install -c constraints.txt -e ".[real]"' in fallback
    for command in pip:
        assert "--quiet" not in command and "-q" not in command.split(), command  # progress shown
    assert pip_lines(dry_run("install", venv)) == pip


def test_test_after_serve_adds_the_test_extras(venv):
    (venv / ".kvserve-runtime").touch()  # `make serve` has run
    assert pip_lines(dry_run("serve", venv)) == []
    assert '-m pip install -c constraints.txt -e ".[test]"; }' in project_line(dry_run("test", venv))
    (venv / ".kvserve-installed").touch()  # and `make test`: nothing left to install for either
    assert pip_lines(dry_run("test", venv)) == [] and pip_lines(dry_run("serve", venv)) == []


def test_torch_index_url_installs_torch_from_it_first(venv):
    url = "https://download.pytorch.org/whl/cpu"
    pip = pip_lines(dry_run("serve", venv, TORCH_INDEX_URL=url))
    assert len(pip) == 2 and f'--index-url "{url}" torch' in pip[0] and "-c constraints.txt" in pip[0]
    assert "--index-url" not in pip[1]  # the rest from the default index


def test_a_venv_path_with_a_space_is_refused(tmp_path):
    """make splits VENV at its spaces: the venv was made at the first word and `make clean` removed each word (a
    directory beside the one meant); now every target stops at once, naming the setting."""
    keep = tmp_path / "keep"
    keep.mkdir()
    args = ["make", "-C", str(REPO), "clean", f"VENV={keep} venv"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "VENV must be one path without spaces" in run.stderr, run.stderr
    assert keep.is_dir()


def test_the_installers_are_pinned():
    pins = [line.split("#")[0].strip() for line in (REPO / "constraints.txt").read_text().splitlines()]
    assert "torch==2.13.0" in pins and any(p.startswith("uv==") for p in pins)


TIER_CHECK = '''
import inspect


def _source(obj):
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def pytest_collection_finish(session):
    for item in session.items:
        defs = [d for ds in item._fixtureinfo.name2fixturedefs.values() for d in ds]
        code = [_source(getattr(item, "function", None))] + [_source(d.func) for d in defs]
        if any("RunningServer(" in text for text in code):
            print("STARTS-A-SERVER", item.nodeid)
        if "bfloat16" in item.nodeid or "float16" in item.nodeid:
            print("NOT-FP32", item.nodeid)
'''


def test_fast_tier_starts_no_server_and_runs_fp32_only(venv, tmp_path):
    """`make test-fast`'s own pytest command, collected (not run): no test in it starts a server, itself or through
    any fixture (found in the code, not by the marker the selection uses), and its value tests are fp32 only."""
    (venv / ".kvserve-installed").touch()
    (venv / ".kvserve-runtime").touch()
    (line,) = [line for line in dry_run("test-fast", venv) if "-m pytest" in line]
    words = shlex.split(line.split("-m pytest", 1)[1])
    args, skip = [], False
    for a in words:  # one -q below (one id a line), and collected in this process, not by xdist's workers
        if skip or a == "-q":
            skip = False
            continue
        skip = a in ("-n", "--dist")
        if not skip:
            args.append(a)
    assert "-n" in words, line  # the tier runs in TEST_WORKERS processes, as make test does
    env_part = line.split("-m pytest", 1)[0].split()
    assert env_part[0] == "DTYPE=${DTYPE:-float32}", line
    (tmp_path / "tier_check.py").write_text(TIER_CHECK)
    env = {**os.environ, "DTYPE": "float32", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    env.pop("DEVICE", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tier_check", *args],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    flagged = [line for line in out.stdout.splitlines() if line.startswith(("STARTS-A-SERVER", "NOT-FP32"))]
    assert flagged == []
    selected = [line for line in out.stdout.splitlines() if "::" in line]
    assert len(selected) > 300 and not any("test_real_model.py" in s or "test_docker.py" in s for s in selected)
