"""Why a backend held as many KV bytes as ``full`` for one request: the built-in page's words for it.

A compressing backend stores some tokens exactly at every length (``int8``/``int4``: the newest
``residual`` tokens and the group forming before them; ``dca``: each reuse layer's own window), and
``elastic`` quantizes only when the KV pool runs short, so a short request may cost ``full``'s bytes.
:func:`uncompressed_reason` says which of these applies, from the backend's sums spec
(:meth:`cache_backends.base.KVBackend.sums_spec`) and the tokens the request cached.
"""

from __future__ import annotations

from cache_backends.estimate import dca_window_tokens


def uncompressed_reason(spec: tuple[str, dict], cached_tokens: int) -> str:
    """The reason, in one sentence, that a request of ``cached_tokens`` tokens held ``full``'s bytes under a
    backend of sums spec ``spec`` (``(name, options)``, e.g. ``("int8", {"group_size": 32, "residual": 32})``).

    Call it only when the request's KV peak was not below ``full``'s for the same tokens.
    """
    name, options = spec
    parts = name.split("+")
    n = cached_tokens
    if "elastic" in parts:
        return (f"the KV pool had room: elastic keeps all {n} tokens exact and quantizes its oldest tokens only "
                "when the pool runs out (KV_CACHE_BUDGET_BYTES)")
    if "dca" in parts:
        window = int(options.get("window", 0))
        if window and dca_window_tokens(n, window) == n:
            return (f"all {n} tokens within the newest {window}-{2 * window - 1} tokens each reuse layer keeps "
                    f"itself: dca saves from {2 * window} tokens on")
        if not options.get("reuse_fraction"):
            return "calibration chose no layer to reuse: dca stores every layer itself"
        return f"no layer reused another's cache for these {n} tokens (each reuse layer fell back to its own)"
    quantized = next((p for p in parts if p in ("int8", "int4")), None)
    if quantized:
        residual, group = int(options.get("residual", 32)), int(options.get("group_size", 32))
        if n < residual + group:
            return (f"all {n} tokens within the {residual} newest tokens kept exact and the group of {group} "
                    f"forming before them: {quantized} quantizes from {residual + group} tokens on")
    return f"it held as many bytes as full for these {n} tokens"
