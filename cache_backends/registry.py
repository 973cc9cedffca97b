"""Backend names → classes. ``KV_BACKEND`` must be one of :func:`available`."""

from __future__ import annotations

from cache_backends.base import KVBackend
from cache_backends.dca import DCABackend
from cache_backends.full import FullBackend
from cache_backends.gqa import GQABackend
from cache_backends.int8 import Int8Backend
from cache_backends.mla import MLABackend

_BACKENDS: dict[str, type[KVBackend]] = {cls.name: cls for cls in (FullBackend, GQABackend, MLABackend, Int8Backend, DCABackend)}


def available() -> list[str]:
    """Registered backend names, sorted."""
    return sorted(_BACKENDS)


def get_backend_class(name: str) -> type[KVBackend]:
    """The class registered as ``name``.

    Raises:
        KeyError: if no backend has that name.
    """
    try:
        return _BACKENDS[name]
    except KeyError:
        raise KeyError(f"unknown KV backend {name!r}; allowed: {', '.join(available())}") from None
