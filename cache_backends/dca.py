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
``(1 - f) * 2 * H * d * B`` with f the fraction of reuse layers (the inner backend's sum in place of
``2 * H * d * B`` for ``dca+int8`` and ``dca+mla``). f depends on the input, so it is counted two ways:
``bytes_per_token_per_layer`` (``/info``, ``kvserve estimate``) takes the calibrated f, the layers the
prefill decision itself reuses on the calibration windows, prefilled into real stores (so a
composition's similarity is measured on what its inner backend stores, as in serving);
``live_bytes_per_token_per_layer(store)`` takes the store's own reuse and fall-backs, and equals its
``nbytes()``. The maps (2Hd+1 x 2Hd per layer) are per-model constants, fitted once with every similarity
and kept in the calibration cache (:mod:`cache_backends.calibration_cache`; no dca parameter changes them);
the calibrated reuse is measured at each start (it depends on the threshold and the inner backend).
A threshold above 1 reuses nothing (identity check).
"""

from __future__ import annotations

import torch

from cache_backends.attention import LayerRead
from cache_backends.base import KVBackend, KVLayer, KVStore, ModelGeometry
from cache_backends.estimate import dca_store_bytes_per_token_per_layer
from cache_backends.rope import RopeTable

ALIGNS = ("linear", "none")
FIT_VERSION = 1  # of the calibration cache entry (bump when the fit changes)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine over every vector along the last dimension."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean().item()


def _complex(x: torch.Tensor) -> torch.Tensor:
    """(..., d) real → (..., d/2) complex: channel i pairs with i + d/2 (transformers' rotate_half layout)."""
    half = x.shape[-1] // 2
    return torch.complex(x[..., :half], x[..., half:])


def _real(z: torch.Tensor) -> torch.Tensor:
    return torch.cat([z.real, z.imag], dim=-1)


class LayerMap:
    """Predicts layer l's K (after RoPE) and V from its source layer m's, in a form attention can fold.

    Keys: per rotary frequency pair i, the destination's pair of head h is a complex combination of the
    source's pairs over heads, plus a bias: ``z_l[h,i] = Σ_g A[h,g,i] z_m[g,i] + b[h,i]`` (pre-RoPE).
    RoPE multiplies every head's pair i by the same phase, so the map commutes with it: post-RoPE
    source keys map to post-RoPE destination keys (the bias rotated to each position), and a query
    folds the map in: ``q_h · K̂_{h,t} = Σ_g (conj(A[h,g]) ⊙ q_h) · K_{g,t} + q_h · R_t b_h``.
    Values: ``V̂_l[h] = Σ_g V_m[g] W[g,h] + c_h``, applied after attention:
    ``o_h = Σ_g (Σ_t p_{h,t} V_{m,g,t}) W[g,h] + c_h``.

    Args:
        key_mix: (H, H, d/2) complex ``A`` (destination head, source head, pair); ``None`` for ``none``.
        key_bias: (H, d) pre-RoPE bias (real layout).
        value_map: (H, H, d, d) ``W`` (source head, destination head, in, out); value_bias: (H, d).
        rope: the model's RoPE table.
    """

    def __init__(self, key_mix, key_bias, value_map, value_bias, rope: RopeTable):
        self.key_mix, self.key_bias = key_mix, key_bias
        self.value_map, self.value_bias = value_map, value_bias
        self.rope = rope

    @classmethod
    def fit(cls, src_k, src_v, dst_k, dst_v, rope: RopeTable) -> "LayerMap":
        """Least squares on calibration K (pre-RoPE) and V, each (tokens, H, d)."""
        n, h, d = src_k.shape
        ones = torch.ones(n, 1, dtype=torch.complex128)
        zs, zd = _complex(src_k.double()), _complex(dst_k.double())  # (tokens, H, d/2)
        mix = torch.zeros(h, h, d // 2, dtype=torch.complex128)
        bias = torch.zeros(h, d // 2, dtype=torch.complex128)
        for i in range(d // 2):
            sol = torch.linalg.lstsq(torch.cat([zs[:, :, i], ones], 1), zd[:, :, i]).solution  # (H + 1, H)
            mix[:, :, i] = sol[:h].T
            bias[:, i] = sol[h]
        x = torch.cat([src_v.flatten(1).double(), torch.ones(n, 1, dtype=torch.float64)], 1)
        w = torch.linalg.lstsq(x, dst_v.flatten(1).double()).solution  # (Hd + 1, Hd)
        value_map = w[:-1].reshape(h, d, h, d).permute(0, 2, 1, 3)  # (source, destination, in, out)
        return cls(mix.to(torch.complex64), _real(bias).float(), value_map.float(), w[-1].reshape(h, d).float(), rope)

    def predict_pre_rope(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Calibration-side prediction: (tokens, H, d) pre-RoPE source K and V → predicted K (pre-RoPE), V."""
        z = torch.einsum("hgi,ngi->nhi", self.key_mix, _complex(keys.float()))
        v_hat = torch.einsum("ngd,ghde->nhe", values.float(), self.value_map) + self.value_bias
        return _real(z) + self.key_bias, v_hat

    def to(self, device) -> "LayerMap":
        if self.key_mix is not None:
            self.key_mix, self.key_bias = self.key_mix.to(device), self.key_bias.to(device)
            self.value_map, self.value_bias = self.value_map.to(device), self.value_bias.to(device)
        return self

    def _rotated_bias(self, start: int, n: int, dtype) -> torch.Tensor:
        """The key bias after RoPE at positions start .. start + n - 1: (H, n, d)."""
        stop = start + n
        table = getattr(self, "_bias_table", None)
        if table is None or table.shape[1] < stop or table.dtype != dtype:  # a per-model constant, grown x2
            h, d = self.key_bias.shape
            size = max(stop, 2 * table.shape[1] if table is not None else 1024)
            table = self.rope.apply(self.key_bias.to(dtype)[:, None, :].expand(h, size, d), 0)
            self._bias_table = table
        return table[:, start:stop]

    def predict(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, H, n, d) source K (after RoPE) and V at positions start.. → predicted K (after RoPE) and V."""
        if self.key_mix is None:
            return keys, values
        n = keys.shape[-2]
        z = torch.einsum("hgi,bgni->bhni", self.key_mix, _complex(keys.float()))
        k_hat = _real(z).to(keys.dtype) + self._rotated_bias(start, n, keys.dtype)
        v_hat = torch.einsum("bgnd,ghde->bhne", values.float(), self.value_map)  # fp32: see attend
        return k_hat, (v_hat + self.value_bias[None, :, None, :]).to(values.dtype)

    def attend(self, query: torch.Tensor, key_stream, value_stream, length: int, scaling: float) -> torch.Tensor:
        """Decode attention of one query over the predicted K/V, read from the source's stored streams.

        Args:
            query: (1, Hq, 1, d) after RoPE.
            key_stream, value_stream: the source's key and value storage (``dot``/``weighted_sum``), H heads,
                ``length`` tokens.

        Returns:
            (1, Hq, 1, d).
        """
        _, hq, _, d = query.shape
        h = self.key_bias.shape[0]
        head = torch.arange(hq, device=query.device) // (hq // h)  # each query head's K/V head
        q = query[0, :, 0]  # (Hq, d)
        folded = _real(self.key_mix[head].conj() * _complex(q.float())[:, None, :]).to(q.dtype)  # (Hq, H, d)
        scores = key_stream.dot(folded.transpose(0, 1)[None]).sum(1)[0]  # (Hq, length)
        bias = self._rotated_bias(0, length, q.dtype)[head]  # (Hq, length, d)
        scores = scores + torch.einsum("hd,htd->ht", q, bias)
        probs = torch.softmax(scores * scaling, dim=-1)  # (Hq, length)
        mixed = value_stream.weighted_sum(probs[None, None].expand(1, h, hq, length))[0]  # (H, Hq, d)
        # The least-squares value map cancels large weights (column L1 norms ~1e4 on the reference model):
        # applied in bf16 its rounding alone moved outputs by ~0.05 (of ~2), so it is applied in fp32 (a
        # (H, Hq, d, d) product, nothing per token), and the result is returned in the query's dtype.
        out = torch.einsum("ghd,ghde->he", mixed.float(), self.value_map[:, head]) + self.value_bias[head]
        return out.to(query.dtype)[None, :, None, :]


def fit_full_linear_map(src_k, src_v, dst_k, dst_v) -> torch.Tensor:
    """The unrestricted least-squares affine map [K ; V] → [K ; V] (pre-RoPE), (2Hd + 1, 2Hd): reported in
    calibration as the fidelity ceiling of a linear predictor (it does not commute with RoPE, so serving
    it means rebuilding every source token per step)."""
    x = torch.cat([src_k.flatten(1), src_v.flatten(1), torch.ones(src_k.shape[0], 1)], 1).double()
    y = torch.cat([dst_k.flatten(1), dst_v.flatten(1)], 1).double()
    return torch.linalg.lstsq(x, y).solution.float()


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
                self.own = self._own_layer(0, self.in_place)  # a kept layer attends in place
                return self.own.update(key_states, value_states)
            return key_states, value_states  # a reuse layer's prefill attends with its own K/V, then drops them
        if self.mode == "kept":
            self.length += key_states.shape[-2]
            return self.own.update(key_states, value_states)
        # reuse layer, decode: the source has already taken this step's tokens
        n = self.source.length - start
        if key_states is not None and self.reusing() and self.probe_due():
            src_keys, src_values = self.source.own.materialize()  # probe steps only (transient)
            pk, pv = self.map.predict(src_keys[..., start:, :], src_values[..., start:, :], start)
            if similarity(key_states, value_states, pk, pv) < self.threshold:
                self.fallback_at = start
                self.own = self._own_layer(start, False)  # its K/V join the rebuilt ones below
                self.store.fallbacks += 1
        self.length += n
        self.decode_steps += 1
        if self.fallback_at is None:
            if self.in_place:
                return LayerRead(self), None  # attends the source's cache with folded maps (attend)
            src_keys, src_values = self.source.own.materialize()
            return self.map.predict(src_keys, src_values, 0)
        # after a fall-back: positions before it rebuilt from the source, its own K/V from there on
        own_kv = self.own.update(key_states, value_states)
        src_keys, src_values = self.source.own.materialize()
        k, v = self.map.predict(src_keys[..., : self.fallback_at, :], src_values[..., : self.fallback_at, :], 0)
        return torch.cat([k, own_kv[0]], dim=-2), torch.cat([v, own_kv[1]], dim=-2)

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """A reuse layer's decode: the source's stored K/V read through the map folded into the query
        (keys) and applied after attention (values); with ``align=none`` the source's own attention."""
        if self.map.key_mix is None:
            return self.source.own.attend(query, scaling)
        key_stream, value_stream = source_streams(self.source.own)
        return self.map.attend(query, key_stream, value_stream, self.length, scaling)

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

    def allocated_bytes(self) -> int:
        return self.own.allocated_bytes() if self.own is not None else 0


class DCAStore(KVStore):
    """A dca sequence cache; tells the attention path which layers skip their K/V projections."""

    def __init__(self, backend: "DCABackend"):
        self.fallbacks = 0
        layers = [DCALayer(self, i, backend.maps[i - 1] if i else None, backend)
                  for i in range(backend.geometry.num_layers)]
        super().__init__(layers)

    def skip_kv_projection(self, layer_idx: int) -> bool:
        return self.layers[layer_idx].skips_projection()

    @property
    def supports_chunked_prefill(self) -> bool:
        return False  # each layer decides kept/reuse once, on the whole prompt

    def reuse_layers(self) -> int:
        return sum(layer.reusing() for layer in self.layers)

    def own_tokens(self) -> list[int]:
        """Per layer, the tokens it stores itself: all for a kept layer, none for a reuse layer, those from
        its fall-back position on after a fall-back."""
        return [layer.own.get_seq_length() if layer.own is not None else 0 for layer in self.layers]

    def stats(self) -> dict:
        return {"dca_reuse_layers": self.reuse_layers(), "dca_fallbacks": self.fallbacks}


class DCABackend(KVBackend):
    """Cross-layer KV reuse with a similarity fall-back.

    Args:
        geometry: the model's attention shape.
        threshold: similarity at or above which a layer reuses its source (``KV_DCA_THRESHOLD``, 0.95;
            the RoPE-commuting map reaches 0.96-0.98 on the reference model);
            above 1 nothing is reused.
        probe_interval: decode steps between checks of a reuse layer (``KV_DCA_PROBE_INTERVAL``, 16).
        align: ``linear`` (fitted map) or ``none`` (``KV_DCA_ALIGN``).

    Raises:
        ValueError: for a probe interval below 1 or an unknown ``align``.
    """

    name = "dca"

    def __init__(self, geometry: ModelGeometry, threshold: float = 0.95, probe_interval: int = 16,
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
        self.calibration_reuse: list[tuple[int, int]] = []  # per calibration window: (tokens, reuse layers)

    def prepare(self, model, calibration_ids: list[int] | None = None, cache=None) -> None:
        """Fit the maps and measure per-layer similarity on the calibration slice (or load both from
        ``cache``: no parameter of dca changes them), prepare the inner backend, install the attention path,
        and count the layers the prefill decision reuses on each calibration window (the calibrated reuse
        share, measured at every start: it depends on the threshold and on what the inner backend stores)."""
        from cache_backends import dca_attention
        from cache_backends.calibration import calibration_ids as calib_ids
        from cache_backends.calibration_cache import CalibrationCache

        ids = calibration_ids if calibration_ids is not None else calib_ids(model)
        self.inner.prepare(model, ids, cache)
        rope = RopeTable(model, model.config.max_position_embeddings)
        device = next(model.parameters()).device
        self.maps, self.calibration = (cache or CalibrationCache()).fetch(
            "dca", model, ids, {}, fit=lambda: self._fit(model, ids, rope),
            load=lambda tensors, figures: (self._load(tensors, rope, device), figures), version=FIT_VERSION)
        dca_attention.install(model)
        self.calibration_reuse = self._served_reuse(model, ids)

    def _fit(self, model, ids: list[int], rope: RopeTable) -> tuple[dict[str, torch.Tensor], dict]:
        """Per layer l >= 1, as ``{l}.*``: the :class:`LayerMap` from layer l - 1 (its complex key mix as
        (H, H, d/2, 2) real and imaginary parts); figures: the similarities of :meth:`details`."""
        from cache_backends.calibration import collect_kv

        kv = collect_kv(model, self.geometry, ids, desc="dca calibration")
        tensors, raw, aligned, unrestricted = {}, [], [], []
        for layer, ((sk, sv), (dk, dv)) in enumerate(zip(kv, kv[1:]), start=1):
            raw.append(similarity(dk, dv, sk, sv))
            layer_map = LayerMap.fit(sk, sv, dk, dv, rope)
            aligned.append(similarity(dk, dv, *layer_map.predict_pre_rope(sk, sv)))
            weight = fit_full_linear_map(sk, sv, dk, dv)
            pred = torch.cat([sk.flatten(1), sv.flatten(1), torch.ones(sk.shape[0], 1)], 1) @ weight
            h = dk.flatten(1).shape[1]
            unrestricted.append(similarity(dk, dv, pred[:, :h].reshape(dk.shape), pred[:, h:].reshape(dv.shape)))
            tensors.update({f"{layer}.key_mix": torch.view_as_real(layer_map.key_mix),
                            f"{layer}.key_bias": layer_map.key_bias, f"{layer}.value_map": layer_map.value_map,
                            f"{layer}.value_bias": layer_map.value_bias})
        return tensors, {"similarity_none": [round(x, 4) for x in raw],
                         "similarity_linear": [round(x, 4) for x in aligned],
                         "similarity_full_linear": [round(x, 4) for x in unrestricted]}

    def _load(self, tensors: dict[str, torch.Tensor], rope: RopeTable, device) -> list[LayerMap]:
        """The maps of layers 1 .. L-1 on ``device`` (empty maps for ``align=none``)."""
        from cache_backends.calibration_cache import take

        h, d = self.geometry.num_key_value_heads, self.geometry.head_dim
        maps = []
        for layer in range(1, self.geometry.num_layers):
            parts = [take(tensors, f"{layer}.{name}", shape) for name, shape in (
                ("key_mix", (h, h, d // 2, 2)), ("key_bias", (h, d)), ("value_map", (h, h, d, d)),
                ("value_bias", (h, d)))]
            if self.align == "none":
                maps.append(LayerMap(None, None, None, None, rope))
                continue
            key_mix, key_bias, value_map, value_bias = parts
            maps.append(LayerMap(torch.view_as_complex(key_mix.contiguous()), key_bias, value_map, value_bias,
                                 rope).to(device))
        return maps

    def expected_reuse_layers(self) -> list[int]:
        """The layers the calibration similarities (mean over the slice) predict to be reused at this threshold
        (alternating rule: a source must be kept); what stores really reuse is :meth:`expected_reuse_fraction`."""
        sims = self.calibration.get(f"similarity_{self.align}", [])
        reused, prev_reused = [], False
        for layer, s in enumerate(sims, start=1):
            now = (not prev_reused) and s >= self.threshold and self.threshold <= 1
            if now:
                reused.append(layer)
            prev_reused = now
        return reused

    @torch.no_grad()
    def _served_reuse(self, model, ids: list[int]) -> list[tuple[int, int]]:
        """Prefill each calibration window into a store of this backend, as serving does, and count the
        layers its decision reuses: ``[(tokens, reuse layers), ...]``."""
        from cache_backends.calibration import CALIBRATION_WINDOW

        device = next(model.parameters()).device
        out = []
        for start in range(0, len(ids), CALIBRATION_WINDOW):
            chunk = ids[start : start + CALIBRATION_WINDOW]
            store = self.new_store()
            model(input_ids=torch.tensor([chunk], device=device), cache=store, use_cache=True, logits_to_keep=1)
            out.append((len(chunk), store.reuse_layers()))
            store.release()
        return out

    def expected_reuse_fraction(self) -> float:
        """Fraction of layers reused on the calibration windows (token-weighted), by the prefill decision
        itself; 0 before :meth:`prepare`."""
        tokens = sum(n for n, _ in self.calibration_reuse)
        return sum(n * r for n, r in self.calibration_reuse) / (tokens * self.geometry.num_layers) if tokens else 0.0

    def details(self) -> dict:
        return {"calibration_similarity_by_layer": {"layers": list(range(1, self.geometry.num_layers)),
                                                    **self.calibration},
                "calibration_reuse_layers_by_window": [r for _, r in self.calibration_reuse],
                "expected_reuse_fraction": self.expected_reuse_fraction()}

    def new_store(self) -> KVStore:
        if self.maps is None:
            raise RuntimeError("dca backend used before prepare(model)")
        return DCAStore(self)

    def new_layer(self, index: int, position_offset: int = 0) -> KVLayer:
        raise RuntimeError("dca layers belong to a DCAStore; use new_store()")

    def sums_spec(self) -> tuple[str, dict]:
        """``dca`` (or ``dca+<inner>``) at the calibrated reuse fraction, with the inner backend's options:
        (1 - f) x the inner backend's sum."""
        inner, options = self.inner.sums_spec()
        return ("dca" if inner == "full" else f"dca+{inner}"), {"reuse_fraction": self.expected_reuse_fraction(),
                                                                **options}

    def live_bytes_per_token_per_layer(self, store: "DCAStore") -> float:
        """The sums over this sequence's own layers: its reuse decisions and fall-backs, not the calibrated
        fraction."""
        return dca_store_bytes_per_token_per_layer(store.own_tokens(), store.num_tokens(),
                                                   self.inner.bytes_per_token_per_layer)

    def reserved_bytes(self, max_tokens: int) -> int:
        """Every layer kept (the upper bound: a sequence may reuse no layer, or fall back everywhere)."""
        return self.inner.reserved_bytes(max_tokens)
