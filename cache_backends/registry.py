"""Backend names → classes. ``KV_BACKEND`` must be one of :func:`available`."""

from __future__ import annotations

from cache_backends.base import KVBackend
from cache_backends.full import FullBackend

_BACKENDS: dict[str, type[KVBackend]] = {cls.name: cls for cls in (FullBackend,)}


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
