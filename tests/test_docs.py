"""The documentation site builds with ``mkdocs build --strict``: a broken link or anchor, a missing page, or a
page left out of the navigation fails the build (mkdocs.yml's ``validation``), and so this test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.conftest import REPO


def test_docs_build_strict(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(REPO / ".venv" / "bin")) or shutil.which("mkdocs")
    cmd = [mkdocs] if mkdocs else [sys.executable, "-m", "mkdocs"]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor
    p = subprocess.run([*cmd, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    for page in ("index.html", "ui/index.html", "configuration/index.html", "http-api/index.html",
                 "backends/index.html", "benchmarks/index.html", "own-model/index.html", "deploy/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    assert (tmp_path / "site" / "img" / "ui-compare.png").is_file()


def test_readme_links_lead_somewhere():
    """The README is read outside the site (on a forge, in the checkout): its relative links name files that
    exist, and its in-page anchors headings it has."""
    import re

    readme = (REPO / "README.md").read_text()
    anchors = {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", readme, re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if target.startswith("http"):
            continue
        path, _, anchor = target.partition("#")
        if path:
            assert (REPO / path).exists(), target
        elif anchor:
            assert anchor in anchors, target
    assert len(readme.splitlines()) <= 300


def test_advise_example_is_what_advise_prints(capsys, monkeypatch):
    """docs/backends.md's `kvserve advise` example: each line shown (the elided ones aside) is printed so."""
    import re
    import shlex

    from server.cli import main

    page = (REPO / "docs" / "backends.md").read_text()
    block = re.search(r"```\n\$ (kvserve advise [^\n]+)\n(.*?)\n```", page, re.S)
    assert block, "docs/backends.md shows a kvserve advise run"
    monkeypatch.chdir(REPO)  # the example names docs/bench/results.json from the repository's root
    assert main(shlex.split(block[1])[1:]) == 0
    printed = capsys.readouterr().out.splitlines()
    for line in block[2].splitlines():
        if line.strip() != "...":
            assert line in printed, line
