"""The code's shape (issue #43): no module of the served packages, ``server`` and ``cache_backends``, is over
:data:`MAX_LINES` lines; a longer one holds more than one idea and is split by idea into modules with one job."""

from __future__ import annotations

from tests.conftest import REPO

MAX_LINES = 500
PACKAGES = ("server", "cache_backends")


def long_modules(root=REPO, limit: int = MAX_LINES) -> list[str]:
    """Each ``.py`` file of :data:`PACKAGES` under ``root`` over ``limit`` lines, as ``path (lines)``."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > limit:
                out.append(f"{path.relative_to(root)} ({lines})")
    return out


def test_no_module_is_over_the_line_limit():
    found = long_modules()
    assert not found, f"over {MAX_LINES} lines (split each by idea):\n" + "\n".join(f"  {f}" for f in found)


def test_the_line_check_finds_a_planted_long_module(tmp_path):
    (tmp_path / "server").mkdir()
    (tmp_path / "cache_backends" / "x").mkdir(parents=True)
    (tmp_path / "server" / "short.py").write_text("pass\n" * MAX_LINES)
    (tmp_path / "cache_backends" / "x" / "long.py").write_text("pass\n" * (MAX_LINES + 1))
    assert long_modules(tmp_path) == [f"cache_backends/x/long.py ({MAX_LINES + 1})"]
