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
  (:mod:`cache_backends.dca.attention`) between probes. Every ``KV_DCA_PROBE_INTERVAL`` decode steps it
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

The package, one idea a module (this ``__init__`` imports none of them): :mod:`.maps` (the layer maps),
:mod:`.similarity` (similarity, runtime thresholds, reuse candidates), :mod:`.store` (the per-sequence reference
store), :mod:`.plan` (the paged pool's groups and per-sequence decisions; torch-free), :mod:`.paged` (a paged
step), :mod:`.attention` (the attention module that skips K/V projections), :mod:`.backend` (``DCABackend``).
"""
