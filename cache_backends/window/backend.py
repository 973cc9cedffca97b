"""``window``: attention sinks plus a window of recent tokens on every layer (StreamingLLM, Xiao et al., arXiv
2309.17453).

A query at position ``t`` attends to the positions ``[0, S) ∪ [t - W + 1, t]`` (causal): the first ``S`` tokens
(``sinks``, default 4: the paper's four initial tokens, which absorb the attention mass a softmax must put
somewhere) and the newest ``W`` (``window``, itself included). The tokens keep their original RoPE positions (as
kvpress's ``StreamingLLMPress`` does, not the paper's positions re-assigned inside the cache): keys are cached after
RoPE, and the server never serves beyond the model's ``max_position_embeddings``, so no position is ever out of the
model's range.

Default ``window`` = 1024: the paper's smallest cache (1024 = 4 sinks + 1020 recent tokens in its Llama-2 runs);
short requests (under about 1K tokens) are then served exactly as ``full`` serves them, and a context of ``T`` longer
tokens holds ``(S + W - 1) / T`` of ``full``'s bytes (1/8 at 8K). What it drops is gone: a fact older than the
window is not retrievable (``docs/backends.md``, the ``window`` section's needle figures).

Layers: each layer's rule is :func:`cache_backends.sizes.window_rules`: a model's own sliding layer whose window
``w`` is at most ``W`` keeps ``w`` and no sinks (Gemma 3's 512-token layers: transformers narrows them as before);
every other layer (global, or a sliding window wider than ``W``) attends to ``S`` sinks and ``W`` recent tokens.

Memory: the paged pool keeps only what those rules leave visible (:mod:`cache_backends.hybrid`: every layer is in
a window group; pages of tokens the window left are freed at the step's commit, but the page(s) holding the sinks),
and reports what it holds (``/info``, metrics, ``kvserve estimate``: ``min(T, S + W - 1)`` tokens a layer).
``window+int8`` / ``window+int4`` keep the quantized tiers under the window (pages of codes the window left are
freed; the sinks' codes are kept). No full-precision copy of a dropped token is kept in the pool. The per-sequence
reference stores (:meth:`WindowBackend.new_store`, calibration and the quality budget) keep every token of the inner
backend and mask them.

A windowed layout is not prefix-cached (:attr:`cache_backends.hybrid.HybridLayout.cacheable`: a hit would need each
group's sink pages beside the last window of blocks that vLLM's hybrid rule asks for, which ``full`` follows on a
model's own sliding layers).
"""

from __future__ import annotations

import logging

import torch

from cache_backends.attention import attend_kv
from cache_backends.base import KVBackend
from cache_backends.geometry import ModelGeometry
from cache_backends.kv_store import KVLayer
from cache_backends.sizes import window_rules
from cache_backends.full.backend import FullBackend
from cache_backends.hybrid import HybridLayout
from cache_backends.outer import InnerLayer, OuterBackend
from cache_backends.page_layout import PageLayout
from cache_backends.window.spec import DEFAULT_SINKS, DEFAULT_WINDOW, check_sinks, window_bytes

log = logging.getLogger("kvserve.window")


class WindowLayer(InnerLayer):
    """One layer of a per-sequence store: the inner backend's layer (every token, in its stored form), attended
    under the sinks-and-window mask (:func:`cache_backends.attention.causal_mask`).

    Args:
        inner: the inner backend's layer (``FullLayer``, ``Int8Layer``).
        window: recent tokens a query sees, itself included (>= 1).
        sinks: first tokens every query sees.
    """

    own_window = True

    def __init__(self, inner: KVLayer, window: int, sinks: int):
        super().__init__(inner)
        self.window, self.sinks = window, sinks

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """(1, Hq, q_len, d) → (1, Hq, q_len, dv): the inner layer's K/V rebuilt (a transient copy) and attended to
        under the mask; the inner layer's own attention when the window still covers every token."""
        if self.window >= self.inner.get_seq_length():
            return self.inner.attend(query, scaling)
        keys, values = self.inner.materialize()
        return attend_kv(query, keys, values, scaling, self.window, self.sinks)


class SinksOverPage(ValueError):
    """The sinks do not fit one page of their tier. Its message names the server's settings; ``kvserve estimate``
    and ``advise`` word it with their own options from ``backend``, ``sinks`` and ``per`` (tokens a page)."""

    def __init__(self, backend: str, sinks: int, per: int):
        super().__init__(f"{backend}: sinks={sinks} (KV_WINDOW_SINKS) must fit one page of its sink tier ({per} "
                         "tokens a page): lower KV_WINDOW_SINKS or raise KV_BLOCK_SIZE")
        self.backend, self.sinks, self.per = backend, sinks, per


def _int_option(backend: str, name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{backend}: {name} must be an integer >= {low}, got {value!r}")
    return value


class WindowBackend(OuterBackend):
    """Attention sinks and a recent window on every layer (StreamingLLM, arXiv 2309.17453; the module).

    Args:
        geometry: the model's attention shape.
        sinks: first tokens every query sees (``KV_WINDOW_SINKS``, default 4), >= 0.
        window: recent tokens every query sees, itself included (``KV_WINDOW_SIZE``, default 1024), >= 1.
        inner: what the kept tokens are stored as: ``full`` (default) or an ``int8``/``int4`` backend
            (``window+int8``, ``window+int4``).

    Raises:
        ValueError: ``sinks`` < 0, ``window`` < 1 (or not integers), ``sinks`` > ``window``; a quantized ``inner`` whose residual window
            and forming group (``residual + group_size`` tokens, read exact) do not fit in ``window``.
    """

    name = "window"
    windowed_pool = True
    attends_in_place = True
    spelled: dict[str, str] = {}
    """How a subclass under its own name spells ``window``'s options (``lastn``: ``{"window": "n"}``), so that a
    refusal names the backend and the option the user wrote."""

    def __init__(self, geometry: ModelGeometry, sinks: int = DEFAULT_SINKS, window: int = DEFAULT_WINDOW,
                 inner: KVBackend | None = None):
        says = {o: self.spelled.get(o, o) for o in ("sinks", "window")}
        sinks = _int_option(self.name, says["sinks"], sinks, 0)
        window = _int_option(self.name, says["window"], window, 1)
        check_sinks(sinks, window)
        inner = inner if inner is not None else FullBackend(geometry)
        q = inner.quantization
        if q is not None and window < q.residual + q.group_size:
            raise ValueError(f"{self.name}+{inner.name}: {says['window']}={window} must be >= residual + group_size = "
                             f"{q.residual + q.group_size} (the tokens the quantized tier reads exact must lie "
                             "inside the window)")
        super().__init__(geometry, sinks=sinks, window=window, **inner.options)
        self.inner, self.sinks, self.window = inner, sinks, window
        self.quantization = q
        self.rules = window_rules(geometry.layer_windows, geometry.num_layers, window, sinks)

    # ---- the per-sequence reference stores ---------------------------------------------------------------
    def new_layer(self, index: int, position_offset: int = 0) -> KVLayer:
        """The inner backend's layer; under the sinks-and-window mask (:class:`WindowLayer`) unless the model's own
        sliding window (no wider than ``window``) narrows it."""
        layer = self.inner.new_layer(index, position_offset)
        window, sinks = self.rules[index]
        return layer if sinks is None else WindowLayer(layer, window, sinks)

    # ---- what it costs ----------------------------------------------------------------------------------
    def sums_options(self) -> dict:
        return {"sinks": self.sinks, "window": self.window}

    def groups(self) -> list[tuple[int, int | None, list[int]]]:
        """``(window, sinks or None, layers)`` per window group (:func:`cache_backends.estimate.window_groups_of`)."""
        found: dict[tuple[int, int | None], list[int]] = {}
        for layer, rule in enumerate(self.rules):
            found.setdefault(rule, []).append(layer)
        return [(w, s, layers) for (w, s), layers in sorted(found.items(), key=lambda kv: (kv[0][0], kv[0][1] is None))]

    def window_groups(self) -> list[tuple[int | None, list[int]]]:
        return [(w, layers) for w, _, layers in self.groups()]

    def bytes_per_token_per_layer(self, seq_len: int = 1024) -> float:
        """What the pool holds a token a layer at ``seq_len`` tokens: ``min(seq_len, S + W - 1)`` tokens of the inner
        form on a windowed layer with sinks, ``min(seq_len, w - 1)`` on a model's own sliding layer
        (:func:`cache_backends.window.spec.window_bytes`), averaged over ``seq_len``."""
        return window_bytes(self.geometry.shape(), self.window, self.sinks, self.kv_spec(), seq_len)

    def page_layout(self, dtype: torch.dtype, page_bytes: int) -> HybridLayout:
        """One :class:`cache_backends.hybrid.HybridLayout` group per (window, sinks) rule.

        Raises:
            SinksOverPage: when the sinks do not fit one page of the sink tier (the quantized tier's on a
                quantized inner backend, else the exact tier's), naming ``KV_WINDOW_SINKS`` and ``KV_BLOCK_SIZE``
                (the pool's page holds whole blocks: :func:`server.engine.kv_cache.page_layouts`).
        """
        spec = self.kv_spec()
        groups = self.groups()
        layouts = [PageLayout(spec.with_layers(len(layers)), dtype, page_bytes) for _, _, layers in groups]
        for layout, (_, sinks, _) in zip(layouts, groups):
            per = layout.q_tokens if layout.quantization else layout.exact_tokens
            if sinks and sinks > per:
                raise SinksOverPage(self.name, sinks, per)
        return HybridLayout(layouts, [w for w, _, _ in groups], [layers for _, _, layers in groups],
                            [s for _, s, _ in groups])

    def drops_tokens(self, seq_len: int) -> bool:
        """Whether a sequence of ``seq_len`` tokens loses a token a ``full`` cache would attend to: on some layer
        with sinks (the model's own sliding layers lose nothing ``full`` keeps), ``seq_len > window + sinks``."""
        return any(sinks is not None and seq_len > window + sinks for window, sinks in self.rules)

    def window_warning(self, priced_tokens: int) -> str | None:
        """What to say when the quality budget prices on windows of ``priced_tokens`` tokens that this backend's
        rule never drops a token of (``window >= priced_tokens``): it would call it free, yet a fact older than the
        window is lost; ``None`` when the price sees drops."""
        if self.window < priced_tokens:
            return None
        return (f"{self.name} drops every token older than its window of {self.window} (but {self.sinks} sinks), "
                f"yet the quality budget prices it on windows of {priced_tokens} tokens, which it never drops: its "
                "price there is 0 and says nothing about contexts longer than the window, where it loses retrieval "
                "of what it dropped (docs/backends.md, 'window')")

    def details(self) -> dict:
        return {"rules": [{"window": w, "sinks": s, "layers": len(layers)} for w, s, layers in self.groups()]}

    # ---- the paged pool --------------------------------------------------------------------------------
    def attend_paged(self, layer, query, reads, meta, scaling, module=None):
        """The inner backend's attention under the group's metadata (its mask and ranges already narrowed to the
        sinks and the window: :meth:`cache_backends.step_meta.StepMeta._add_sinks`)."""
        return self.inner.attend_paged(layer, query, reads, meta, scaling, module)
