"""The ``dca`` backend (:mod:`cache_backends.dca` describes the method): calibration (the maps, each layer's
similarity and runtime thresholds, the reuse candidates), the estimator's figures, and the paged path's hooks."""

from __future__ import annotations

import copy
import logging
import time

import torch

from cache_backends.base import KVBackend
from cache_backends.geometry import ModelGeometry
from cache_backends.kv_store import KVLayer, KVStore
from cache_backends.dca.maps import LayerMap, fit_full_linear_map
from cache_backends import kernels
from cache_backends.dca.paged import (DCAStepMeta, _CandidateRead, _exact_mask, _exact_ranges, _similarity_rows,
                                      _Source, attend_in_place_through_map, attend_through_map, gathered)
from cache_backends.dca.plan import DCALayout, Feedback, falls_back, probes_after, runtime_threshold
from cache_backends.dca.similarity import select_reuse_layers, similarity, span_thresholds
from cache_backends.dca.store import DCAStore
from cache_backends.estimate import bytes_per_token_per_layer, dca_store_bytes_per_token_per_layer
from cache_backends.kv_spec import KVSpec
from cache_backends.page_layout import PageLayout
from cache_backends.paged import InPlaceRead, in_place_layer, read_layer
from cache_backends.rope import RopeTable

log = logging.getLogger("kvserve.dca")

ALIGNS = ("linear", "none")
FIT_VERSION = 3  # of the calibration cache entry (bump when the fit changes); 2: ridge maps; 3: similarity
# figures over every calibration token (2 carried token 0's)


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

    @classmethod
    def compose(cls, geometry: ModelGeometry, inner: KVBackend, **options):
        """``dca+int8``, ``dca+int4``, ``dca+mla``: kept layers store what ``inner`` stores, reuse layers predict from it."""
        return cls(geometry, inner=inner, **options)

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
        from cache_backends.full.backend import FullBackend

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
        from cache_backends.dca import attention as dca_attention
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

    # ---- the paged pool (cache_backends.dca.plan: the tables; DCAStepMeta and attend_through_map: the step) ----
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

    def layout_variants(self) -> list[DCABackend]:
        """Prepared, ``[self]``; before :meth:`prepare`, one stand-in per number of reuse candidates calibration may
        choose, from none to every other layer from layer 1 (no two adjacent): the page and this layout depend on
        that number alone (layers 1, 3, 5... stand for the candidates). Only their layouts may be used."""
        if self.maps is not None:
            return [self]
        twins = []
        for count in range(self.geometry.num_layers // 2 + 1):
            twin = copy.copy(self)
            twin.maps, twin.reuse_candidates = [], list(range(1, 2 * count, 2))
            twin.layer_thresholds = {layer: {} for layer in twin.reuse_candidates}
            twins.append(twin)
        return twins

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
            self.inner.write_paged(views[0], j, layer, inner_meta, key_states, value_states)
            reads = self._reads(views[0], j, inner_meta)
            if layer + 1 in meta.layout.candidates:  # what the candidate after it reads, rebuilt only if it does
                meta.sources[layer] = _Source(self.inner, layer, reads, inner_meta, key_states, value_states)
            return reads
        i = group - 1
        self._measure(meta, i, layer, key_states, value_states)
        own_meta = meta.candidates[i]
        self.inner.write_paged(views[group], 0, layer, own_meta, key_states, value_states)
        return _CandidateRead(i, self._reads(views[group], 0, own_meta), self.inner, layer, own_meta)

    def _reads(self, views, index: int, meta):
        """A group's layer ``index`` for the attention kernel to read in place where it reads the inner backend's
        stored form (:func:`cache_backends.kernels.fits`), else gathered; a source or a candidate's own tokens are
        gathered later only where the torch path or a similarity needs them."""
        if self.inner.attends_in_place:
            reads = in_place_layer(views, index)
            if reads is not None:
                return reads
        return read_layer(views, index, meta)

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
                exact = _exact_mask(own)
                own.mask = torch.where(rows[:, None, None], exact, own.mask)
                ranges = _exact_ranges(own, exact)  # what the kernel reads: the same tokens as intervals
                if ranges is None:
                    own.mask_replaced = True  # no interval says what it sees: the torch path attends it
                else:
                    own.ranges = torch.where(rows[:, None, None], ranges, own.ranges)
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
        reads its source, else through its map: read in place by the kernel (:func:`attend_in_place_through_map`)
        where both groups' pages are, else gathered (:func:`attend_through_map`)."""
        if not isinstance(reads, _CandidateRead):
            return self.inner.attend_paged(layer, query, reads, meta.kept, scaling, module)
        i = reads.index
        own_meta = meta.candidates[i]
        if not any(meta.own_from[i]):
            if getattr(own_meta, "mask_replaced", False):
                return self.inner.attend_paged(layer, query, gathered(reads.own, own_meta), own_meta, scaling, module)
            return self.inner.attend_paged(layer, query, reads.own, own_meta, scaling, module)
        source = meta.sources[layer - 1]
        both = (reads.own[0], source.reads[0])
        if (all(isinstance(r, InPlaceRead) and kernels.reads_dca(r.views.layout) for r in both)
                and not getattr(own_meta, "mask_replaced", False)):
            latents = ()
            if kernels.is_posthoc_latent(reads.own[0].views.layout):  # dca+mla: each layer's bases, RoPE's tables
                latents = (self.inner._kernel_bases(layer - 1), self.inner._kernel_bases(layer),
                           *self.inner.rope.float_tables(meta.position_limit))
            return attend_in_place_through_map(self.maps[layer - 1], query, source.reads, meta.kept, reads.own,
                                               own_meta, meta.own_from[i], scaling, meta.position_limit, latents)
        own_from = torch.tensor(meta.own_from[i], device=query.device)
        return attend_through_map(self.maps[layer - 1], query, source.kv(), meta.kept, reads.own_kv(), own_meta,
                                  own_from, scaling, meta.position_limit)

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
