"""``snapkv``'s declaration: a prompt's tokens selected per layer and K/V head by its observation window's attention
(SnapKV, arXiv 2404.14469)."""

from cache_backends.declaration import MAX_TOKENS, BackendDecl, Option
from cache_backends.kv_spec import KVSpec
from cache_backends.sizes import Shape

DEFAULT_CAPACITY = 1024
DEFAULT_WINDOW = 32
DEFAULT_KERNEL = 7
POOLINGS = ("avg", "max")


def snapkv_bytes(inner: KVSpec, capacity: int, seq_len: int) -> float:
    """Bytes per token per layer of a ``seq_len``-token prompt of which each layer keeps ``min(seq_len, capacity)``
    tokens in ``inner``'s form (an int8 tier's residual window counted on the kept tokens); the estimator's and the
    served backend's one sum."""
    kept = min(seq_len, capacity)
    return inner.bytes_per_token_per_layer(kept) * kept / max(seq_len, 1)


def _bytes(shape: Shape, params: dict, inner: KVSpec, dtype_bytes: int, seq_len: int) -> float:
    return snapkv_bytes(inner, params["capacity"], seq_len)


def check_options(capacity: int, window: int, kernel: int) -> None:
    """Refuse an observation window that leaves nothing to select, an even pooling kernel, and one wider than the
    ``capacity - window`` tokens selected (its pooling would spread each vote over more tokens than can be kept: a
    swapped or mistyped value, refused rather than served) (the backend at construction, ``kvserve serve`` before
    the weights load, ``kvserve estimate`` and ``advise``, with one message).

    Raises:
        ValueError: naming the values and the variables.
    """
    if window >= capacity:
        raise ValueError(f"snapkv: window={window} must be below capacity={capacity} (KV_SNAPKV_WINDOW < "
                         "KV_SNAPKV_CAPACITY: the capacity counts the observation window, the rest is selected)")
    if kernel % 2 == 0:
        raise ValueError(f"snapkv: kernel={kernel} must be odd (KV_SNAPKV_KERNEL: the pooling is centred on each "
                         "token)")
    if kernel > capacity - window:
        raise ValueError(f"snapkv: kernel={kernel} must be at most capacity - window = {capacity} - {window} = "
                         f"{capacity - window} (KV_SNAPKV_KERNEL <= KV_SNAPKV_CAPACITY - KV_SNAPKV_WINDOW: the "
                         "pooling would spread each vote over more tokens than it selects)")


def check(name: str, params: dict) -> None:
    """:func:`check_options` on a spec's options."""
    capacity = params.get("capacity", DEFAULT_CAPACITY)
    window, kernel = params.get("window", DEFAULT_WINDOW), params.get("kernel", DEFAULT_KERNEL)
    if all(isinstance(v, int) for v in (capacity, window, kernel)):
        check_options(capacity, window, kernel)


def _uncompressed(params: dict, tokens: int) -> str | None:
    capacity = int(params.get("capacity", DEFAULT_CAPACITY))
    if tokens <= capacity:
        return f"a prompt of at most {capacity} tokens (its capacity) is kept whole: snapkv saves on longer prompts"
    return None


DECLARATIONS = (
    BackendDecl(
        name="snapkv", backend="cache_backends.snapkv.backend:SnapKVBackend",
        summary="keeps, per layer and K/V head, the prompt tokens the prompt's last queries attend to most (SnapKV): "
                "a long prompt costs its capacity, decode tokens are all kept; what it dropped is lost",
        options=(Option("capacity", int, DEFAULT_CAPACITY, low=2, high=MAX_TOKENS, setting="kv_snapkv_capacity",
                        help="snapkv: prompt tokens each layer keeps, the observation window included (the paper's "
                             "max_capacity_prompt); a prompt of at most this many is kept whole."),
                 Option("window", int, DEFAULT_WINDOW, low=1, high=MAX_TOKENS, setting="kv_snapkv_window",
                        help="snapkv: the observation window, the prompt's last tokens whose queries vote (and which "
                             "are always kept)."),
                 Option("kernel", int, DEFAULT_KERNEL, low=1, high=MAX_TOKENS, setting="kv_snapkv_kernel",
                        help="snapkv: the pooling kernel (odd) smoothing the votes over neighbouring tokens."),
                 Option("pooling", str, "avg", choices=POOLINGS, setting="kv_snapkv_pooling",
                        help="snapkv: how the votes are pooled, avg or max (the paper's code offers both).")),
        inners=("int8", "int4"),
        refusals={
            "gqa": "gqa's shared heads are not the model's K/V heads that snapkv selects tokens for",
            "mla": "mla's latent pages hold no per-head keys for snapkv's selection",
            "dca": "dca lets a layer read another layer's cache by position, which a per-layer selection breaks",
            "elastic": "elastic's on-demand tier keeps every token in every layer",
            "window": "window drops tokens by position, snapkv by attention: compose one or the other",
        },
        sliding_refusal="snapkv compacts every layer's selection into the first slots of one set of pages, which a "
                        "model's sliding layers (pages of their own window group) do not share",
        rope_refusal="snapkv compacts every layer's selection into one set of pages, which layer types rotating "
                     "with their own RoPE (a model's window groups) do not share",
        order=8, bytes_per_token=_bytes, check=check, uncompressed=_uncompressed),
)
