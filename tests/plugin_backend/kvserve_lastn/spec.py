"""``lastn``'s declaration: everything kvserve reads about it (no torch)."""

from cache_backends.declaration import BackendDecl, Option
from cache_backends.sizes import window_rules, windowed_bytes_per_token_per_layer


def _bytes(shape, params, inner, dtype_bytes, seq_len):
    counts: dict = {}
    for rule in window_rules(shape.layer_windows, shape.num_layers, params["n"], 0):
        counts[rule] = counts.get(rule, 0) + 1
    return windowed_bytes_per_token_per_layer(inner, [(w, n, s) for (w, s), n in counts.items()], seq_len)


DECLARATIONS = (
    BackendDecl(
        name="lastn", backend="kvserve_lastn.backend:LastNBackend",
        summary="the newest n tokens alone: a fixed size, and everything older is lost",
        options=(Option("n", int, 64, low=1, setting="kv_lastn_n", help="lastn: newest tokens each query sees."),),
        inners=("int8",), order=50, bytes_per_token=_bytes),
)
