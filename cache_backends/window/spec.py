"""``window``'s declaration: attention sinks plus a recent window on every layer (StreamingLLM, arXiv 2309.17453)."""

from cache_backends.declaration import MAX_TOKENS, BackendDecl, Option
from cache_backends.kv_spec import KVSpec
from cache_backends.sizes import Shape, window_rules, windowed_bytes_per_token_per_layer

DEFAULT_SINKS = 4
DEFAULT_WINDOW = 1024


def window_bytes(shape: Shape, window: int, sinks: int, inner: KVSpec, seq_len: int) -> float:
    """Bytes per token per layer at ``seq_len`` tokens of ``sinks`` sinks and a ``window`` on every layer (a model's
    narrower sliding windows kept as they are: :func:`cache_backends.sizes.window_rules`), each token held in
    ``inner``'s form; the estimator's and the served backend's one sum."""
    counts: dict = {}
    for rule in window_rules(shape.layer_windows, shape.num_layers, window, sinks):
        counts[rule] = counts.get(rule, 0) + 1
    return windowed_bytes_per_token_per_layer(inner, [(w, n, s) for (w, s), n in counts.items()], seq_len)


def _bytes(shape: Shape, params: dict, inner: KVSpec, dtype_bytes: int, seq_len: int) -> float:
    return window_bytes(shape, params["window"], params["sinks"], inner, seq_len)


def check_sinks(sinks: int, window: int) -> None:
    """Refuse sinks above the window (the backend at construction, and ``kvserve estimate``, with one message).

    Raises:
        ValueError: naming the values and the variables.
    """
    if sinks > window:
        raise ValueError(f"window: sinks={sinks} must be at most window={window} (KV_WINDOW_SINKS <= "
                         "KV_WINDOW_SIZE: the sinks are the oldest of the tokens a query keeps seeing)")


def check(name: str, params: dict) -> None:
    """:func:`check_sinks` on a spec's options (``name``: the spec, unused in the message, which is the server's)."""
    sinks, window = params.get("sinks", DEFAULT_SINKS), params.get("window", DEFAULT_WINDOW)
    if isinstance(sinks, int) and isinstance(window, int):
        check_sinks(sinks, window)


DECLARATIONS = (
    BackendDecl(
        name="window", backend="cache_backends.window.backend:WindowBackend",
        summary="attention sinks and a recent window: the cache stops growing at the window, but what it dropped is "
                "lost (a fact older than the window is not retrieved)",
        options=(Option("sinks", int, DEFAULT_SINKS, low=0, high=MAX_TOKENS, setting="kv_window_sinks",
                        help="window: attention-sink tokens (the first ones) every query keeps seeing "
                             "(StreamingLLM, arXiv 2309.17453)."),
                 Option("window", int, DEFAULT_WINDOW, low=1, high=MAX_TOKENS, setting="kv_window_size",
                        help="window: recent tokens each query sees, itself included; older ones but the sinks "
                             "are dropped from the pool.")),
        inners=("int8", "int4"),
        refusals={
            "gqa": "gqa's pages keep every token of every layer (its layout has no window groups to drop pages "
                   "from)",
            "mla": "mla's latent pages keep every token of every layer (its layout has no window groups to drop "
                   "pages from)",
            "dca": "dca lets a layer read another layer's cache by position, which a window that drops tokens breaks",
            "elastic": "elastic's on-demand tier keeps every token in every layer, so no page could be dropped",
        },
        order=7, bytes_per_token=_bytes, check=check),
)
