"""The Makefile's installs: `make serve` installs the runtime dependencies only, with pip's progress shown;
`make test` installs the test extras, also after `make serve` (each has its stamp); `TORCH_INDEX_URL` picks
where torch comes from. Checked with `make -n` (what make would run) on a stand-in virtual environment."""

import os
import shutil
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")


def dry_run(target: str, venv, **variables: str) -> list[str]:
    args = ["make", "-n", "-C", str(REPO), target, f"VENV={venv}", *(f"{k}={v}" for k, v in variables.items())]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX_URL"}
    return subprocess.run(args, capture_output=True, text=True, check=True, env=env, timeout=60).stdout.splitlines()


def pip_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "-m pip install" in line]


@pytest.fixture
def venv(tmp_path):
    """A virtual environment's stand-in: bin/python newer than the dependency files, no stamp yet."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    return tmp_path


def test_serve_installs_the_runtime_dependencies_only_with_progress(venv):
    pip = pip_lines(dry_run("serve", venv))
    assert len(pip) == 1 and pip[0].endswith('-e ".[real]"')  # the whole test stack (2.6 GB) was installed here
    assert "--quiet" not in pip[0] and "-q" not in pip[0].split()
    assert pip_lines(dry_run("install", venv)) == pip


def test_test_after_serve_adds_the_test_extras(venv):
    (venv / ".kvserve-runtime").touch()  # `make serve` has run
    assert pip_lines(dry_run("serve", venv)) == []
    pip = pip_lines(dry_run("test", venv))
    assert len(pip) == 1 and pip[0].endswith('-e ".[test]"')
    (venv / ".kvserve-installed").touch()  # and `make test`: nothing left to install for either
    assert pip_lines(dry_run("test", venv)) == [] and pip_lines(dry_run("serve", venv)) == []


def test_torch_index_url_installs_torch_from_it_first(venv):
    url = "https://download.pytorch.org/whl/cpu"
    pip = pip_lines(dry_run("serve", venv, TORCH_INDEX_URL=url))
    assert len(pip) == 2 and f'--index-url "{url}" torch' in pip[0] and "-c constraints.txt" in pip[0]
