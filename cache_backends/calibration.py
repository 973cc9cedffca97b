"""Calibration data for backends that fit something on the model (``gqa`` pca, ``mla``, ``dca``).

The text comes from, in order: an explicit file (``KV_CALIBRATION_FILE``: plain text, chapters separated
by blank lines, or ``.jsonl`` with one ``{"text": ...}`` per line), the model folder's
``calib_slice.txt``, or the public-domain default shipped in the package
(``cache_backends/data/calibration.txt``: chapters of the King James Bible), so any model folder can
be calibrated. :func:`collect_kv` runs the model over it in windows and returns each layer's keys
(before RoPE) and values, exactly what the model writes to its cache.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from cache_backends.full.backend import FullBackend
from cache_backends.rope import RopeTable

CALIB_SLICE = "calib_slice.txt"
CALIBRATION_WINDOW = 1024  # tokens per forward pass over the calibration text (one sequence each)


DEFAULT_TEXT = Path(__file__).parent / "data" / "calibration.txt"
DEFAULT_EVAL_TEXT = Path(__file__).parent / "data" / "evaluation.txt"
"""Held-out chapters of the same public-domain text, none of them in :data:`DEFAULT_TEXT`: what the benchmarks
score a model folder on when it has no ``eval_slice.txt``."""
EVAL_SLICE = "eval_slice.txt"


def slice_file(model_dir: str | Path, name: str) -> Path:
    """The model folder's slice ``name`` (``calib_slice.txt`` or ``eval_slice.txt``) when it has one, else the
    packaged text of that role (:data:`DEFAULT_TEXT`, :data:`DEFAULT_EVAL_TEXT`), so a plain model folder (a
    converted pretrained model) needs no extra files.

    Raises:
        ValueError: for another name.
    """
    if name not in (CALIB_SLICE, EVAL_SLICE):
        raise ValueError(f"no packaged text for {name!r}")
    beside = Path(model_dir) / name
    return beside if beside.is_file() else (DEFAULT_TEXT if name == CALIB_SLICE else DEFAULT_EVAL_TEXT)


def calibration_file(model, path: str | Path | None = None) -> Path:
    """The calibration text to use: ``path`` if given, else the model folder's ``calib_slice.txt``, else the
    packaged default.

    Raises:
        FileNotFoundError: if ``path`` is given and does not exist.
    """
    if path:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"KV_CALIBRATION_FILE={path} not found")
        return path
    beside = Path(model.name_or_path) / CALIB_SLICE
    return beside if beside.is_file() else DEFAULT_TEXT


def slice_token_ids(path: str | Path, tokenizer) -> list[int]:
    """Token ids of a slice file: each blank-line-separated chapter, then the end-of-text token (when the
    tokenizer has one).

    Args:
        path: a slice file (chapters separated by ``"\\n\\n"``).
        tokenizer: a Hugging Face tokenizer whose ``eos_token_id`` marks the end of a chapter.

    Returns:
        A flat list of token ids (about 20k for the shipped slices).
    """
    text = Path(path).read_text(encoding="utf-8")
    ids: list[int] = []
    for chapter in text.split("\n\n"):
        chapter = chapter.strip("\n")
        if chapter:
            ids.extend(tokenizer.encode(chapter, add_special_tokens=False, verbose=False))  # chapters may exceed the context
            if tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
    return ids


def calibration_ids(model, tokenizer=None, max_tokens: int = 20_000, path: str | Path | None = None) -> list[int]:
    """Token ids of the calibration text (:func:`calibration_file`): each chapter (or jsonl record) then
    the end-of-text token, at most ``max_tokens``.

    Raises:
        FileNotFoundError: if an explicit ``path`` does not exist.
        ValueError: if a ``.jsonl`` line has no string ``"text"``, or the text yields no tokens.
    """
    import json

    from transformers import AutoTokenizer

    source = calibration_file(model, path)
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(model.name_or_path)
    if source.suffix == ".jsonl":
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids: list[int] = []
        for n, line in enumerate(filter(str.strip, source.read_text(encoding="utf-8").splitlines()), 1):
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{source}: line {n} has no string field \"text\"")
            ids += tokenizer.encode(record["text"], add_special_tokens=False) + eos
            if len(ids) >= max_tokens:
                break
    else:
        ids = slice_token_ids(source, tokenizer)
    if not ids:
        raise ValueError(f"{source}: the calibration text yields no tokens")
    return ids[:max_tokens]


_LAST: tuple[tuple, list] | None = None  # the latest result, reused when several backends calibrate one model


@torch.no_grad()
def collect_kv(model, geometry, token_ids: list[int], window: int = CALIBRATION_WINDOW, desc: str = "calibrating"):
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
    from cache_backends.attention import install

    install(model)  # the full store below is read by kvserve's attention function
    rope = RopeTable(model, window)
    full = FullBackend(geometry)
    device = next(model.parameters()).device
    keys = [[] for _ in range(geometry.num_layers)]
    values = [[] for _ in range(geometry.num_layers)]
    for start in tqdm(range(0, len(token_ids), window), desc=desc, leave=False, disable=None):
        chunk = token_ids[start : start + window]
        store = full.new_store()
        model(input_ids=torch.tensor([chunk], device=device), cache=store, use_cache=True, logits_to_keep=1)
        for i, layer in enumerate(store.layers):
            layer_keys, layer_values = layer.materialize()  # (1, heads, tokens, head_dim) views
            k = rope.invert(layer_keys, 0)[0].transpose(0, 1)  # (tokens, heads, head_dim)
            keys[i].append(k.float().cpu())
            values[i].append(layer_values[0].transpose(0, 1).float().cpu())
    return [(torch.cat(k), torch.cat(v)) for k, v in zip(keys, values)]
