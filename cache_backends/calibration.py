"""Calibration data for backends that fit something on the model (``gqa`` pca, ``mla``).

Runs the model over the calibration slice shipped beside the model (``calib_slice.txt``) in windows and
returns each layer's keys (before RoPE) and values, exactly what the model writes to its cache.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from cache_backends.full import FullBackend
from cache_backends.rope import RopeTable

CALIB_SLICE = "calib_slice.txt"


def calibration_ids(model, tokenizer=None, max_tokens: int = 20_000) -> list[int]:
    """Token ids of the calibration slice next to the model (``model.name_or_path``).

    Raises:
        FileNotFoundError: if the model folder has no ``calib_slice.txt``.
    """
    from transformers import AutoTokenizer

    from bench.quality import slice_token_ids

    folder = Path(model.name_or_path)
    path = folder / CALIB_SLICE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: calibration needs the model's calibration slice")
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(folder)
    return slice_token_ids(path, tokenizer)[:max_tokens]


_LAST: tuple[tuple, list] | None = None  # the latest result, reused when several backends calibrate one model


@torch.no_grad()
def collect_kv(model, geometry, token_ids: list[int], window: int = 1024, desc: str = "calibrating"):
    """Each layer's pre-RoPE keys and values over ``token_ids`` (the latest call's result is reused).

    Returns:
        A list (one per layer) of ``(keys, values)``, each of shape
        (tokens, num_key_value_heads, head_dim), float32, on the CPU. Treat as read-only.
    """
    global _LAST
    key = (id(model), len(token_ids), hash(tuple(token_ids)), window)
    if _LAST is not None and _LAST[0] == key:
        return _LAST[1]
    result = _collect(model, geometry, token_ids, window, desc)
    _LAST = (key, result)
    return result


def _collect(model, geometry, token_ids, window, desc):
    rope = RopeTable(model, window)
    full = FullBackend(geometry)
    device = next(model.parameters()).device
    keys = [[] for _ in range(geometry.num_layers)]
    values = [[] for _ in range(geometry.num_layers)]
    for start in tqdm(range(0, len(token_ids), window), desc=desc, leave=False):
        chunk = token_ids[start : start + window]
        store = full.new_store()
        model(input_ids=torch.tensor([chunk], device=device), cache=store, use_cache=True, logits_to_keep=1)
        for i, layer in enumerate(store.layers):
            layer_keys, layer_values = layer.materialize()  # (1, heads, tokens, head_dim) views
            k = rope.invert(layer_keys, 0)[0].transpose(0, 1)  # (tokens, heads, head_dim)
            keys[i].append(k.float().cpu())
            values[i].append(layer_values[0].transpose(0, 1).float().cpu())
    return [(torch.cat(k), torch.cat(v)) for k, v in zip(keys, values)]
