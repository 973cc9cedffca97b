"""Loading the served model and tokenizer (offline-capable: a local folder needs no network)."""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cache_backends.attention import install as install_attention

log = logging.getLogger("kvserve.model")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    """``auto`` → ``cuda`` when available, else ``cpu``.

    Raises:
        ValueError: if ``cuda`` is asked for and none is available.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("DEVICE=cuda but no CUDA device is available; allowed here: auto, cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` → float32 on CPU (fast and exact there), bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def load_model(model_id: str, device: torch.device, dtype: torch.dtype):
    """Load ``(model, tokenizer)`` in eval mode on ``device`` with ``dtype`` and kvserve's attention function
    (SDPA for plain K/V, in-place reads for kvserve's caches: :mod:`cache_backends.attention`).

    transformers' hub kernels stay off (``use_kernels=False``): they replace layers with code fetched from the Hub
    on first use, which an offline server cannot do, and kvserve's attention path is its own."""
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, attn_implementation="sdpa", use_kernels=False)
    model.to(device).eval()
    install_attention(model)
    log.info("loaded %s on %s (%s)", model_id, device, dtype)
    return model, tokenizer
