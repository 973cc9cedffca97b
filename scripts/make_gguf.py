"""Convert a kvserve model folder to GGUF with llama.cpp's own converter, to measure llama.cpp on the same weights.

    python scripts/make_gguf.py --llama-src /path/to/llama_cpp_python-X.tar.gz-or-dir \\
        --model models/kjv-llama-mha --out /tmp/kjv-llama-mha-f32.gguf

``--llama-src`` is the ``llama-cpp-python`` source distribution (``pip download --no-binary :all: --no-deps
llama-cpp-python``), a tarball or its unpacked folder: its ``vendor/llama.cpp/convert_hf_to_gguf.py`` and
``gguf-py`` do the conversion. The converter recognises a BPE pre-tokenizer by hashing its output on a fixed
text; kvserve's tokenizer is byte-level BPE without a regex split of its own (GPT-2's scheme), which the
converter does not know by hash, so it is declared ``gpt-2`` here. The GGUF keeps the weights in
``--outtype`` (default f32, as the server runs them on CPU).
"""

from __future__ import annotations

import argparse
import sys
import tarfile
import tempfile
from pathlib import Path


def vendored_llama_cpp(src: Path, scratch: Path) -> Path:
    """The ``vendor/llama.cpp`` folder of the sdist (unpacking a tarball into ``scratch``).

    Raises:
        SystemExit: if the converter is not found.
    """
    if src.is_file():
        with tarfile.open(src) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name and
                       any(part in m.name for part in ("convert_hf_to_gguf.py", "/gguf-py/", "/conversion/"))]
            tar.extractall(scratch, members=members, filter="data")
        src = scratch
    found = sorted(src.rglob("vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found:
        raise SystemExit(f"no vendor/llama.cpp/convert_hf_to_gguf.py under {src}")
    return found[0].parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-src", required=True, type=Path)
    p.add_argument("--model", default="models/kjv-llama-mha")
    p.add_argument("--out", required=True)
    p.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = vendored_llama_cpp(args.llama_src, Path(scratch))
        sys.path[:0] = [str(root / "gguf-py"), str(root)]
        import convert_hf_to_gguf as conv
        from conversion.base import TextModel

        TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
        sys.argv = ["convert_hf_to_gguf.py", args.model, "--outfile", args.out, "--outtype", args.outtype]
        conv.main()


if __name__ == "__main__":
    main()
