"""The estimator's sums: bytes per token per layer for a backend spec named as ``kvserve estimate`` takes it.

A name and its options (``("gqa+int8", {"groups": 2})``) become the :class:`cache_backends.kv_spec.KVSpec` the
served backend holds (:func:`kv_spec`), and its bytes come from the same methods the pool, admission, ``/info``
and the metrics read (:meth:`cache_backends.kv_spec.KVSpec.bytes_per_token_per_layer`), so a served backend
(:meth:`cache_backends.base.KVBackend.kv_spec`) and the estimator give one number. Every sum is exact: it
counts what a sequence holds at ``seq_len`` tokens (codes, scales, zero points, the full-precision residual
window, latents, shared heads), at every length, not only asymptotically.
The one input that is not a config value is ``dca``'s share of reused layers: the estimator takes it
as a parameter, a served backend uses its calibrated share, and a live sequence its own
(:func:`dca_store_bytes_per_token_per_layer`). Units are bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache_backends.kv_spec import Axis, KVSpec, Quantization, StreamSpec
from cache_backends.spec import budget_hint, check_composition, default_gqa_groups


def dca_window_tokens(seq_len: int, window: int) -> int:
    """Tokens a ``dca`` reuse layer's residual window holds at ``seq_len`` tokens: the newest
    ``min(seq_len, window + seq_len % window)`` (0 without a window)."""
    return min(seq_len, window + seq_len % window) if window > 0 else 0


def dca_store_bytes_per_token_per_layer(own_tokens: Sequence[int], seq_len: int,
                                        inner: Callable[[int], float]) -> float:
    """``dca`` for one live sequence, from the tokens each of its layers stores itself.

    Args:
        own_tokens: per layer, the tokens it holds in the inner backend's form: ``seq_len`` for a kept
            layer, 0 for a reuse layer, ``seq_len - p`` for a reuse layer that fell back at position p.
        seq_len: tokens in the sequence.
        inner: the inner backend's bytes per token per layer at a given length (a fallen-back layer's
            own cache starts at p, so an int8 inner's residual window is counted at its own length).

    Returns:
        Average bytes per token per layer over all layers at ``seq_len`` tokens.
    """
    return sum(inner(n) * n for n in own_tokens if n) / (len(own_tokens) * max(seq_len, 1))


def layer_windows_of(get: Callable[[str], object], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window from a model config's fields (``get(name)``: the field or ``None``), as
    transformers' attention modules pass it (``None``: a global layer): ``sliding_window`` on the layers
    ``layer_types`` calls ``"sliding_attention"`` (Gemma 2/3, Qwen 2.5), or on every layer without ``layer_types``
    (Mistral) unless ``use_sliding_window`` is false. A window at least ``max_position_embeddings`` long masks
    nothing and counts as none; empty when no layer has a window."""
    window = get("sliding_window")
    if not isinstance(window, int) or window < 1 or get("use_sliding_window") is False:
        return ()
    positions = get("max_position_embeddings")
    if isinstance(positions, int) and window >= positions:
        return ()
    types = get("layer_types")
    windows = tuple(window if t == "sliding_attention" else None for t in types) if types else (window,) * num_layers
    return windows if any(w is not None for w in windows) else ()


def rope_per_layer_type_of(get: Callable[[str], object]) -> bool:
    """Whether a model config (``get(name)``: a field or ``None``) rotates its layer types with different RoPE
    parameters: ``rope_parameters`` keyed by the names in ``layer_types`` with two or more distinct values
    (transformers 5), or a ``rope_local_base_freq`` other than ``rope_theta`` (Gemma 3's older configs)."""
    params, types = get("rope_parameters"), get("layer_types")
    if isinstance(params, dict) and types and all(t in params for t in set(types)):
        return len({repr(sorted(params[t].items())) for t in set(types)}) > 1
    local = get("rope_local_base_freq")
    return local is not None and local != get("rope_theta")


def window_groups(layer_windows: tuple[int | None, ...], num_layers: int) -> list[tuple[int | None, list[int]]]:
    """The model's layers grouped by window: ``[(window, layers), ...]``, the global layers (window ``None``) first,
    then one group per window, shortest first; groups without layers left out (:mod:`cache_backends.hybrid`'s
    window groups, and what :class:`Shape` sums)."""
    windows = layer_windows or (None,) * num_layers
    keys = [None] + sorted({w for w in windows if w is not None})
    groups = [(w, [i for i, lw in enumerate(windows) if lw == w]) for w in keys]
    return [(w, layers) for w, layers in groups if layers]


def window_rules(layer_windows: tuple[int | None, ...], num_layers: int, window: int,
                 sinks: int) -> list[tuple[int, int | None]]:
    """Each layer's ``(window, sinks)`` under the ``window`` backend (StreamingLLM, arXiv 2309.17453): a model's own
    sliding window ``w <= window`` stays as it is with no sinks (``sinks`` ``None``: the layer's own rule, nothing
    added beyond what it sees); every other layer (global, or a wider sliding window) sees ``sinks`` first tokens
    and ``window`` recent ones."""
    own = layer_windows or (None,) * num_layers
    return [(w, None) if w is not None and w <= window else (window, sinks) for w in own]


def window_tokens_held(spec: KVSpec, seq_len: int, window: int | None, sinks: int | None = None) -> tuple[int, int]:
    """``(exact, quantized)`` tokens one layer of ``spec`` holds at ``seq_len`` tokens when it keeps only what the
    next query sees besides itself: every token on a global layer (``window`` ``None``); on a sliding layer the
    newest ``window - 1``, of which a quantized tier's residual window and forming group stay exact, the rest
    codes (its exact tokens are never dropped; the pool frees codes in whole pages, so a layer holds up to one page
    of older codes more: :mod:`cache_backends.hybrid`). ``sinks`` (the ``window`` backend): the first ``sinks``
    tokens are held too, ``min(seq_len, window - 1 + sinks)`` in all."""
    exact, codes = spec.tokens_held(seq_len)
    if window is None:
        return exact, codes
    keep = min(seq_len, window - 1 + (sinks or 0))
    if spec.quantization is None or spec.quantization.on_demand:
        return min(exact + codes, keep), 0
    return exact, max(0, keep - exact)


def windowed_bytes_per_token_per_layer(spec: KVSpec, groups: Sequence[tuple], seq_len: int) -> float:
    """Bytes per token per layer of ``spec``'s streams when each group of layers ``(window, layers)`` (or ``(window,
    layers, sinks)``) holds only its window (:func:`window_tokens_held`): a sliding layer at most ``window - 1``
    tokens (what the next query sees besides itself) and its sinks, a global one (window ``None``) every token
    (:mod:`cache_backends.hybrid`)."""
    total = sum(spec.with_layers(g[1]).stored_bytes(*window_tokens_held(spec, seq_len, g[0], *g[2:]))
                for g in groups if g[1])
    return total / (sum(g[1] for g in groups) * max(seq_len, 1))


WINDOWED = ("full", "int8", "int4")
"""The backend specs whose pages keep only a sliding layer's window (:attr:`cache_backends.base.KVBackend.
windowed_pool`): ``full`` and the quantized tiers on their own; ``elastic`` and the compositions keep every token."""


# ---- the estimator behind `kvserve estimate` -------------------------------------------------------

DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class Shape:
    """What the sums need from a model config (no weights).

    Attributes:
        num_layers: decoder layers.
        num_key_value_heads: K/V heads.
        k_head_dim: key channels per head (nope + rope on DeepSeek-style models).
        v_head_dim: value channels per head.
        kv_lora_rank: the native latent width (DeepSeek-V2/V3), else ``None``.
        rope_dim: the decoupled rope key width of native MLA, else 0.
        max_positions: the config's ``max_position_embeddings`` (the longest context the model holds), else
            ``None`` (the presets: shapes, not one model's limit).
        layer_windows: each layer's sliding window or ``None`` (:func:`layer_windows_of`); empty without any.
            ``full``, ``int8`` and ``int4`` keep only the window of a sliding layer
            (:func:`windowed_bytes_per_token_per_layer`).
        rope_per_layer_type: whether its layer types rotate with different RoPE parameters
            (:func:`rope_per_layer_type_of`).
    """

    num_layers: int
    num_key_value_heads: int
    k_head_dim: int
    v_head_dim: int
    kv_lora_rank: int | None = None
    rope_dim: int = 0
    max_positions: int | None = None
    layer_windows: tuple[int | None, ...] = ()
    rope_per_layer_type: bool = False

    def window_groups(self) -> list[tuple[int | None, int]]:
        """``(window, layers)``: the global layers, then each window's sliding layers (:func:`window_groups`;
        empty without windows)."""
        if not self.layer_windows:
            return []
        return [(w, len(layers)) for w, layers in window_groups(self.layer_windows, self.num_layers)]

    @classmethod
    def from_config(cls, cfg: dict) -> "Shape":
        """Read a Hugging Face ``config.json`` (as a dict).

        Raises:
            ValueError: if it lacks a field the sums need (num_attention_heads, num_hidden_layers, and
                head_dim or hidden_size).
        """
        try:
            return cls._from_config(cfg)
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            raise ValueError(f"config.json has no usable attention shape (missing or bad {exc})") from None

    @classmethod
    def _from_config(cls, cfg: dict) -> "Shape":
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        positions = cfg.get("max_position_embeddings")
        positions = positions if isinstance(positions, int) and positions > 0 else None
        if cfg.get("kv_lora_rank"):
            rope = cfg.get("qk_rope_head_dim", 64)
            return cls(cfg["num_hidden_layers"], heads, cfg.get("qk_nope_head_dim", 128) + rope,
                       cfg.get("v_head_dim", 128), cfg["kv_lora_rank"], rope, positions)
        d = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return cls(cfg["num_hidden_layers"], kv_heads, d, d, max_positions=positions,
                   layer_windows=layer_windows_of(cfg.get, cfg["num_hidden_layers"]),
                   rope_per_layer_type=rope_per_layer_type_of(cfg.get))


PRESETS: dict[str, Shape] = {
    "llama-2-7b": Shape(num_layers=32, num_key_value_heads=32, k_head_dim=128, v_head_dim=128),
    "llama-3-8b": Shape(num_layers=32, num_key_value_heads=8, k_head_dim=128, v_head_dim=128),
    "deepseek-v3": Shape(num_layers=61, num_key_value_heads=128, k_head_dim=192, v_head_dim=128,
                         kv_lora_rank=512, rope_dim=64),
}


def default_params(shape: Shape, backend: str) -> dict:
    """The options the sums use for ``backend`` (or each part of a composition) when a spec leaves them out:
    gqa num_key_value_heads / 4 groups (the largest divisor up to that); mla the model's kv_lora_rank and rope width, else
    2 * num_key_value_heads * head_dim / 8 and no rope part; int8 group size 32 and residual 32 tokens
    (int4 the same, with 4-bit keys and values); dca half the layers reused."""
    h, dk, dv = shape.num_key_value_heads, shape.k_head_dim, shape.v_head_dim
    per_part = {
        "gqa": {"groups": default_gqa_groups(h)},
        "mla": {"rank": shape.kv_lora_rank or (h * (dk + dv)) // 8,
                "rope_dim": shape.rope_dim if shape.kv_lora_rank else 0},
        "int8": {"group_size": 32, "residual": 32},
        "int4": {"group_size": 32, "residual": 32, "key_bits": 4, "value_bits": 4},
        "dca": {"reuse_fraction": 0.5, "window": 32},
        "elastic": {"group_size": 32, "window": 32, "bits": 8},
        "window": {"sinks": 4, "window": 1024},
    }
    out = {}
    for part in backend.split("+"):
        out.update(per_part.get(part, {}))
    return out


def _quantization(backend: str, params: dict) -> Quantization | None:
    """The quantized tier a spec names (``...int8``, ``...int4``, ``elastic``), else ``None``."""
    if backend == "elastic":
        bits = params["bits"]
        return Quantization(params["group_size"], None, bits, bits, window=params["window"])
    if backend.endswith(("int8", "int4")):
        default = 4 if backend.endswith("int4") else 8
        return Quantization(params["group_size"], params["residual"], params.get("key_bits", default),
                            params.get("value_bits", default))
    return None


def kv_spec(shape: Shape, backend: str, params: dict, dtype_bytes: int) -> KVSpec:
    """The KV spec a backend spec stores on ``shape`` (every backend but ``dca``, whose layers differ: see
    :func:`bytes_per_token_per_layer`).

    Args:
        shape: the model's attention shape.
        backend: ``full``, ``gqa``, ``mla``, ``int8``, ``int4``, ``elastic``, or ``gqa+int8``, ``mla+int8``,
            ``gqa+int4``, ``mla+int4``.
        params: the spec's options, over :func:`default_params`.
        dtype_bytes: bytes per element (2 for fp16).

    Raises:
        ValueError: for an unknown backend, or a parameter the shape cannot take.
    """
    check_composition(backend)
    if backend.split("+")[0] == "window":  # what it keeps, it keeps in the inner form
        rest = {k: v for k, v in params.items() if k not in ("sinks", "window")}
        return kv_spec(shape, "full" if backend == "window" else backend.split("+")[1], rest, dtype_bytes)
    params = {**default_params(shape, backend), **params}
    h, dk, dv = shape.num_key_value_heads, shape.k_head_dim, shape.v_head_dim
    outer = backend.split("+")[0]
    if outer == "gqa":
        groups = params["groups"]
        if groups < 1 or h % groups:
            raise ValueError(f"gqa groups={groups} must divide num_key_value_heads={h}")
        h = groups
    if outer == "mla":  # the latent; on native MLA the model's latent and its rope key, each per channel
        width = shape.num_key_value_heads * (shape.k_head_dim + shape.v_head_dim)  # full's K and V per token
        if not 1 <= params["rank"] <= width:  # as the served backend refuses it: a latent as wide saves nothing
            raise ValueError(f"mla rank={params['rank']} must be between 1 and full's width per token, "
                             f"num_key_value_heads*(k_head_dim+v_head_dim)={width}")
        rope = params["rope_dim"]
        streams = [StreamSpec(1, params["rank"])] + ([StreamSpec(1, rope)] if rope else [])
    elif outer in ("full", "gqa", "int8", "int4", "elastic"):  # keys per channel, values per token
        streams = [StreamSpec(h, dk, Axis.CHANNEL), StreamSpec(h, dv, Axis.TOKEN)]
    else:
        raise ValueError(f"unknown backend {backend!r}; allowed: full, gqa, mla, int8, int4, dca, elastic, gqa+int8, "
                         "mla+int8, dca+int8, dca+mla, gqa+int4, mla+int4, dca+int4" + budget_hint(backend, served=False))
    return KVSpec(tuple(streams), shape.num_layers, dtype_bytes, _quantization(backend, params))


def bytes_per_token_per_layer(shape: Shape, backend: str, params: dict, dtype_bytes: int, seq_len: int) -> float:
    """Closed-form bytes one token costs in one layer for a backend spec, averaged over ``seq_len`` tokens:
    :meth:`cache_backends.kv_spec.KVSpec.bytes_per_token_per_layer` of :func:`kv_spec` (``elastic``: its most,
    every token exact; its least is :func:`elastic_min_bytes_per_token_per_layer`).

    Args:
        shape: the model's attention shape.
        backend: ``full``, ``gqa``, ``mla``, ``int8``, ``int4``, ``dca``, or a composition (``gqa+int8``,
            ``mla+int8``, ``dca+int8``, ``dca+mla``, ``gqa+int4``, ``mla+int4``, ``dca+int4``).
        params: the spec's options (``gqa``: groups; ``mla``: rank, rope_dim; ``int8``/``int4``: group_size,
            residual, key_bits, value_bits (8 for int8, 4 for int4 unless given), rotate (no bytes);
            ``dca``: reuse_fraction, window (a reuse layer's residual window, tokens) and optional inner
            backend options): a reuse fraction f costs (1 - f) x the inner backend's sum plus f x its window's
            tokens in the inner form.
        dtype_bytes: bytes per element (2 for fp16).
        seq_len: context length (matters for int8's residual window; and for ``full``, ``int8`` and ``int4`` on a
            model with sliding-window layers, each of which holds only its window:
            :func:`windowed_bytes_per_token_per_layer`).

    Raises:
        ValueError: for an unknown backend or a parameter the shape cannot take.
    """
    check_composition(backend)
    if backend.split("+")[0] == "window":  # sinks and a window on every layer (a model's narrower windows kept)
        opts = {**default_params(shape, "window"), **params}
        rules = window_rules(shape.layer_windows, shape.num_layers, opts["window"], opts["sinks"])
        counts: dict = {}
        for rule in rules:
            counts[rule] = counts.get(rule, 0) + 1
        return windowed_bytes_per_token_per_layer(kv_spec(shape, backend, params, dtype_bytes),
                                                  [(w, n, s) for (w, s), n in counts.items()], seq_len)
    if backend in WINDOWED and shape.layer_windows:
        return windowed_bytes_per_token_per_layer(kv_spec(shape, backend, params, dtype_bytes), shape.window_groups(),
                                                  seq_len)
    if backend == "dca" or backend.startswith("dca+"):
        params = {**default_params(shape, "dca"), **params}
        f = params["reuse_fraction"]
        if not 0 <= f < 1:
            raise ValueError(f"dca reuse_fraction={f} must be in [0, 1)")
        inner = "full" if backend == "dca" else backend[4:]
        rest = {k: v for k, v in params.items() if k not in ("reuse_fraction", "window")}
        spec = kv_spec(shape, inner, rest, dtype_bytes)
        held = dca_window_tokens(seq_len, int(params.get("window", 0)))  # a reuse layer's residual window
        per_layer = spec.bytes_per_token_per_layer(seq_len)
        return (1 - f) * per_layer + f * spec.bytes_at(held) / (spec.num_layers * max(seq_len, 1))
    return kv_spec(shape, backend, params, dtype_bytes).bytes_per_token_per_layer(seq_len)


def elastic_min_bytes_per_token_per_layer(shape: Shape, params: dict, dtype_bytes: int, seq_len: int) -> float:
    """``elastic`` with every compressible group quantized (the pool at its shortest): ``int8`` (``bits=4``:
    ``int4``) with its group size and its window as the residual window. Its most is ``full``'s."""
    params = {**default_params(shape, "elastic"), **params}
    tier = "int8" if params["bits"] == 8 else "int4"
    return kv_spec(shape, tier, {"group_size": params["group_size"], "residual": params["window"]},
                   dtype_bytes).bytes_per_token_per_layer(seq_len)


def estimate_rows(shape: Shape, specs: list[tuple[str, dict]], seq_lens: list[int], batches: list[int],
                  dtype_bytes: int) -> list[dict]:
    """One row per (spec, seq_len, batch): bytes per token per layer and total bytes (all layers, batch)."""
    from cache_backends.spec import check_options

    rows = []
    for backend, params in specs:
        check_options(backend, params)
        used = {**default_params(shape, backend), **params}
        for t in seq_lens:
            per = bytes_per_token_per_layer(shape, backend, params, dtype_bytes, t)
            low = elastic_min_bytes_per_token_per_layer(shape, params, dtype_bytes, t) if backend == "elastic" else None
            for b in batches:
                row = {"backend": backend, "params": used, "seq_len": t, "batch": b,
                       "bytes_per_token_per_layer": float(per), "total_bytes": round(per * t * shape.num_layers * b)}
                if low is not None:  # a range: from every token quantized that may be, to every token exact
                    row["min_bytes_per_token_per_layer"] = low
                    row["min_total_bytes"] = round(low * t * shape.num_layers * b)
                rows.append(row)
    return rows
