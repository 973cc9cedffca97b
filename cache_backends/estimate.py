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

from cache_backends import catalog
from cache_backends.kv_spec import KVSpec
from cache_backends.sizes import (DTYPE_BYTES, PRESETS, Shape, dca_store_bytes_per_token_per_layer,  # noqa: F401
                                  dca_window_tokens, layer_windows_of, per_head_streams, rope_per_layer_type_of,
                                  window_groups, window_rules, window_tokens_held, windowed_bytes_per_token_per_layer)
from cache_backends.spec import budget_hint, check_composition, check_options


def default_params(shape: Shape, backend: str) -> dict:
    """The options the sums use for ``backend`` (or each part of a composition) where a spec leaves them out: each
    part's declared estimate defaults (:meth:`cache_backends.declaration.BackendDecl.defaults`; gqa
    num_key_value_heads / 4 groups, the largest divisor up to that; mla the model's kv_lora_rank and rope width,
    else 2 * num_key_value_heads * head_dim / 8 and no rope part; int8 group size 32 and residual 32 tokens, int4
    the same with 4-bit keys and values; dca half the layers reused)."""
    out = {}
    for part in backend.split("+"):
        decl = catalog.get(part)
        if decl is not None:
            out.update(decl.defaults(shape))
    return out


def _parts(backend: str) -> list:
    check_composition(backend)
    decls = [catalog.get(p) for p in backend.split("+")]
    if None in decls:
        raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(catalog.names())}, "
                         f"{', '.join(catalog.compositions())}" + budget_hint(backend, served=False))
    return decls


def kv_spec(shape: Shape, backend: str, params: dict, dtype_bytes: int) -> KVSpec:
    """The KV spec a backend spec stores on ``shape``: the streams of the first part declaring them (else
    ``full``'s per-head K and V) in the quantized tier of the first part declaring one. A part that wraps another's
    storage (``dca``, ``window``) stores it in this form; its bytes are :func:`bytes_per_token_per_layer`'s.

    Args:
        shape: the model's attention shape.
        backend: a backend or composition (:func:`cache_backends.catalog.names`, ``compositions``).
        params: the spec's options, over :func:`default_params`.
        dtype_bytes: bytes per element (2 for fp16).

    Raises:
        ValueError: for an unknown backend, or a parameter the shape cannot take.
    """
    decls = _parts(backend)
    params = {**default_params(shape, backend), **params}
    streams = next((d.streams(shape, params) for d in decls if d.streams), None) or per_head_streams(shape)
    tier = next((d.quantization(params) for d in decls if d.quantization), None)
    return KVSpec(tuple(streams), shape.num_layers, dtype_bytes, tier)


def bytes_per_token_per_layer(shape: Shape, backend: str, params: dict, dtype_bytes: int, seq_len: int) -> float:
    """Closed-form bytes one token costs in one layer for a backend spec, averaged over ``seq_len`` tokens:
    :meth:`cache_backends.kv_spec.KVSpec.bytes_per_token_per_layer` of :func:`kv_spec` (``elastic``: its most,
    every token exact; its least is :func:`elastic_min_bytes_per_token_per_layer`). A part that wraps another's
    storage counts its own (``dca``: a reuse fraction f costs (1 - f) x the inner sum plus f x a reuse layer's
    window in the inner form; ``window``: the sinks and the window); a backend whose pages keep only a sliding
    layer's window (``full``, ``int8``, ``int4`` on a model with sliding-window layers) counts each layer's window
    (:func:`cache_backends.sizes.windowed_bytes_per_token_per_layer`).

    Args:
        shape: the model's attention shape.
        backend: a backend or composition.
        params: the spec's options (``gqa``: groups; ``mla``: rank, rope_dim; ``int8``/``int4``: group_size,
            residual, key_bits, value_bits (8 for int8, 4 for int4 unless given), rotate (no bytes);
            ``dca``: reuse_fraction, window (a reuse layer's residual window, tokens); ``window``: sinks, window).
        dtype_bytes: bytes per element (2 for fp16).
        seq_len: context length, tokens.

    Raises:
        ValueError: for an unknown backend or a parameter the shape cannot take.
    """
    decls = _parts(backend)
    outer = decls[0]
    if outer.bytes_per_token is not None:
        opts = {**default_params(shape, backend), **params}
        inner = "+".join(backend.split("+")[1:]) or "full"
        rest = {k: v for k, v in params.items() if k not in outer.option_names()}
        return outer.bytes_per_token(shape, opts, kv_spec(shape, inner, rest, dtype_bytes), dtype_bytes, seq_len)
    spec = kv_spec(shape, backend, params, dtype_bytes)
    if len(decls) == 1 and outer.windowed_pool and shape.layer_windows:
        return windowed_bytes_per_token_per_layer(spec, shape.window_groups(), seq_len)
    return spec.bytes_per_token_per_layer(seq_len)


def min_bytes_per_token_per_layer(shape: Shape, backend: str, params: dict, dtype_bytes: int,
                                  seq_len: int) -> float | None:
    """The least bytes per token per layer of a backend whose size is a range (``elastic``: every compressible
    group quantized), else ``None``."""
    decl = catalog.get(backend)
    if decl is None or decl.min_bytes_per_token is None:
        return None
    return decl.min_bytes_per_token(shape, {**default_params(shape, backend), **params}, dtype_bytes, seq_len)


def elastic_min_bytes_per_token_per_layer(shape: Shape, params: dict, dtype_bytes: int, seq_len: int) -> float:
    """``elastic`` with every compressible group quantized (the pool at its shortest): ``int8`` (``bits=4``:
    ``int4``) with its group size and its window as the residual window. Its most is ``full``'s."""
    return min_bytes_per_token_per_layer(shape, "elastic", params, dtype_bytes, seq_len)


def default_specs() -> list[str]:
    """``kvserve estimate``'s rows when no spec is given, and the page's sums: every backend in its declared
    order, each with its extra rows (``int8:value_bits=4``), then the compositions the backends list there."""
    decls = [d for d in catalog.declarations().values() if d.order is not None]
    return ([s for d in decls for s in (d.name, *d.extra_rows)]
            + [c for d in decls for c in d.default_compositions])


def estimate_rows(shape: Shape, specs: list[tuple[str, dict]], seq_lens: list[int], batches: list[int],
                  dtype_bytes: int) -> list[dict]:
    """One row per (spec, seq_len, batch): bytes per token per layer and total bytes (all layers, batch)."""
    rows = []
    for backend, params in specs:
        check_options(backend, params)
        used = {**default_params(shape, backend), **params}
        for t in seq_lens:
            per = bytes_per_token_per_layer(shape, backend, params, dtype_bytes, t)
            low = min_bytes_per_token_per_layer(shape, backend, params, dtype_bytes, t)
            for b in batches:
                row = {"backend": backend, "params": used, "seq_len": t, "batch": b,
                       "bytes_per_token_per_layer": float(per), "total_bytes": round(per * t * shape.num_layers * b)}
                if low is not None:  # a range: from every token quantized that may be, to every token exact
                    row["min_bytes_per_token_per_layer"] = low
                    row["min_total_bytes"] = round(low * t * shape.num_layers * b)
                rows.append(row)
    return rows
