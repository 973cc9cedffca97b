"""A backend over an inner backend's storage, which changes only which tokens a query sees (``window``'s sinks and
recent window, ``snapkv``'s selection): :class:`OuterBackend` (stores, calibration, KV spec and writes are the inner
backend's) and :class:`InnerLayer`, a per-sequence layer whose storage, byte counts and length are the inner
layer's."""

from __future__ import annotations

import torch

from cache_backends.base import KVBackend
from cache_backends.geometry import ModelGeometry
from cache_backends.kv_spec import KVSpec
from cache_backends.kv_store import KVLayer


class InnerLayer(KVLayer):
    """One layer of a per-sequence store holding every token in ``inner`` (``FullLayer``, ``Int8Layer``); subclasses
    override :meth:`attend`."""

    def __init__(self, inner: KVLayer):
        super().__init__()
        self.inner = inner

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.inner.append(key_states, value_states)

    def materialize(self):
        return self.inner.materialize()

    def nbytes(self) -> int:
        return self.inner.nbytes()

    def allocated_bytes(self) -> int:
        return self.inner.allocated_bytes()

    def reserve(self, max_tokens: int) -> None:
        self.inner.reserve(max_tokens)

    def get_seq_length(self) -> int:
        return self.inner.get_seq_length()

    def reset(self) -> None:
        self.inner.reset()
        self.is_initialized = False


class OuterBackend(KVBackend):
    """A backend storing its tokens in ``self.inner``'s form (``full``, or ``int8``/``int4`` in ``outer+int8``); a
    subclass sets ``self.inner`` and says which of its options size it (:meth:`sums_options`)."""

    inner: KVBackend

    @classmethod
    def compose(cls, geometry: ModelGeometry, inner: KVBackend, **options):
        """``outer+int8``/``outer+int4``: the kept tokens stored in ``inner``'s tiers."""
        return cls(geometry, inner=inner, **options)

    def sums_options(self) -> dict:
        """Its own options that size it (``kvserve estimate``'s spec)."""
        return {}

    def reserved_bytes(self, max_tokens: int) -> int:
        """A per-sequence store keeps every token (what a query does not see is dropped in the pool only)."""
        return self.inner.reserved_bytes(max_tokens)

    def prepare(self, model, calibration_ids: list[int] | None = None, cache=None) -> None:
        self.inner.prepare(model, calibration_ids, cache)

    def sums_spec(self) -> tuple[str, dict]:
        name, options = self.inner.sums_spec()
        own = type(self).name
        return (own if name == "full" else f"{own}+{name}"), {**self.sums_options(), **options}

    def kv_spec(self) -> KVSpec:
        return self.inner.kv_spec()

    def encode_paged(self, layer, key_states, value_states, meta):
        return self.inner.encode_paged(layer, key_states, value_states, meta)

    def write_paged(self, views, index, layer, meta, key_states, value_states):
        self.inner.write_paged(views, index, layer, meta, key_states, value_states)
