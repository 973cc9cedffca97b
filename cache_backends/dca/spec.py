"""``dca``'s declaration: cross-layer KV reuse through a calibrated map, with a runtime fall-back (after
MiniCache, arXiv 2405.14366, and CLA, arXiv 2405.12981)."""

from cache_backends.declaration import MAX_TOKENS, BackendDecl, Metric, Option
from cache_backends.kv_spec import KVSpec
from cache_backends.sizes import Shape, dca_window_tokens


def _bytes(shape: Shape, params: dict, inner: KVSpec, dtype_bytes: int, seq_len: int) -> float:
    """A reuse fraction f costs (1 - f) x the inner backend's sum plus f x its window's tokens in the inner form."""
    f = params["reuse_fraction"]
    if not 0 <= f < 1:
        raise ValueError(f"dca reuse_fraction={f} must be in [0, 1)")
    held = dca_window_tokens(seq_len, int(params.get("window", 0)))  # a reuse layer's residual window
    per_layer = inner.bytes_per_token_per_layer(seq_len)
    return (1 - f) * per_layer + f * inner.bytes_at(held) / (inner.num_layers * max(seq_len, 1))


def _uncompressed(params: dict, n: int) -> str:
    window = int(params.get("window", 0))
    if window and dca_window_tokens(n, window) == n:
        return (f"all {n} tokens within the newest {window}-{2 * window - 1} tokens each reuse layer keeps itself: "
                f"dca saves from {2 * window} tokens on")
    if not params.get("reuse_fraction"):
        return "calibration chose no layer to reuse: dca stores every layer itself"
    return f"no layer reused another's cache for these {n} tokens (each reuse layer fell back to its own)"


DECLARATIONS = (
    BackendDecl(
        name="dca", backend="cache_backends.dca.backend:DCABackend",
        summary="layer reuse: the reused layers keep only a residual window; near full quality, modest savings",
        options=(Option("threshold", float, 0.95, setting="kv_dca_threshold",
                        help="dca: calibrated similarity at or above which a layer is a reuse candidate (each then "
                             "checks its own calibrated threshold per prompt and probe); above 1: none."),
                 Option("probe_interval", int, 16, low=1, setting="kv_dca_probe_interval",
                        help="dca: decode steps between similarity probes."),
                 Option("align", str, "linear", choices=("linear", "none"), setting="kv_dca_align",
                        help="dca: how a layer's K/V are predicted."),
                 Option("window", int, 32, low=0, high=MAX_TOKENS, setting="kv_dca_window",
                        help="dca: a reuse layer keeps its own K/V for its newest window..2*window-1 tokens "
                             "(residual window); 0: none."),
                 Option("reuse_fraction", float, None, low=0, estimate_only=True)),
        sliding_refusal="dca lets a layer reuse another layer's cache, which a sliding layer and a global layer do "
                        "not see alike (their windows differ)",
        inners=("int8", "mla", "int4"), calibrates=True, budget_axis="threshold", order=6,
        estimate_defaults=lambda shape: {"reuse_fraction": 0.5, "window": 32}, bytes_per_token=_bytes,
        uncompressed=_uncompressed,
        metrics=(Metric("kvserve_dca_reuse_layers", "gauge",
                        "dca: layers currently reusing another layer's K/V, summed over live sequences.",
                        "dca_reuse_layers", title="dca: reuse layers (live sequences)"),
                 Metric("kvserve_dca_fallbacks", "counter", "dca: reuse layers that fell back to their own K/V "
                        "after a failed similarity probe.", "dca_fallbacks", title="dca: fall-backs"))),
)
