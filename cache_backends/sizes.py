"""Sizes without torch: a model's attention shape (:class:`Shape`), its sliding windows, and what a window or a
``dca`` reuse layer holds; the pieces the estimator (:mod:`cache_backends.estimate`), the backends' declarations
and the served backends share. Units are bytes and tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache_backends.kv_spec import Axis, KVSpec, StreamSpec

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


def per_head_streams(shape: Shape, heads: int | None = None) -> tuple[StreamSpec, StreamSpec]:
    """``full``'s per-token storage: ``heads`` (default num_key_value_heads) keys quantized per channel, and as
    many values quantized per token, when a tier quantizes them."""
    h = shape.num_key_value_heads if heads is None else heads
    return StreamSpec(h, shape.k_head_dim, Axis.CHANNEL), StreamSpec(h, shape.v_head_dim, Axis.TOKEN)
