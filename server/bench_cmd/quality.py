"""Held-out text slices and teacher-forced perplexity, shared by training, tests and benchmarks.

The reference model ships two text files beside its weights: ``eval_slice.txt`` (held-out chapters)
and ``calib_slice.txt`` (training chapters). Chapters are separated by one blank line; each chapter is
tokenized on its own and followed by the end-of-text token, exactly as in training, so every
measurement in the project sees the same token stream.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from cache_backends.calibration import CALIB_SLICE, EVAL_SLICE, slice_file
from cache_backends.calibration import slice_token_ids  # noqa: F401  (re-exported: bench and tests use it)


def model_slice_ids(model_dir: str | Path, name: str, tokenizer) -> list[int]:
    """Token ids of the model folder's ``name`` slice (``EVAL_SLICE`` or ``CALIB_SLICE``), or of the packaged
    text of that role when the folder has none (:func:`cache_backends.calibration.slice_file`)."""
    return slice_token_ids(slice_file(model_dir, name), tokenizer)


@torch.no_grad()
def teacher_forced_perplexity(model, token_ids: list[int], window: int = 1024) -> float:
    """Perplexity of ``token_ids`` under ``model`` with non-overlapping windows, one full forward each.

    Each window of ``window`` tokens predicts its last ``window - 1`` tokens; the result is
    ``exp(mean negative log-likelihood)`` over every predicted token of every window. A trailing
    window shorter than 2 tokens is dropped.

    Args:
        model: a causal LM returning ``logits`` of shape (batch, seq_len, vocab_size).
        token_ids: the token stream (e.g. from :func:`slice_token_ids`).
        window: tokens per forward pass (at most the model's ``max_position_embeddings``).

    Returns:
        The perplexity (a float >= 1).
    """
    device = next(model.parameters()).device
    total_nll, total_count = 0.0, 0
    for start in range(0, len(token_ids), window):
        chunk = token_ids[start : start + window]
        if len(chunk) < 2:
            break
        ids = torch.tensor([chunk], device=device)  # (1, seq_len)
        logits = model(input_ids=ids).logits.float()  # (1, seq_len, vocab_size)
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
        total_nll += nll.item()
        total_count += len(chunk) - 1
    return math.exp(total_nll / total_count)
