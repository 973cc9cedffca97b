"""The KV backend contract (:class:`KVBackend`): a backend makes per-sequence KV stores
(:mod:`cache_backends.kv_store`) and paged blocks, and says what they cost.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from cache_backends.geometry import ModelGeometry
from cache_backends.sizes import window_groups, windowed_bytes_per_token_per_layer
from cache_backends.hybrid import HybridLayout, HybridStepMeta
from cache_backends.kv_spec import KVSpec, Quantization, StreamSpec
from cache_backends.kv_store import KVLayer, KVStore
from cache_backends.page_layout import PageLayout
from cache_backends.paged import in_place_layer, read_layer, write_layer
from cache_backends.step_meta import StepMeta


class KVBackend(ABC):
    """A KV-cache strategy, selected by name with ``KV_BACKEND``.

    Subclasses set :attr:`name`, implement :meth:`new_layer` and :meth:`sums_spec` (what they cost), and
    may override :meth:`prepare` (calibration) and :meth:`params` (shown in ``/info``).

    Args:
        geometry: the served model's attention shape.
        options: backend parameters (already validated by the settings layer).
    """

    name: ClassVar[str]
    quantization: Quantization | None = None
    """The quantized tier (int8-family backends and compositions), else ``None``."""

    chunked_prefill: ClassVar[bool] = True
    """Whether its per-sequence stores take a prompt in several forward passes (``dca`` decides once per prompt)."""

    windowed_pool: bool = False
    """Whether, on a model with sliding-window layers, its pages keep only each sliding layer's window
    (:mod:`cache_backends.hybrid`: ``full``, and ``int8``/``int4`` in whole pages of codes). Else every layer keeps
    every token (``elastic``, whose tier fills on demand; ``KV_SLIDING_WINDOW_POOL=false``)."""

    @classmethod
    def compose(cls, geometry: ModelGeometry, inner: "KVBackend", **options: Any) -> "KVBackend":
        """This backend as the outer part of ``outer+inner``, over the built ``inner`` (the inner names it takes
        are its declaration's :attr:`~cache_backends.declaration.BackendDecl.inners`).

        Raises:
            ValueError: it composes over no backend, or an option value it refuses.
        """
        raise ValueError(f"{cls.name} composes over no other backend")

    def __init__(self, geometry: ModelGeometry, **options: Any):
        self.geometry = geometry
        self.options = options

    def prepare(self, model, calibration_ids: list[int] | None = None, cache=None) -> None:
        """Fit whatever the backend needs on the loaded model (no-op by default).

        Args:
            model: the loaded model.
            calibration_ids: calibration token ids (default: :func:`cache_backends.calibration.calibration_ids`).
            cache: a :class:`cache_backends.calibration_cache.CalibrationCache` to load fits from and save
                them to; ``None`` fits without one.
        """

    def drops_tokens(self, seq_len: int) -> bool:
        """Whether a sequence of ``seq_len`` tokens loses a token a ``full`` cache would attend to (``window``: past
        its sinks and window), which the quality budget's short windows cannot price
        (:mod:`server.quality_budget`'s long price). ``False`` here: a backend that keeps every token in some form."""
        return False

    def params(self) -> dict[str, Any]:
        """The backend's parameters (its constructor options), for ``/info`` and reports."""
        return dict(self.options)

    def details(self) -> dict[str, Any]:
        """Extra facts for ``/info`` (e.g. calibration results); empty by default."""
        return {}

    def new_store(self) -> KVStore:
        """An empty KV store for one sequence (one :meth:`new_layer` per model layer).

        On a native-MLA model the store returns rebuilt tensors (``in_place=False``): DeepSeek's
        attention expands the cached latent itself after the cache read.
        """
        return KVStore([self.new_layer(i) for i in range(self.geometry.num_layers)],
                       in_place=not self.geometry.kv_lora_rank)

    def reserved_bytes(self, max_tokens: int) -> int:
        """The most bytes a store reserved for ``max_tokens`` tokens can allocate (the scheduler's
        admission charge): every buffer at its capped capacity. Defaults to the closed formula."""
        return int(self.bytes_per_token_per_layer(max_tokens) * max_tokens * self.geometry.num_layers)

    @abstractmethod
    def new_layer(self, index: int, position_offset: int = 0) -> KVLayer:
        """An empty cache layer for model layer ``index``; its first token sits at ``position_offset``."""

    @abstractmethod
    def sums_spec(self) -> tuple[str, dict[str, Any]]:
        """This backend as the closed-form sums take it: a ``kvserve estimate`` spec name and the options
        that size it, e.g. ``("gqa+int8", {"groups": 2, "group_size": 32, "residual": 32})``."""

    def bytes_per_token_per_layer(self, seq_len: int = 1024) -> float:
        """Bytes one token costs in one layer at the model's dtype, averaged over a sequence of ``seq_len``
        tokens (int8-family backends depend on it through their full-precision window): what :meth:`kv_spec`
        holds (:meth:`cache_backends.kv_spec.KVSpec.bytes_per_token_per_layer`), the same function
        ``kvserve estimate`` prints for :meth:`sums_spec`. ``/info`` reports it. With windows kept per group
        (:meth:`window_groups`), each sliding group's layers count the ``window - 1`` tokens the next query sees
        besides itself (:func:`cache_backends.estimate.window_tokens_held`)."""
        groups = self.window_groups()
        if groups is None:
            return self.kv_spec().bytes_per_token_per_layer(seq_len)
        return windowed_bytes_per_token_per_layer(self.kv_spec(), [(w, len(layers)) for w, layers in groups], seq_len)

    def window_groups(self) -> list[tuple[int | None, list[int]]] | None:
        """The model's layers by window (:func:`cache_backends.estimate.window_groups`) when this backend's pages keep
        only each sliding layer's window (:attr:`windowed_pool` on a model with sliding-window layers), else
        ``None``."""
        if not (self.windowed_pool and self.geometry.sliding_layers):
            return None
        return window_groups(self.geometry.layer_windows, self.geometry.num_layers)

    def min_bytes_per_token_per_layer(self, seq_len: int = 1024) -> float:
        """The least :meth:`bytes_per_token_per_layer` can be: the same but for a backend whose size depends on
        the pool's state (``elastic``: every compressible group quantized)."""
        return self.bytes_per_token_per_layer(seq_len)

    # ---- the paged pool (cache_backends.paged): what a block holds and how the batch attends to it --------
    def kv_spec(self) -> KVSpec:
        """What one layer of this backend stores per token, in how many layers, and its quantized tier
        (:class:`cache_backends.kv_spec.KVSpec`): every byte count (pages, admission, ``/info``, metrics) is
        computed from it."""
        raise NotImplementedError(f"{self.name} has no KV spec")

    def _kv_spec(self, streams: list[StreamSpec], quantization: Quantization | None = None) -> KVSpec:
        """``streams`` in every layer of the model at its dtype."""
        return KVSpec(tuple(streams), self.geometry.num_layers, self.geometry.dtype_bytes, quantization)

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block of ``block_size`` tokens of every layer in this backend's stored form
        (:meth:`cache_backends.kv_spec.KVSpec.block_bytes`): the page size a pool serving only it uses (with windows
        kept per group, the largest group's block: a smaller group's page holds more of its tokens)."""
        groups = self.window_groups()
        if groups is None:
            return self.kv_spec().block_bytes(block_size)
        return max(self.kv_spec().with_layers(len(layers)).block_bytes(block_size) for _, layers in groups)

    def page_layout(self, dtype: torch.dtype, page_bytes: int):
        """How this backend's blocks fill a page of ``page_bytes`` (:class:`cache_backends.page_layout.PageLayout`; the
        planning the KV cache manager reads: ``plan``, ``extend``, ``commit``, ``written``, ``pages_for``...); with
        windows kept per group, a :class:`cache_backends.hybrid.HybridLayout` of one layout per group."""
        groups = self.window_groups()
        if groups is None:
            return PageLayout(self.kv_spec(), dtype, page_bytes)
        spec = self.kv_spec()
        layouts = [PageLayout(spec.with_layers(len(layers)), dtype, page_bytes) for _, layers in groups]
        if spec.quantization:  # code pages that line up every max(q_tokens) tokens: the prefix cache's block
            least = min(layout.q_tokens for layout in layouts)
            layouts = [PageLayout(spec.with_layers(len(layers)), dtype, page_bytes, q_multiple=least)
                       for _, layers in groups]
        return HybridLayout(layouts, [w for w, _ in groups], [layers for _, layers in groups])

    def layout_variants(self) -> list[KVBackend]:
        """The backends whose pool layouts (:meth:`block_bytes`, :meth:`page_layout`) this one may have once
        prepared: ``[self]`` where the model's config alone sets them; a backend that knows its layout only once
        calibrated (``dca``) gives one stand-in per layout calibration may choose. For the pool's checks before the
        weights load (:func:`server.backend_check.check_pool`)."""
        return [self]

    def step_meta(self, layout, rows: list, device):
        """One step's metadata for this backend's rows ``[(blocks, plan), ...]`` (:class:`cache_backends.paged.
        StepMeta`, or a :class:`cache_backends.hybrid.HybridStepMeta` on a hybrid layout), built once before the
        forward."""
        if isinstance(layout, HybridLayout):
            return HybridStepMeta(layout, rows, device)
        return StepMeta(layout, rows, device)

    #: Whether :meth:`attend_paged` attends a K/V pair of streams through :func:`cache_backends.paged_attention.
    #: attend_pair`, so that the attention kernel may read them in place (:mod:`cache_backends.kernels`).
    attends_in_place = False

    def paged_layer(self, views, layer: int, meta, key_states: torch.Tensor, value_states: torch.Tensor) -> list:
        """Write layer ``layer``'s new K/V of the step's rows into their pages (:meth:`encode_paged`, then the
        groups the step drains quantized) and return the reads :meth:`attend_paged` takes: the streams to be read in
        place by the attention kernel (:attr:`attends_in_place`, where the kernel is active and reads this layout),
        else every row's stored form gathered.

        Args:
            key_states, value_states: (B, num_key_value_heads, n, head_dim), after RoPE.
        """
        index = layer
        if isinstance(meta, HybridStepMeta):  # the layer's group: its views, its index there, its metadata
            group, index = meta.layout.where[layer]
            views, meta = views[group], meta.groups[group]
        self.write_paged(views, index, layer, meta, key_states, value_states)
        if self.attends_in_place:
            reads = in_place_layer(views, index)
            if reads is not None:
                return reads
        return read_layer(views, index, meta)

    def write_paged(self, views, index: int, layer: int, meta, key_states: torch.Tensor,
                    value_states: torch.Tensor) -> None:
        """Write layer ``layer``'s new K/V, (B, num_key_value_heads, n, head_dim) after RoPE, into layer ``index`` of
        ``views`` as this backend stores them: :meth:`encode_paged`, then :func:`cache_backends.paged.write_layer`
        (the groups the step drains quantized). A backend whose encoding the attention kernel fuses into the write
        overrides it."""
        write_layer(views, index, meta, self.encode_paged(layer, key_states, value_states, meta))

    def stored_kv(self, layer: int, reads: list, meta) -> tuple:
        """The keys and values layer ``layer``'s gathered ``reads`` stand for, as two
        :class:`cache_backends.paged.StreamRead` of num_key_value_heads heads (``dot``, ``weighted_sum``,
        ``read``): the reads themselves for a backend that stores K/V (``full``, ``int8``); ``mla`` rebuilds them
        from its latent (a transient copy). ``dca`` reads its sources through it."""
        return reads[0], reads[1]

    def as_stored(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor, meta) -> tuple:
        """What a step's new K/V (B, H, n, d) read back as once stored, before any quantization (a new token is
        in the exact tier): themselves, but for ``mla``'s latent round trip."""
        return key_states, value_states

    def step_feedback(self, meta) -> list | None:
        """What this step's forward measured per row of ``meta`` for the scheduler's commit (plain data; ``dca``:
        its similarities), or ``None``."""
        return None

    def encode_paged(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor, meta) -> list:
        """What layer ``layer`` stores for a step's new tokens, one tensor per stream, (B, heads, n, width).

        Args:
            key_states: (B, num_key_value_heads, n, head_dim) after RoPE (on native MLA: the latent).
            value_states: (B, num_key_value_heads, n, head_dim) (on native MLA: the rope key).
            meta: the step's :class:`cache_backends.step_meta.StepMeta` (positions of the new tokens).
        """
        return [key_states, value_states]

    def attend_paged(self, layer: int, query: torch.Tensor, reads: list, meta, scaling: float,
                     module=None) -> torch.Tensor:
        """Attention of a step's queries (B, num_attention_heads, n, head_dim) over the batch's gathered
        streams (:class:`cache_backends.paged.StreamRead`, one per stream) under ``meta.mask``; returns
        (B, num_attention_heads, n, v_head_dim). ``module``: the model's attention module (native MLA)."""
        raise NotImplementedError(f"{self.name} is not paged")

    def live_bytes_per_token_per_layer(self, store: KVStore) -> float:
        """The sums for one live store: :meth:`bytes_per_token_per_layer` at its length, except where the
        store's own decisions set its layout (``dca``: the layers this sequence reuses). Equals
        ``store.nbytes() / (tokens * num_layers)``."""
        return self.bytes_per_token_per_layer(store.num_tokens())
