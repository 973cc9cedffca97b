"""``lastn``'s declaration: everything kvserve reads about it (no torch)."""

from cache_backends.declaration import MAX_TOKENS, BackendDecl, Metric, Option
from cache_backends.window.spec import window_bytes


def _bytes(shape, params, inner, dtype_bytes, seq_len):
    return window_bytes(shape, params["n"], 0, inner, seq_len)


DECLARATIONS = (
    BackendDecl(
        name="lastn", backend="kvserve_lastn.backend:LastNBackend",
        summary="the newest n tokens alone: a fixed size, and everything older is lost",
        options=(Option("n", int, 64, low=1, high=MAX_TOKENS, setting="kv_lastn_n",
                        help="lastn: newest tokens each query sees."),),
        inners=("int8",), order=50, bytes_per_token=_bytes,
        metrics=(Metric("kvserve_lastn_dropped_tokens", "gauge", "lastn: tokens older than the newest n, no longer "
                        "held, summed over live sequences.", "dropped_tokens"),)),
)
