"""``dca``'s per-sequence reference store (:class:`DCAStore`, the path the paged one is checked against and that
calibration measures through): kept layers hold their own K/V, reuse layers their window, read through the map."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cache_backends.attention import LayerRead, attend_kv
from cache_backends.kv_store import KVLayer, KVStore
from cache_backends.dca.maps import LayerMap
from cache_backends.dca.plan import PROBE_WINDOW, runtime_threshold, window_start
from cache_backends.dca.similarity import similarity, token_similarity

if TYPE_CHECKING:
    from cache_backends.dca.backend import DCABackend


class TensorStream:
    """Rebuilt per-token vectors (1, H, T, w) with the storage reading interface (``dot``, ``weighted_sum``)."""

    def __init__(self, x: torch.Tensor):
        self.x = x

    def dot(self, query: torch.Tensor) -> torch.Tensor:
        return query @ self.x.transpose(-1, -2)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        return weights @ self.x


def source_streams(layer: KVLayer):
    """A source layer's key and value storage as read by attention; rebuilt K/V where it stores a latent."""
    if hasattr(layer, "key_store") and hasattr(layer.key_store, "dot"):
        return layer.key_store, layer.value_store
    keys, values = layer.materialize()
    return TensorStream(keys), TensorStream(values)



class DCALayer(KVLayer):
    """One layer of a dca store: ``kept`` (its own inner layer), or ``reuse`` (an inner layer holding its own K/V
    of its residual window only, or of every position from the window's start after a fall-back; nothing with
    ``window=0`` until a fall-back)."""

    def __init__(self, store: "DCAStore", index: int, layer_map: LayerMap | None, backend: "DCABackend"):
        super().__init__()
        self.store = store
        self.index = index
        self.map = layer_map  # None for layer 0 (no source)
        self.backend = backend
        self.threshold = backend.threshold
        self.thresholds = backend.layer_thresholds.get(index)  # span → calibrated threshold; None: never reused
        self.probe_interval = backend.probe_interval
        self.probes: list[float] = []  # similarity of the latest probed tokens (at most PROBE_WINDOW)
        self.mode = "undecided"
        self.own: KVLayer | None = None  # the inner backend's layer holding this layer's own K/V
        self.length = 0
        self.decode_steps = 0
        self.fallback_at: int | None = None
        self.own_start = 0  # the first position of ``own`` (a reuse layer: its residual window, or its fall-back)
        self.window = backend.window
        self.similarity: float | None = None
        self.max_tokens: int | None = None

    def reserve(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens

    def _own_layer(self, position_offset: int, in_place: bool) -> KVLayer:
        own = self.backend.inner.new_layer(self.index, position_offset)
        own.in_place = in_place
        if self.max_tokens is not None:
            own.reserve(self.max_tokens - position_offset)
        return own

    def append(self, key_states, value_states) -> None:
        raise NotImplementedError("a dca layer decides what to store in update()")

    @property
    def source(self) -> "DCALayer | None":
        return self.store.layers[self.index - 1] if self.map is not None else None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def reusing(self) -> bool:
        """Reusing its source right now (a reuse layer that has not fallen back)."""
        return self.mode == "reuse" and self.fallback_at is None

    def threshold_for(self, tokens: int) -> float:
        """The similarity a span of ``tokens`` tokens must reach to keep reusing: the lower of ``KV_DCA_THRESHOLD``
        and this layer's calibrated quantile at the longest calibrated span not above ``tokens``. A layer that
        is not a reuse candidate never passes (+inf)."""
        return runtime_threshold(self.thresholds, self.threshold, tokens)

    def probe_due(self) -> bool:
        return (self.decode_steps + 1) % self.probe_interval == 0

    def skips_projection(self) -> bool:
        return self.reusing() and not self.window and not self.probe_due()

    def update(self, key_states, value_states, *args, **kwargs):
        """Decide (prefill), store, and return what this layer attends with: a :class:`LayerRead` (in place) or
        K/V tensors (1, H, seq_len, d).

        ``key_states``/``value_states`` are ``None`` when the attention skipped its projections (a reuse layer
        without a residual window, between probes).
        """
        self.is_initialized = True
        start = self.length
        if self.mode == "undecided":
            self.mode = self._decide(key_states, value_states)
            self.length += key_states.shape[-2]
            if self.mode == "kept":
                self.own = self._own_layer(0, self.in_place)  # a kept layer attends in place
                return self.own.update(key_states, value_states)
            if self.window:  # the residual window: its own K/V for the newest tokens of the prompt
                self._restart_own(window_start(self.length, self.window), key_states, value_states, start)
            return key_states, value_states  # a reuse layer's prefill attends with its own K/V
        if self.mode == "kept":
            self.length += key_states.shape[-2]
            return self.own.update(key_states, value_states)
        # reuse layer, decode: the source has already taken this step's tokens
        n = self.source.length - start
        if key_states is not None and self.reusing() and self.probe_due():
            src_keys, src_values = self.source.own.materialize()  # probe steps only (transient)
            pk, pv = self.map.predict(src_keys[..., start:, :], src_values[..., start:, :], start)
            self.probes = (self.probes + [similarity(key_states, value_states, pk, pv)])[-PROBE_WINDOW:]
            if sum(self.probes) / len(self.probes) < self.threshold_for(len(self.probes)):
                self.fallback_at = start  # from here on it keeps all its own K/V (the window stops sliding)
                if self.own is None:
                    self.own, self.own_start = self._own_layer(start, False), start
                self.store.fallbacks += 1
        self.length += n
        self.decode_steps += 1
        if self.own is not None:
            self.own.update(key_states, value_states)
            slide_to = window_start(self.length, self.window)
            if self.fallback_at is None and slide_to > self.own_start:
                self._restart_own(slide_to, *self.own.materialize(), self.own_start)
        if self.in_place:
            return LayerRead(self), None  # attends the source's cache with folded maps (attend)
        return self._rebuilt()

    def _restart_own(self, position: int, keys, values, first: int) -> None:
        """Hold own K/V from ``position`` on, taken from ``keys``/``values`` (1, H, n, d) whose first token sits at
        ``first`` (the window slides by dropping its oldest tokens: they are served from the source again)."""
        self.own, self.own_start = self._own_layer(position, False), position
        self.own.update(keys[..., position - first :, :], values[..., position - first :, :])

    def _rebuilt(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V tensors (1, H, length, d): predicted from the source up to ``own_start``, its own from there on."""
        src_keys, src_values = self.source.own.materialize()
        if self.own is None:
            return self.map.predict(src_keys, src_values, 0)
        k, v = self.map.predict(src_keys[..., : self.own_start, :], src_values[..., : self.own_start, :], 0)
        own_keys, own_values = self.own.materialize()
        return torch.cat([k, own_keys], dim=-2), torch.cat([v, own_values], dim=-2)

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """A reuse layer's decode: the source's stored K/V read through the map folded into the query (keys) and
        applied after attention (values), joined in one softmax with its own K/V (residual window, or after a
        fall-back); with ``align=none`` and no own K/V, the source's own attention."""
        if self.map.key_mix is None:
            if self.own is None:
                return self.source.own.attend(query, scaling)
            return attend_kv(query, *self._rebuilt(), scaling)
        key_stream, value_stream = source_streams(self.source.own)
        if self.own is None:
            return self.map.attend(query, key_stream, value_stream, self.length, scaling)
        own_keys, own_values = self.own.materialize()
        return self.map.attend(query, key_stream, value_stream, self.own_start, scaling, own_keys, own_values)

    def _decide(self, key_states, value_states) -> str:
        """Reuse if this layer is a reuse candidate, its source keeps its K/V, and the prompt's similarity reaches
        :meth:`threshold_for` its length; a measuring store (calibration) keeps every layer and records each
        layer's per-token similarity."""
        src = self.source
        measuring = self.store.measuring
        if src is None or src.mode != "kept" or (self.thresholds is None and not measuring):
            return "kept"
        start, n = self.length, key_states.shape[-2]
        src_keys, src_values = src.own.materialize()  # similarity on what the inner backend stores
        pk, pv = self.map.predict(src_keys[..., start : start + n, :], src_values[..., start : start + n, :], start)
        if measuring:
            self.store.token_similarity[self.index] = token_similarity(key_states, value_states, pk, pv)
            return "kept"
        self.similarity = similarity(key_states, value_states, pk, pv)
        return "reuse" if self.similarity >= self.threshold_for(n) else "kept"

    def materialize(self):
        if self.mode == "kept":
            return self.own.materialize()
        raise RuntimeError("a reuse layer holds no K/V of its own to materialize")

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        if self.own is not None:
            self.own.reset()
        self.own = None
        self.is_initialized = False
        self.length = self.own_start = self.decode_steps = 0
        self.mode, self.fallback_at, self.probes = "undecided", None, []

    def nbytes(self) -> int:
        return self.own.nbytes() if self.own is not None else 0

    def allocated_bytes(self) -> int:
        return self.own.allocated_bytes() if self.own is not None else 0


class DCAStore(KVStore):
    """A dca sequence cache; tells the attention path which layers skip their K/V projections.

    Args:
        measuring: calibration only: keep every layer and record, per layer l >= 1, the per-token similarity of
            its K/V to the prediction from layer l - 1 as stored (``token_similarity``: layer → (tokens,)).
    """

    def __init__(self, backend: "DCABackend", measuring: bool = False):
        self.fallbacks = 0
        self.measuring = measuring
        self._chunked_prefill = backend.chunked_prefill
        self.token_similarity: dict[int, torch.Tensor] = {}
        layers = [DCALayer(self, i, backend.maps[i - 1] if i else None, backend)
                  for i in range(backend.geometry.num_layers)]
        super().__init__(layers)

    def skip_kv_projection(self, layer_idx: int) -> bool:
        return self.layers[layer_idx].skips_projection()

    @property
    def supports_chunked_prefill(self) -> bool:
        return self._chunked_prefill

    def reuse_layers(self) -> int:
        return sum(layer.reusing() for layer in self.layers)

    def own_tokens(self) -> list[int]:
        """Per layer, the tokens it stores itself: all for a kept layer, none for a reuse layer, those from
        its fall-back position on after a fall-back."""
        return [layer.own.get_seq_length() if layer.own is not None else 0 for layer in self.layers]

    def stats(self) -> dict:
        return {"dca_reuse_layers": self.reuse_layers(), "dca_fallbacks": self.fallbacks}
