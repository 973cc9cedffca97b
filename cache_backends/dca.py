"""``dca``: cross-layer KV reuse with a runtime similarity check and fall-back.

Method (after MiniCache, arXiv 2405.14366, and CLA, arXiv 2405.12981, decided per sequence at run
time): a layer l whose keys and values are well predicted from the layer before it (its *source*,
m = l - 1) stores only a residual window of its newest tokens and, during decode, attends with K/V
predicted from the source's cache for the older ones.

* Prediction (``KV_DCA_ALIGN``): ``none`` takes m's K/V as they are; ``linear`` maps m's K/V to l's through
  a calibrated map that commutes with RoPE (:class:`LayerMap`: per frequency pair a complex mix across
  heads for keys, a linear map for values; ridge least squares, so that int8 or low-rank error in the
  source is not amplified).
* Similarity of l to m: the mean cosine, over tokens and heads, between l's own K and the predicted K,
  averaged with the same for V.
* Calibration (every start; the maps themselves are cached): each calibration window is prefilled into a
  measuring store of this backend, so the source K/V are what the inner backend stores (``dca+int8``:
  int8). Per layer: its mean similarity, and its *runtime thresholds*, the 1% quantile of the mean
  similarity over spans of 1, 4, 16 ... 1024 tokens (:func:`span_thresholds`: short spans vary more).
  The *reuse candidates* are the largest set of non-adjacent layers whose mean similarity reaches
  ``KV_DCA_THRESHOLD`` (:func:`select_reuse_layers`; a reuse layer's source keeps its K/V).
* Prefill: a candidate whose source is kept becomes a reuse layer for this sequence when the prompt's
  similarity reaches its runtime threshold at the prompt's length (capped by ``KV_DCA_THRESHOLD``).
  Prefill itself attends with the layer's own K/V; a reuse layer keeps the newest of them (its window).
* Decode: a reuse layer attends with the source's cache read through the folded maps and its own window,
  in one softmax. With ``KV_DCA_WINDOW=0`` it skips its K/V projections
  (:mod:`cache_backends.dca_attention`) between probes. Every ``KV_DCA_PROBE_INTERVAL`` decode steps it
  compares its true K/V for the current token with the prediction; the mean over its latest 4 probes below
  the runtime threshold for that many tokens makes it *fall back*: from then on it keeps all its own K/V
  (its window stops sliding). Older positions keep being served from the prediction.

Storage per sequence: kept layers hold K and V like ``full``, (1, H, seq_len, d); reuse layers hold their
window, the newest ``min(T, w + T % w)`` tokens (after a fall-back, everything from the window's start).
Bytes per token per layer: ``(1 - f) * 2 * H * d * B + f * 2 * H * d * B * window_tokens / T`` with f the
fraction of reuse layers (the inner backend's sum in place of ``2 * H * d * B`` for ``dca+int8`` and
``dca+mla``). f depends on the input, so it is counted two ways: ``bytes_per_token_per_layer`` (``/info``,
``kvserve estimate``) takes the calibrated f, the layers the prefill decision itself reuses on the
calibration windows, prefilled into real stores; ``live_bytes_per_token_per_layer(store)`` takes the
store's own reuse and fall-backs, and equals its ``nbytes()``. The maps (per layer (H, H, d/2) complex
and (H, H, d, d)) are per-model constants kept in the calibration cache
(:mod:`cache_backends.calibration_cache`; no dca parameter changes them). A threshold above 1 reuses
nothing (identity check).
"""

from __future__ import annotations

import logging
import time

import torch

from cache_backends.attention import LayerRead, attend_kv
from cache_backends.base import KVBackend, KVLayer, KVStore, ModelGeometry
from cache_backends.dca_plan import (PROBE_WINDOW, SPANS, DCALayout, Feedback, falls_back, probes_after,
                                     runtime_threshold, window_start)
from cache_backends.estimate import bytes_per_token_per_layer, dca_store_bytes_per_token_per_layer
from cache_backends.kv_spec import KVSpec
from cache_backends.page_layout import PageLayout
from cache_backends.paged import StreamRead, read_layer, write_layer
from cache_backends.paged_attention import grouped_rows, ungroup_rows
from cache_backends.step_meta import StepMeta
from cache_backends.rope import RopeTable

log = logging.getLogger("kvserve.dca")

ALIGNS = ("linear", "none")
FIT_VERSION = 3  # of the calibration cache entry (bump when the fit changes); 2: ridge maps; 3: similarity
# figures over every calibration token (2 carried token 0's)
RIDGE = 1e-5  # ridge of the map fits, relative to the mean diagonal of the Gram matrix (see LayerMap.fit)


def _complex(x: torch.Tensor) -> torch.Tensor:
    """(..., d) real → (..., d/2) complex: channel i pairs with i + d/2 (transformers' rotate_half layout)."""
    half = x.shape[-1] // 2
    return torch.complex(x[..., :half], x[..., half:])


def _real(z: torch.Tensor) -> torch.Tensor:
    return torch.cat([z.real, z.imag], dim=-1)


def ridge_solve(x: torch.Tensor, y: torch.Tensor, ridge: float) -> torch.Tensor:
    """argmin_w |x w - y|^2 + λ |w[:-1]|^2 with λ = ``ridge`` x mean(diag(x^H x)): the last column of ``x`` is
    the bias (ones) and is not shrunk. ``x`` (n, k), ``y`` (n, m), real or complex, float64 → w (k, m)."""
    gram = x.conj().T @ x
    shrink = torch.ones(gram.shape[0], dtype=torch.float64)
    shrink[-1] = 0
    gram = gram + torch.diag(ridge * gram.diagonal().real.mean() * shrink).to(gram.dtype)
    return torch.linalg.solve(gram, x.conj().T @ y)


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
    def fit(cls, src_k, src_v, dst_k, dst_v, rope: RopeTable, ridge: float = RIDGE) -> "LayerMap":
        """Ridge least squares on calibration K (pre-RoPE) and V, each (tokens, H, d).

        Plain least squares is ill-conditioned here (neighbouring layers' channels are nearly collinear): on
        the reference model its value maps had column L1 norms up to ~6600, so the 0.4% error of int8-stored
        source values became a 57% error in the prediction (similarity 0.98 → 0.69 in ``dca+int8``). A ridge
        of ``ridge`` x the mean diagonal of the Gram matrix (not on the bias) keeps the norms under ~70 at a
        cost of at most 0.0002 in exact-source similarity (:func:`ridge_solve`).
        """
        n, h, d = src_k.shape
        ones = torch.ones(n, 1, dtype=torch.complex128)
        zs, zd = _complex(src_k.double()), _complex(dst_k.double())  # (tokens, H, d/2)
        mix = torch.zeros(h, h, d // 2, dtype=torch.complex128)
        bias = torch.zeros(h, d // 2, dtype=torch.complex128)
        for i in range(d // 2):
            sol = ridge_solve(torch.cat([zs[:, :, i], ones], 1), zd[:, :, i], ridge)  # (H + 1, H)
            mix[:, :, i] = sol[:h].T
            bias[:, i] = sol[h]
        x = torch.cat([src_v.flatten(1).double(), torch.ones(n, 1, dtype=torch.float64)], 1)
        w = ridge_solve(x, dst_v.flatten(1).double(), ridge)  # (Hd + 1, Hd)
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
            self._by_query_head = self._bias_table = None
        return self

    def _per_query_head(self, hq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The maps laid out per query head as real matrices (constants, built once per head count), so that
        a decode step applies each with one batched product:

        * key fold (Hq, d, H·d): query head q's row ``q @ fold[q]`` is, per source head g, the query that scores
          g's stored keys as the mapped keys: per pair i, ``conj(A[h, g, i]) * q_i`` as a real 2x2 block
          ((a, -b), (b, a)) on (q_i, q_{i + d/2}), with h the query head's K/V head;
        * value map (Hq, H·d, d): the attention-weighted source values of every source head, concatenated,
          times it give the query head's output;
        * value bias (Hq, d)."""
        cached = getattr(self, "_by_query_head", None)
        if cached is None or cached[0] != hq:
            h, d = self.key_bias.shape
            head = torch.arange(hq, device=self.key_bias.device) // (hq // h)  # each query head's K/V head
            mix = self.key_mix[head]  # (Hq, H, d/2) complex
            a, b, i = mix.real, mix.imag, torch.arange(d // 2, device=mix.device)
            fold = torch.zeros(hq, h, d, d, device=mix.device)  # (query head, source head, in, out)
            fold[..., i, i], fold[..., i + d // 2, i] = a, b
            fold[..., i, i + d // 2], fold[..., i + d // 2, i + d // 2] = -b, a
            value_map = self.value_map[:, head].permute(1, 0, 2, 3).reshape(hq, h * d, d)
            cached = (hq, fold.permute(0, 2, 1, 3).reshape(hq, d, h * d), value_map.contiguous(),
                      self.value_bias[head])
            self._by_query_head = cached
        return cached[1:]

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

    def bias_at(self, positions: torch.Tensor, limit: int, dtype) -> torch.Tensor:
        """The key bias after RoPE at ``positions`` (B, T), each below ``limit`` (a padded slot's is clamped: its
        score is masked): (H, B, T, d)."""
        return self._rotated_bias(0, limit, dtype)[:, positions.clamp(max=limit - 1)]

    def predict(self, keys: torch.Tensor, values: torch.Tensor, start: int | torch.Tensor,
                limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H, n, d) source K (after RoPE) and V at positions ``start``.. (every row), or at ``start`` (B, n)
        positions of each row (all below ``limit``) → predicted K (after RoPE) and V."""
        if self.key_mix is None:
            return keys, values
        z = torch.einsum("hgi,bgni->bhni", self.key_mix, _complex(keys.float()))
        if isinstance(start, int):
            bias = self._rotated_bias(start, keys.shape[-2], keys.dtype)  # (H, n, d)
        else:
            bias = self.bias_at(start, limit, keys.dtype).transpose(0, 1)  # (B, H, n, d)
        k_hat = _real(z).to(keys.dtype) + bias
        v_hat = torch.einsum("bgnd,ghde->bhne", values.float(), self.value_map)  # fp32: see attend
        return k_hat, (v_hat + self.value_bias[None, :, None, :]).to(values.dtype)

    def attend(self, query: torch.Tensor, key_stream, value_stream, length: int, scaling: float,
               own_keys: torch.Tensor | None = None, own_values: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention of one query over the predicted K/V of the first ``length`` positions, read from the
        source's stored streams, and (optionally) the layer's own K/V of the positions after them, in one softmax.

        Args:
            query: (1, Hq, 1, d) after RoPE.
            key_stream, value_stream: the source's key and value storage (``dot``/``weighted_sum``), H heads;
                it may hold more than ``length`` tokens (those are served by ``own_keys``).
            length: positions served from the source.
            own_keys, own_values: (1, H, w, d), the layer's own K/V of positions ``length .. length + w - 1``.

        Returns:
            (1, Hq, 1, d).
        """
        _, hq, _, d = query.shape
        h = self.key_bias.shape[0]
        key_fold, value_map, value_bias = self._per_query_head(hq)
        q = query[0, :, 0]  # (Hq, d)
        grouped = q.reshape(h, hq // h, d)  # each K/V head's query heads together
        folded = (q.float()[:, None, :] @ key_fold).view(hq, h, d).to(q.dtype)  # (Hq, H, d), in fp32 (see below)
        scores = key_stream.dot(folded.transpose(0, 1)[None]).sum(1)[0]  # (Hq, stored)
        stored = scores.shape[-1]
        bias = self._rotated_bias(0, length, q.dtype)  # (H, length, d)
        scores = scores[:, :length] + torch.einsum("grd,gtd->grt", grouped, bias).reshape(hq, length)
        if own_keys is not None:
            own = torch.einsum("grd,gtd->grt", grouped, own_keys[0]).reshape(hq, -1)
            scores = torch.cat([scores, own], dim=-1)
        probs = torch.softmax(scores * scaling, dim=-1)  # (Hq, length [+ w])
        from_source = probs[:, :length]
        if stored > length:  # the source's newer tokens carry no weight here
            from_source = torch.nn.functional.pad(from_source, (0, stored - length))
        mixed = value_stream.weighted_sum(from_source[None, None].expand(1, h, hq, stored))[0]  # (H, Hq, d)
        # The value map is applied in fp32 (a (H, Hq, d, d) product, nothing per token): its weights are
        # large enough (column L1 norms up to ~70 after the ridge) that bf16 rounding would show.
        out = (mixed.float().transpose(0, 1).reshape(hq, 1, h * d) @ value_map)[:, 0]  # (Hq, d)
        out = out + value_bias * probs[:, :length].sum(-1, keepdim=True).float()
        if own_values is not None:
            window = probs[:, length:].reshape(h, hq // h, -1)
            out = out + (window @ own_values[0]).reshape(hq, d).float()
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


def token_similarity(own_k, own_v, pred_k, pred_v) -> torch.Tensor:
    """Per token, (cos(K) + cos(V)) / 2 averaged over heads: (1, H, n, d) inputs → (n,) float32 on the CPU.

    Raises:
        ValueError: for inputs of another layout (e.g. calibration's (tokens, H, d): use :func:`similarity`).
    """
    if own_k.dim() != 4 or own_k.shape[0] != 1:
        raise ValueError(f"token_similarity takes (1, H, n, d) inputs; got {tuple(own_k.shape)}")
    cos = torch.nn.functional.cosine_similarity
    both = cos(own_k.float(), pred_k.float(), dim=-1) + cos(own_v.float(), pred_v.float(), dim=-1)  # (1, H, n)
    return (0.5 * both.mean(1)[0]).cpu()


def similarity(own_k, own_v, pred_k, pred_v) -> float:
    """(cos(K) + cos(V)) / 2, each the mean over tokens and heads, for inputs of any layout whose last dimension
    is the head dimension: (1, H, n, d) as served (the mean of :func:`token_similarity`) or (tokens, H, d) as
    calibration collects them."""
    cos = torch.nn.functional.cosine_similarity
    both = cos(own_k.float(), pred_k.float(), dim=-1) + cos(own_v.float(), pred_v.float(), dim=-1)  # (..., H)
    return (0.5 * both).mean().item()


QUANTILE = 0.01  # a layer's runtime threshold: this quantile of its calibrated similarity over such spans


def span_thresholds(per_window: list[torch.Tensor], quantile: float = QUANTILE) -> dict[int, float]:
    """One layer's runtime thresholds: for each span n of :data:`SPANS`, the ``quantile`` of the mean
    per-token similarity over contiguous n-token spans of the calibration windows (each (tokens,)).
    Short spans vary more than long ones, so their thresholds are lower; a span longer than every window
    takes the windows' own means."""
    out = {}
    for n in SPANS:
        means = [w[: len(w) // n * n].reshape(-1, n).mean(1) for w in per_window if len(w) >= n]
        means = torch.cat(means) if means else torch.stack([w.mean() for w in per_window])
        out[n] = round(torch.quantile(means.double(), quantile).item(), 4)
    return out


def select_reuse_layers(mean_similarity: dict[int, float], threshold: float) -> list[int]:
    """The reuse candidates: the largest set of layers with calibrated similarity >= ``threshold`` in which no
    two are adjacent (a reuse layer's source must keep its own K/V); among equally large sets, the one with the
    highest summed similarity. Exact (dynamic programming over the layers in order)."""
    best = {0: (0, 0.0, [])}  # by "previous layer chosen" (1/0): (count, summed similarity, layers)
    best[1] = (-1, 0.0, [])
    for layer in sorted(mean_similarity):
        s = mean_similarity[layer]
        skip = max(best[0], best[1], key=lambda c: (c[0], c[1]))
        take = (best[0][0] + 1, best[0][1] + s, best[0][2] + [layer]) if s >= threshold else (-1, 0.0, [])
        best = {0: skip, 1: take}
    return max(best[0], best[1], key=lambda c: (c[0], c[1]))[2]


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
        self.token_similarity: dict[int, torch.Tensor] = {}
        layers = [DCALayer(self, i, backend.maps[i - 1] if i else None, backend)
                  for i in range(backend.geometry.num_layers)]
        super().__init__(layers)

    def skip_kv_projection(self, layer_idx: int) -> bool:
        return self.layers[layer_idx].skips_projection()

    @property
    def supports_chunked_prefill(self) -> bool:
        return DCABackend.chunked_prefill

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
        threshold: calibrated mean similarity at or above which a layer is a reuse candidate, and the cap of
            each candidate's runtime thresholds (``KV_DCA_THRESHOLD``, 0.95; the RoPE-commuting map reaches
            0.96-0.98 on the reference model); above 1 nothing is reused.
        probe_interval: decode steps between checks of a reuse layer (``KV_DCA_PROBE_INTERVAL``, 16).
        align: ``linear`` (fitted map) or ``none`` (``KV_DCA_ALIGN``).
        window: a reuse layer's residual window, tokens (``KV_DCA_WINDOW``, 32; 0: none).

    Raises:
        ValueError: for a probe interval below 1, a negative window, an unknown ``align``, or a window above
            ``(residual + group_size) / 2`` of a quantized inner backend (its window is held exact).
    """

    name = "dca"
    chunked_prefill = False  # each layer decides kept/reuse once, on the whole prompt

    def __init__(self, geometry: ModelGeometry, threshold: float = 0.95, probe_interval: int = 16,
                 align: str = "linear", window: int = 32, inner: KVBackend | None = None):
        if probe_interval < 1:
            raise ValueError(f"KV_DCA_PROBE_INTERVAL={probe_interval} must be >= 1")
        if align not in ALIGNS:
            raise ValueError(f"KV_DCA_ALIGN={align!r}; allowed: {', '.join(ALIGNS)}")
        if window < 0:
            raise ValueError(f"KV_DCA_WINDOW={window} must be >= 0")
        super().__init__(geometry, threshold=threshold, probe_interval=probe_interval, align=align, window=window)
        self.threshold, self.probe_interval, self.align, self.window = threshold, probe_interval, align, window
        from cache_backends.full import FullBackend

        self.inner = inner if inner is not None else FullBackend(geometry)
        if inner is not None:
            self.options.update(inner.params())
        self.quantization = q = self.inner.quantization  # the inner backend's tier: every layer's own tokens
        if q and not q.on_demand and 2 * window > q.residual + q.group_size:
            prefix = f"KV_{self.inner.name.upper()}"
            raise ValueError(f"KV_DCA_WINDOW={window}: a reuse layer keeps up to 2 x window - 1 tokens exact, so with "
                             f"{self.inner.name} the window must be at most ({prefix}_RESIDUAL + {prefix}_GROUP_SIZE)"
                             f" / 2 = {(q.residual + q.group_size) // 2}")
        self.maps: list[LayerMap] | None = None
        self.calibration: dict[str, list[float]] = {}
        self.calibration_reuse: list[tuple[int, int]] = []  # per calibration window: (tokens, reuse layers)
        self.served_similarity: dict[int, float] = {}  # layer → mean similarity on what the inner backend stores
        self.reuse_candidates: list[int] = []
        self.layer_thresholds: dict[int, dict[int, float]] = {}  # candidate layer → span → runtime threshold

    def prepare(self, model, calibration_ids: list[int] | None = None, cache=None) -> None:
        """Fit the maps and measure per-layer similarity on the calibration slice (or load both from
        ``cache``: no parameter of dca changes them), prepare the inner backend, install the attention path,
        and, from one measuring pass over the calibration windows (every start: it depends on the threshold and
        on what the inner backend stores), the reuse candidates, their runtime thresholds and the layers the
        prefill decision reuses on each window (the calibrated reuse share)."""
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
        measuring = time.perf_counter()
        per_window = self._measure_windows(model, ids)
        if cache is not None:  # /info's calibration time counts the measuring pass (it runs at every start)
            cache.add_seconds("dca", time.perf_counter() - measuring)
        self.served_similarity = {layer: round(torch.cat(w).mean().item(), 4) for layer, w in per_window.items()}
        self._per_window = per_window
        self.set_threshold(self.threshold)

    def set_threshold(self, threshold: float) -> None:
        """Choose the reuse candidates, their runtime thresholds and the calibrated reuse share at ``threshold``
        from the similarities :meth:`prepare` measured (no model pass): what a backend built with this threshold
        and prepared on the same calibration would serve. Used by the quality budget's search.

        Raises:
            RuntimeError: before :meth:`prepare`.
        """
        per_window = getattr(self, "_per_window", None)
        if per_window is None:
            raise RuntimeError("dca: set_threshold before prepare(model)")
        self.threshold = self.options["threshold"] = threshold
        self.reuse_candidates = select_reuse_layers(self.served_similarity, threshold)
        self.layer_thresholds = {layer: span_thresholds(per_window[layer]) for layer in self.reuse_candidates}
        # what the prefill decision reuses on each window: every candidate's source is kept (no two are adjacent)
        self.calibration_reuse = [
            (len(sims), sum(per_window[layer][w].mean().item() >= runtime_threshold(
                self.layer_thresholds[layer], threshold, len(sims)) for layer in self.reuse_candidates))
            for w, sims in enumerate(per_window.get(1, []))]

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
        """The reuse candidates (:func:`select_reuse_layers` on the served calibration similarities at this
        threshold); what stores really reuse is :meth:`expected_reuse_fraction`."""
        return list(self.reuse_candidates)

    @torch.no_grad()
    def _measure_windows(self, model, ids: list[int]) -> dict[int, list[torch.Tensor]]:
        """Prefill each calibration window into a measuring store of this backend, as serving does (so the
        source K/V are what the inner backend stores: ``dca+int8``, int8), and return per layer l >= 1 its
        per-token similarity in each window: ``{l: [(tokens,), ...]}``. Run at every start: it depends on the
        inner backend (the maps alone are cached)."""
        from cache_backends.calibration import CALIBRATION_WINDOW

        device = next(model.parameters()).device
        per_window: dict[int, list[torch.Tensor]] = {}
        starts = range(0, len(ids), CALIBRATION_WINDOW)
        began, logged = time.perf_counter(), 0.0
        log.info("dca: measuring the served similarity on %d calibration windows", len(starts))
        for done, start in enumerate(starts, start=1):
            store = DCAStore(self, measuring=True)
            chunk = torch.tensor([ids[start : start + CALIBRATION_WINDOW]], device=device)
            model(input_ids=chunk, cache=store, use_cache=True, logits_to_keep=1)
            for layer, sims in sorted(store.token_similarity.items()):
                per_window.setdefault(layer, []).append(sims)
            store.release()
            elapsed = time.perf_counter() - began
            if elapsed - logged >= 5.0 or done == len(starts):  # a line every 5 s at most, and the last
                logged = elapsed
                log.info("dca: measured %d/%d calibration windows in %.1f s", done, len(starts), elapsed)
        return per_window

    def expected_reuse_fraction(self) -> float:
        """Fraction of layers reused on the calibration windows (token-weighted), by the prefill decision
        itself; 0 before :meth:`prepare`."""
        tokens = sum(n for n, _ in self.calibration_reuse)
        return sum(n * r for n, r in self.calibration_reuse) / (tokens * self.geometry.num_layers) if tokens else 0.0

    def details(self) -> dict:
        return {"calibration_similarity_by_layer": {"layers": list(range(1, self.geometry.num_layers)),
                                                    **self.calibration},
                "served_similarity_by_layer": self.served_similarity,
                "reuse_candidates": self.reuse_candidates,
                "runtime_thresholds_by_layer": {str(layer): {str(n): t for n, t in spans.items()}
                                                for layer, spans in self.layer_thresholds.items()},
                "calibration_reuse_layers_by_window": [r for _, r in self.calibration_reuse],
                "expected_reuse_fraction": self.expected_reuse_fraction()}

    def new_store(self) -> KVStore:
        if self.maps is None:
            raise RuntimeError("dca backend used before prepare(model)")
        return DCAStore(self)

    def new_layer(self, index: int, position_offset: int = 0) -> KVLayer:
        raise RuntimeError("dca layers belong to a DCAStore; use new_store()")

    def sums_spec(self) -> tuple[str, dict]:
        """``dca`` (or ``dca+<inner>``) at the calibrated reuse fraction f, with the residual window and the inner
        backend's options: (1 - f) x the inner backend's sum + f x the window's tokens in the inner form."""
        inner, options = self.inner.sums_spec()
        return ("dca" if inner == "full" else f"dca+{inner}"), {"reuse_fraction": self.expected_reuse_fraction(),
                                                                "window": self.window, **options}

    # ---- the paged pool (cache_backends.dca_plan: the tables; DCAStepMeta and attend_through_map: the step) ----
    def bytes_per_token_per_layer(self, seq_len: int = 1024) -> float:
        """The sums at the calibrated reuse fraction (:meth:`sums_spec`; a live sequence's own:
        :meth:`live_bytes_per_token_per_layer`)."""
        g = self.geometry
        return bytes_per_token_per_layer(g.shape(), *self.sums_spec(), g.dtype_bytes, seq_len)

    def kv_spec(self) -> KVSpec:
        """A block holds the inner backend's streams (K/V for ``full``, ``int8``, ``int4``; the latent for ``mla``,
        whose K/V the candidates read rebuilt: :meth:`KVBackend.stored_kv`) for a group of layers: the kept layers
        in one group, each reuse candidate in a group of its own (:meth:`page_layout`)."""
        return self.inner.kv_spec()

    def _groups(self) -> tuple[list[int], list[int]]:
        if self.maps is None:
            raise RuntimeError("dca backend used before prepare(model)")
        candidates = list(self.reuse_candidates)
        return [layer for layer in range(self.geometry.num_layers) if layer not in candidates], candidates

    def block_bytes(self, block_size: int) -> int:
        """One block of the kept layers' group (a candidate's page holds one layer: more tokens of it)."""
        kept, _ = self._groups()
        return self.kv_spec().with_layers(len(kept)).block_bytes(block_size)

    def page_layout(self, dtype: torch.dtype, page_bytes: int) -> DCALayout:
        """The kept layers' group and one group per reuse candidate, as prepared (:meth:`set_threshold` afterwards
        does not change a built layout)."""
        kept, candidates = self._groups()
        spec = self.kv_spec()
        groups = [PageLayout(spec.with_layers(len(kept)), dtype, page_bytes)]
        groups += [PageLayout(spec.with_layers(1), dtype, page_bytes) for _ in candidates]
        return DCALayout(groups, kept, candidates, [self.layer_thresholds[c] for c in candidates], self.threshold,
                         self.window, self.probe_interval)

    def step_meta(self, layout: DCALayout, rows: list, device) -> DCAStepMeta:
        return DCAStepMeta(layout, rows, device)

    def paged_layer(self, views, layer: int, meta: DCAStepMeta, key_states, value_states):
        """Write layer ``layer``'s new K/V into its group's pages and gather its stored form. A candidate first
        measures what its rows' decisions need: the prompt's similarity to the prediction from its source as stored
        (prefill), the probed token's (decode, probe due; a probe that makes the layer fall back moves the row's
        ``own_from`` at once, as the commit will)."""
        group, j = meta.layout.where[layer]
        if group == 0:
            inner_meta = meta.kept
            write_layer(views[0], j, inner_meta, self.inner.encode_paged(layer, key_states, value_states, inner_meta))
            reads = read_layer(views[0], j, inner_meta)
            if layer + 1 in meta.layout.candidates:  # what the candidate after it reads, rebuilt only if it does
                meta.sources[layer] = _Source(self.inner, layer, reads, inner_meta, key_states, value_states)
            return reads
        i = group - 1
        self._measure(meta, i, layer, key_states, value_states)
        own_meta = meta.candidates[i]
        write_layer(views[group], 0, own_meta, self.inner.encode_paged(layer, key_states, value_states, own_meta))
        reads = read_layer(views[group], 0, own_meta)
        own_kv = self.inner.stored_kv(layer, reads, own_meta) if any(meta.own_from[i]) else None
        return _CandidateRead(i, reads, own_kv)

    def _measure(self, meta: DCAStepMeta, i: int, layer: int, key_states, value_states) -> None:
        layout, layer_map, source = meta.layout, self.maps[layer - 1], meta.sources[layer - 1]
        prefill = [r for r, (_, plan) in enumerate(meta.rows) if plan.prefill]
        if prefill:  # the source as stored: one copy of every position the last token sees, in order
            stored = [s.read() for s in source.kv()]  # (H, B, T, d)
            seen = meta.kept.mask[:, -1]  # (B, T)
            reuse = []
            for r in prefill:
                pk, pv = (x[:, r, seen[r]][None] for x in stored)  # (1, H, n, d)
                pk, pv = layer_map.predict(pk, pv, meta.kept.query_positions[r : r + 1], meta.position_limit)
                sim = _similarity_rows(key_states[r : r + 1], value_states[r : r + 1], pk, pv)[0]
                meta.feedback[r].prefill[i] = sim
                if layout.reuses(i, sim, meta.n):
                    reuse.append(r)
            if reuse and layout.quantization:  # a reuse layer's prompt attends its own K/V exact
                own = meta.candidates[i]
                rows = torch.zeros(meta.batch, dtype=torch.bool, device=own.mask.device)
                rows[reuse] = True
                own.mask = torch.where(rows[:, None, None], _exact_mask(own), own.mask)
        probed = [r for r, (_, plan) in enumerate(meta.rows) if plan.probe[i]]
        if probed:  # the source's new tokens as stored
            pk, pv = layer_map.predict(*source.new_as_stored(), meta.kept.query_positions, meta.position_limit)
            sims = _similarity_rows(key_states, value_states, pk, pv)
            for r in probed:
                blocks, plan = meta.rows[r]
                meta.feedback[r].probe[i] = sims[r]
                if falls_back(probes_after(blocks.states[i].probes, sims[r]), layout.thresholds[i], layout.cap):
                    meta.own_from[i][r] = plan.own_from_fallback[i]

    def attend_paged(self, layer, query, reads, meta: DCAStepMeta, scaling, module=None):
        """A kept layer: the inner backend's attention over its group. A candidate: its own pages alone where no row
        reads its source, else :func:`attend_through_map`."""
        if not isinstance(reads, _CandidateRead):
            return self.inner.attend_paged(layer, query, reads, meta.kept, scaling, module)
        i = reads.index
        own_meta = meta.candidates[i]
        if not any(meta.own_from[i]):
            return self.inner.attend_paged(layer, query, reads.own, own_meta, scaling, module)
        src_reads = meta.sources[layer - 1].kv()
        own_from = torch.tensor(meta.own_from[i], device=query.device)
        return attend_through_map(self.maps[layer - 1], query, src_reads, meta.kept, reads.own_kv, own_meta, own_from,
                                  scaling, meta.position_limit)

    def step_feedback(self, meta: DCAStepMeta) -> list[Feedback]:
        return meta.feedback

    def live_bytes_per_token_per_layer(self, store: "DCAStore") -> float:
        """The sums over this sequence's own layers: its reuse decisions and fall-backs, not the calibrated
        fraction."""
        return dca_store_bytes_per_token_per_layer(store.own_tokens(), store.num_tokens(),
                                                   self.inner.bytes_per_token_per_layer)

    def reserved_bytes(self, max_tokens: int) -> int:
        """Every layer kept (the upper bound: a sequence may reuse no layer, or fall back everywhere)."""
        return self.inner.reserved_bytes(max_tokens)


# ---- the paged pool: kept layers in one group of pages, each reuse candidate in its own (dca_plan) ---------------
class DCAStepMeta:
    """One step's metadata for a backend's dca rows: a :class:`cache_backends.step_meta.StepMeta` of the kept layers'
    group and one of each candidate's, and what the forward measures (read back by :meth:`DCABackend.step_feedback`).

    Args:
        layout: the backend's :class:`cache_backends.dca_plan.DCALayout`.
        rows: each sequence's :class:`~cache_backends.dca_plan.DCABlocks` (this step's pages added) and
            :class:`~cache_backends.dca_plan.DCAPlan`, in batch order.
        device: where the index tensors go.

    Attributes:
        kept, candidates: the groups' step metadata (``candidates[i]`` over candidate ``i``'s own tokens, from each
            row's ``first``).
        own_from: per candidate, per row, the first position read from its own pages (plain ints; a probe that makes
            the layer fall back moves its row's to the plan's ``own_from_fallback`` within the step).
        sources: layer → a source layer's :class:`_Source` in this step, kept for the candidate after it.
        feedback: per row, the similarities measured (:class:`cache_backends.dca_plan.Feedback`).
    """

    def __init__(self, layout: DCALayout, rows: list[tuple], device):
        self.layout, self.rows = layout, rows
        self.kept = StepMeta(layout.groups[0], [(b.groups[0], p.groups[0]) for b, p in rows], device)
        self.candidates = [StepMeta(layout.groups[1 + i], [(b.groups[1 + i], p.groups[1 + i]) for b, p in rows],
                                    device, exact_rows=[p.exact_rows[1 + i] for _, p in rows])
                           for i in range(len(layout.candidates))]
        self.query_positions, self.n, self.batch = self.kept.query_positions, self.kept.n, self.kept.batch
        self.own_from = [[p.own_from[i] for _, p in rows] for i in range(len(layout.candidates))]
        widths = [m.positions.shape[1] for m in (self.kept, *self.candidates)]
        self.position_limit = max(b.length for b, _ in rows) + self.n + max(widths)  # every gathered position below
        self.sources: dict[int, tuple] = {}
        self.feedback = [Feedback() for _ in rows]


class _Source:
    """A source layer's step, as the reuse candidate after it reads it: the K/V its gathered pages stand for and its
    new tokens' K/V as stored (:meth:`KVBackend.stored_kv`, :meth:`KVBackend.as_stored`), each computed once, when
    first asked for (``mla`` rebuilds them from its latent: not for a step no row reads or probes)."""

    def __init__(self, inner: KVBackend, layer: int, reads: list, meta: StepMeta, key_states, value_states):
        self.inner, self.layer, self.reads, self.meta, self.new = inner, layer, reads, meta, (key_states, value_states)
        self._kv = None

    def kv(self) -> tuple:
        if self._kv is None:
            self._kv = self.inner.stored_kv(self.layer, self.reads, self.meta)
        return self._kv

    def new_as_stored(self) -> tuple:
        return self.inner.as_stored(self.layer, *self.new, self.meta)


class _CandidateRead:
    """What a candidate layer hands its attention: which candidate it is, its own tokens' stored form, and (when a
    row reads its source) the K/V they stand for (:meth:`KVBackend.stored_kv`)."""

    def __init__(self, index: int, own: list[StreamRead], own_kv: tuple | None):
        self.index, self.own, self.own_kv = index, own, own_kv


def _exact_mask(meta: StepMeta) -> torch.Tensor:
    """A prefill step's mask (B, n, Tq + Te) reading every row's tokens from its exact slots (written first, still
    there for the tokens the step quantizes) and none as codes: causal over the tokens the rows hold."""
    tq = meta.q_width
    exact = meta.positions[:, tq:]  # (B, Te): the exact slots' positions (before the step's drain moved them)
    end = meta.query_positions[:, -1:] + 1  # (B, 1)
    seen = (exact[:, None, :] <= meta.query_positions[:, :, None]) & (exact < end)[:, None, :]
    return torch.cat([torch.zeros_like(meta.mask[..., :tq]), seen], dim=-1)


def _similarity_rows(own_k, own_v, pred_k, pred_v) -> list[float]:
    """Per row, (cos(K) + cos(V)) / 2 averaged over heads and tokens: (B, H, n, d) inputs → B floats."""
    cos = torch.nn.functional.cosine_similarity
    both = cos(own_k.float(), pred_k.float(), dim=-1) + cos(own_v.float(), pred_v.float(), dim=-1)  # (B, H, n)
    return (0.5 * both.mean(dim=(1, 2))).tolist()


def attend_through_map(layer_map: LayerMap, query: torch.Tensor, src: list[StreamRead], src_meta: StepMeta,
                       own: list[StreamRead], own_meta: StepMeta, own_from: torch.Tensor, scaling: float,
                       limit: int) -> torch.Tensor:
    """A candidate layer's attention for a batch: the positions before each row's ``own_from`` through its source's
    stored K/V read with the map folded in (:meth:`LayerMap.attend`, batched), the later ones from its own pages,
    in one softmax.

    Args:
        query: (B, Hq, n, d) after RoPE.
        src, src_meta: the source layer's gathered keys and values (H heads) and the kept group's step metadata.
        own, own_meta: this layer's own gathered keys and values and its group's step metadata.
        own_from: (B,) the first position each row reads from its own pages.
        limit: above every gathered position (:attr:`DCAStepMeta.position_limit`).

    Returns:
        (B, Hq, n, d).
    """
    b, hq, n, d = query.shape
    h = src[0].exact.shape[0]
    rep = hq // h
    gq = grouped_rows(query, h).transpose(0, 1)  # (H, B, rep * n, d)
    if layer_map.key_mix is None:  # the source's K/V as they are
        from_source = src[0].dot(gq).transpose(0, 1).reshape(b, hq, n, -1)
    else:
        key_fold, value_map, value_bias = layer_map._per_query_head(hq)
        folded = (query.float() @ key_fold).view(b, hq, n, h, d).permute(3, 0, 1, 2, 4).reshape(h, b, hq * n, d)
        from_source = src[0].dot(folded.to(query.dtype)).sum(0).view(b, hq, n, -1)  # (B, Hq, n, Ts)
        bias = layer_map.bias_at(src_meta.positions, limit, query.dtype)  # (H, B, Ts, d)
        from_source = from_source + (gq @ bias.transpose(-1, -2)).transpose(0, 1).reshape(b, hq, n, -1)
    from_own = own[0].dot(gq).transpose(0, 1).reshape(b, hq, n, -1)  # (B, Hq, n, To)
    src_mask = src_meta.mask & (src_meta.positions < own_from[:, None])[:, None, :]  # (B, n, Ts)
    own_mask = own_meta.mask & (own_meta.positions >= own_from[:, None])[:, None, :]  # (B, n, To)
    mask = torch.cat([src_mask, own_mask], dim=-1)[:, None]  # (B, 1, n, Ts + To)
    scores = torch.cat([from_source, from_own], dim=-1) * scaling
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # (B, Hq, n, Ts + To)
    ts = from_source.shape[-1]
    p_src, p_own = probs[..., :ts], probs[..., ts:]
    own_out = own[1].weighted_sum(grouped_rows(p_own, h).transpose(0, 1))  # (H, B, rep * n, d)
    own_out = ungroup_rows(own_out.transpose(0, 1), hq)  # (B, Hq, n, d)
    if layer_map.key_mix is None:
        src_out = ungroup_rows(src[1].weighted_sum(grouped_rows(p_src, h).transpose(0, 1)).transpose(0, 1), hq)
        return (src_out + own_out).to(query.dtype)
    weights = p_src.reshape(1, b, hq * n, ts).expand(h, b, hq * n, ts)
    mixed = src[1].weighted_sum(weights).view(h, b, hq, n, d).permute(1, 2, 3, 0, 4).reshape(b, hq, n, h * d)
    # the value map in fp32 (see LayerMap.attend)
    out = mixed.float() @ value_map + value_bias[None, :, None, :] * p_src.sum(-1, keepdim=True).float()
    return (out + own_out.float()).to(query.dtype)
