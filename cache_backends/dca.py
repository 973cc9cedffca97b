"""``dca``: cross-layer KV reuse with a runtime similarity check and fall-back.

Method (after MiniCache, arXiv 2405.14366, and CLA, arXiv 2405.12981, decided per sequence at run
time): a layer l whose keys and values are well predicted from the layer before it (its *source*,
m = l - 1) stores nothing and, during decode, attends with K/V rebuilt from the source's cache.

* Prediction (``KV_DCA_ALIGN``): ``none`` takes m's K/V as they are; ``linear`` maps m's pre-RoPE
  [K ; V] (2·H·d wide) to l's through an affine map fitted by least squares on the calibration slice,
  then applies RoPE at each cached position.
* Similarity of l to m: the mean cosine, over tokens and heads, between l's own K and the predicted K,
  averaged with the same for V.
* Prefill: each layer's similarity is re-measured on the prompt; a layer whose source is kept and
  whose similarity is at least ``KV_DCA_THRESHOLD`` becomes a reuse layer for this sequence (so no
  reuse layer depends on another). Prefill itself attends with the layer's own K/V.
* Decode: a reuse layer skips its K/V projections (:mod:`cache_backends.dca_attention`) and attends with
  K/V rebuilt from the source. Every ``KV_DCA_PROBE_INTERVAL`` decode steps it computes its true K/V
  for the current token and compares; below the threshold it *falls back*: from that token on it
  computes and stores its own K/V. Positions before the fall-back keep being served from the rebuild
  (they were never stored); positions from the fall-back on come from its own cache.

Storage per sequence: kept layers hold K and V like ``full``, (1, H, seq_len, d); reuse layers hold
nothing (after a fall-back, their own K/V from the fall-back position on). Bytes per token per layer:
``(1 - f) * 2 * H * d * B`` with f the fraction of reuse layers (the backend's formula uses the
fraction calibration predicts; a store reports its own). The maps (2Hd+1 x 2Hd per layer) are
per-model constants. A threshold above 1 reuses nothing (identity check).
"""

from __future__ import annotations

import torch

from cache_backends.base import KVBackend, KVLayer, KVStore, ModelGeometry
from cache_backends.rope import RopeTable

ALIGNS = ("linear", "none")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine over every vector along the last dimension."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean().item()


class LayerMap:
    """Predicts layer l's K (after RoPE) and V from its source layer's.

    Args:
        weight: (2Hd + 1, 2Hd) affine map on pre-RoPE [K ; V] (last row = bias), or ``None`` for ``none``.
        rope: the model's RoPE table.
    """

    def __init__(self, weight: torch.Tensor | None, rope: RopeTable):
        self.weight = weight
        self.rope = rope

    def predict(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, H, n, d) source K (after RoPE) and V at positions start.. → predicted K (after RoPE) and V."""
        if self.weight is None:
            return keys, values
        b, h, n, d = keys.shape
        k_pre = self.rope.invert(keys, start)
        x = torch.cat([k_pre.transpose(1, 2).reshape(b, n, h * d), values.transpose(1, 2).reshape(b, n, h * d)], -1)
        w = self.weight.to(x.dtype)
        y = x @ w[:-1] + w[-1]  # (b, n, 2Hd)
        k_hat = y[..., : h * d].reshape(b, n, h, d).transpose(1, 2)
        v_hat = y[..., h * d :].reshape(b, n, h, d).transpose(1, 2)
        return self.rope.apply(k_hat, start), v_hat


def fit_map(src_k, src_v, dst_k, dst_v) -> torch.Tensor:
    """Least-squares affine map from the source's pre-RoPE [K ; V] to the destination's, (2Hd + 1, 2Hd)."""
    x = torch.cat([src_k.flatten(1), src_v.flatten(1), torch.ones(src_k.shape[0], 1)], 1).double()
    y = torch.cat([dst_k.flatten(1), dst_v.flatten(1)], 1).double()
    return torch.linalg.lstsq(x, y).solution.float()


def similarity(own_k, own_v, pred_k, pred_v) -> float:
    """(cos(K) + cos(V)) / 2, each the mean over tokens and heads."""
    return 0.5 * (cosine(own_k, pred_k) + cosine(own_v, pred_v))


class DCALayer(KVLayer):
    """One layer of a dca store: ``kept`` (its own inner layer), or ``reuse`` (nothing, or an inner layer of
    its own K/V from the fall-back position on)."""

    def __init__(self, store: "DCAStore", index: int, layer_map: LayerMap | None, backend: "DCABackend"):
        super().__init__()
        self.store = store
        self.index = index
        self.map = layer_map  # None for layer 0 (no source)
        self.backend = backend
        self.threshold = backend.threshold
        self.probe_interval = backend.probe_interval
        self.mode = "undecided"
        self.own: KVLayer | None = None  # the inner backend's layer holding this layer's own K/V
        self.length = 0
        self.decode_steps = 0
        self.fallback_at: int | None = None
        self.similarity: float | None = None

    @property
    def source(self) -> "DCALayer | None":
        return self.store.layers[self.index - 1] if self.map is not None else None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def reusing(self) -> bool:
        """Reusing its source right now (a reuse layer that has not fallen back)."""
        return self.mode == "reuse" and self.fallback_at is None

    def probe_due(self) -> bool:
        return (self.decode_steps + 1) % self.probe_interval == 0

    def skips_projection(self) -> bool:
        return self.reusing() and not self.probe_due()

    def update(self, key_states, value_states, *args, **kwargs):
        """Decide (prefill), store, and return the K/V this layer attends with, (1, H, seq_len, d).

        ``key_states``/``value_states`` are ``None`` when the attention skipped its projections.
        """
        self.is_initialized = True
        start = self.length
        if self.mode == "undecided":
            self.mode = self._decide(key_states, value_states)
            self.length += key_states.shape[-2]
            if self.mode == "kept":
                self.own = self.backend.inner.new_layer(self.index, 0)
                return self.own.update(key_states, value_states)
            return key_states, value_states  # a reuse layer's prefill attends with its own K/V, then drops them
        if self.mode == "kept":
            self.length += key_states.shape[-2]
            return self.own.update(key_states, value_states)
        # reuse layer, decode: the source has already taken this step's tokens
        src_keys, src_values = self.source.own.materialize()  # what the source stores, rebuilt (transient)
        n = src_keys.shape[-2] - start
        if key_states is not None and self.reusing() and self.probe_due():
            pk, pv = self.map.predict(src_keys[..., start:, :], src_values[..., start:, :], start)
            if similarity(key_states, value_states, pk, pv) < self.threshold:
                self.fallback_at = start
                self.own = self.backend.inner.new_layer(self.index, start)
                self.store.fallbacks += 1
        own_kv = self.own.update(key_states, value_states) if self.fallback_at is not None else None
        self.length += n
        self.decode_steps += 1
        upto = self.fallback_at if self.fallback_at is not None else self.length
        k, v = self.map.predict(src_keys[..., :upto, :], src_values[..., :upto, :], 0)
        if own_kv is not None:
            return torch.cat([k, own_kv[0]], dim=-2), torch.cat([v, own_kv[1]], dim=-2)
        return k, v

    def _decide(self, key_states, value_states) -> str:
        src = self.source
        if src is None or src.mode != "kept" or self.threshold > 1:
            return "kept"
        start, n = self.length, key_states.shape[-2]
        src_keys, src_values = src.own.materialize()  # similarity on what the inner backend stores
        pk, pv = self.map.predict(src_keys[..., start : start + n, :], src_values[..., start : start + n, :], start)
        self.similarity = similarity(key_states, value_states, pk, pv)
        return "reuse" if self.similarity >= self.threshold else "kept"

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
        self.length = 0

    def nbytes(self) -> int:
        return self.own.nbytes() if self.own is not None else 0


class DCAStore(KVStore):
    """A dca sequence cache; tells the attention path which layers skip their K/V projections."""

    def __init__(self, backend: "DCABackend"):
        self.fallbacks = 0
        layers = [DCALayer(self, i, backend.maps[i - 1] if i else None, backend)
                  for i in range(backend.geometry.num_layers)]
        super().__init__(layers)

    def skip_kv_projection(self, layer_idx: int) -> bool:
        return self.layers[layer_idx].skips_projection()

    def reuse_layers(self) -> int:
        return sum(layer.reusing() for layer in self.layers)

    def stats(self) -> dict:
        return {"dca_reuse_layers": self.reuse_layers(), "dca_fallbacks": self.fallbacks}


class DCABackend(KVBackend):
    """Cross-layer KV reuse with a similarity fall-back.

    Args:
        geometry: the model's attention shape.
        threshold: similarity at or above which a layer reuses its source (``KV_DCA_THRESHOLD``, 0.98);
            above 1 nothing is reused.
        probe_interval: decode steps between checks of a reuse layer (``KV_DCA_PROBE_INTERVAL``, 16).
        align: ``linear`` (fitted map) or ``none`` (``KV_DCA_ALIGN``).

    Raises:
        ValueError: for a probe interval below 1 or an unknown ``align``.
    """

    name = "dca"

    def __init__(self, geometry: ModelGeometry, threshold: float = 0.98, probe_interval: int = 16,
                 align: str = "linear", inner: KVBackend | None = None):
        if probe_interval < 1:
            raise ValueError(f"KV_DCA_PROBE_INTERVAL={probe_interval} must be >= 1")
        if align not in ALIGNS:
            raise ValueError(f"KV_DCA_ALIGN={align!r}; allowed: {', '.join(ALIGNS)}")
        super().__init__(geometry, threshold=threshold, probe_interval=probe_interval, align=align)
        self.threshold, self.probe_interval, self.align = threshold, probe_interval, align
        from cache_backends.full import FullBackend

        self.inner = inner if inner is not None else FullBackend(geometry)
        if inner is not None:
            self.options.update(inner.params())
        self.maps: list[LayerMap] | None = None
        self.calibration: dict[str, list[float]] = {}

    def prepare(self, model, calibration_ids: list[int] | None = None) -> None:
        """Fit the maps, measure per-layer similarity on the calibration slice, install the attention path."""
        from cache_backends import dca_attention
        from cache_backends.calibration import calibration_ids as calib_ids
        from cache_backends.calibration import collect_kv

        ids = calibration_ids if calibration_ids is not None else calib_ids(model)
        self.inner.prepare(model, ids)
        kv = collect_kv(model, self.geometry, ids, desc="dca calibration")
        rope = RopeTable(model, model.config.max_position_embeddings)
        device = next(model.parameters()).device
        self.maps, raw, aligned = [], [], []
        for (sk, sv), (dk, dv) in zip(kv, kv[1:]):
            weight = fit_map(sk, sv, dk, dv)
            raw.append(similarity(dk, dv, sk, sv))
            pred = torch.cat([sk.flatten(1), sv.flatten(1), torch.ones(sk.shape[0], 1)], 1) @ weight
            h = dk.flatten(1).shape[1]
            aligned.append(similarity(dk, dv, pred[:, :h].reshape(dk.shape), pred[:, h:].reshape(dv.shape)))
            self.maps.append(LayerMap(weight.to(device) if self.align == "linear" else None, rope))
        self.calibration = {"similarity_none": [round(x, 4) for x in raw],
                            "similarity_linear": [round(x, 4) for x in aligned]}
        dca_attention.install(model)

    def expected_reuse_fraction(self) -> float:
        """Fraction of layers calibration predicts to be reused (alternating rule: a source must be kept)."""
        sims = self.calibration.get(f"similarity_{self.align}", [])
        reused, prev_reused = 0, False
        for s in sims:  # layers 1 .. L-1
            now = (not prev_reused) and s >= self.threshold and self.threshold <= 1
            reused += now
            prev_reused = now
        return reused / self.geometry.num_layers

    def details(self) -> dict:
        return {"calibration_similarity_by_layer": {"layers": list(range(1, self.geometry.num_layers)),
                                                    **self.calibration},
                "expected_reuse_fraction": self.expected_reuse_fraction()}

    def new_store(self) -> KVStore:
        if self.maps is None:
            raise RuntimeError("dca backend used before prepare(model)")
        return DCAStore(self)

    def new_layer(self, index: int, position_offset: int = 0) -> KVLayer:
        raise RuntimeError("dca layers belong to a DCAStore; use new_store()")

    def bytes_per_token_per_layer(self, seq_len: int = 1024) -> float:
        """(1 - expected reuse fraction) x the inner backend's bytes per token per layer."""
        return (1 - self.expected_reuse_fraction()) * self.inner.bytes_per_token_per_layer(seq_len)
