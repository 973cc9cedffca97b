"""Why a backend held as many KV bytes as ``full`` for one request: the built-in page's words for it.

A compressing backend stores some tokens exactly at every length (``int8``/``int4``: the newest
``residual`` tokens and the group forming before them; ``dca``: each reuse layer's own window), and
``elastic`` quantizes only when the KV pool runs short, so a short request may cost ``full``'s bytes.
:func:`uncompressed_reason` says which of these applies, from the backend's sums spec
(:meth:`cache_backends.base.KVBackend.sums_spec`) and the tokens the request cached.
"""

from __future__ import annotations

from cache_backends import catalog


def uncompressed_reason(spec: tuple[str, dict], cached_tokens: int) -> str:
    """The reason, in one sentence, that a request of ``cached_tokens`` tokens held ``full``'s bytes under a
    backend of sums spec ``spec`` (``(name, options)``, e.g. ``("int8", {"group_size": 32, "residual": 32})``):
    the first of its parts' declared reasons (:attr:`cache_backends.declaration.BackendDecl.uncompressed`) that
    applies, outer part first.

    Call it only when the request's KV peak was not below ``full``'s for the same tokens.
    """
    name, options = spec
    for part in name.split("+"):
        decl = catalog.get(part)
        reason = decl.uncompressed(options, cached_tokens) if decl is not None and decl.uncompressed else None
        if reason:
            return reason
    return f"it held as many bytes as full for these {cached_tokens} tokens"
