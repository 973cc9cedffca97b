"""The KV backend contract: a backend makes per-sequence KV stores and says what they cost.

A *KV store* is one sequence's cache: a ``transformers.Cache`` whose layers are ``CacheLayerMixin``
subclasses owned by the backend. The model writes each layer's new keys and values through
``Cache.update`` (keys after RoPE, shape ``(batch, num_key_value_heads, new_tokens, head_dim)``) and
reads back the keys and values it attends to. A store reports the bytes it really holds — the sum of
``tensor.nelement() * tensor.element_size()`` over every tensor it keeps (scales and metadata
included) — through :meth:`KVStore.nbytes`; the engine never infers memory from shapes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from cache_backends.attention import LayerRead, attend_kv
from cache_backends.buffer import TokenBuffer
from cache_backends.sizes import (Shape, layer_windows_of, rope_per_layer_type_of, window_groups,
                                     windowed_bytes_per_token_per_layer)
from cache_backends.hybrid import HybridLayout, HybridStepMeta
from cache_backends.kv_spec import KVSpec, Quantization, StreamSpec
from cache_backends.page_layout import PageLayout
from cache_backends.paged import in_place_layer, read_layer, write_layer
from cache_backends.step_meta import StepMeta


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes held by ``tensors`` (``None`` counts as 0)."""
    return sum(t.nelement() * t.element_size() for t in tensors if t is not None)


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window from a transformers config (:func:`cache_backends.estimate.layer_windows_of`)."""
    return layer_windows_of(lambda name: getattr(config, name, None), config.num_hidden_layers)


def rope_per_layer_type(config) -> bool:
    """Whether a transformers config rotates its layer types with different RoPE parameters
    (:func:`cache_backends.estimate.rope_per_layer_type_of`)."""
    return rope_per_layer_type_of(lambda name: getattr(config, name, None))


@dataclass(frozen=True)
class ModelGeometry:
    """The attention shape a backend needs, read from a model config.

    Attributes:
        num_layers: decoder layers (``num_hidden_layers``).
        num_attention_heads: query heads per layer.
        num_key_value_heads: K/V heads per layer.
        head_dim: channels per head.
        dtype_bytes: bytes per element of the K/V the model produces (4 for fp32, 2 for fp16/bf16).
        kv_lora_rank: on a native-MLA model (DeepSeek-V2/V3), the latent width it caches; else ``None``.
        rope_dim: on a native-MLA model, the width of its shared rope key (``qk_rope_head_dim``); else 0.
        layer_windows: per layer, its sliding window (tokens a query sees, itself included) or ``None`` for a
            global layer; empty when no layer has a window shorter than the context (:func:`layer_windows`).
        rope_per_layer_type: whether layers of different types rotate with different RoPE parameters (Gemma 3's
            ``rope_parameters`` per layer type: base 10,000 on sliding layers, 1,000,000 on global ones).
    """

    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    dtype_bytes: int
    kv_lora_rank: int | None = None
    rope_dim: int = 0
    layer_windows: tuple[int | None, ...] = ()
    rope_per_layer_type: bool = False

    @classmethod
    def from_config(cls, config, dtype: torch.dtype) -> "ModelGeometry":
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            dtype_bytes=dtype.itemsize,
            kv_lora_rank=getattr(config, "kv_lora_rank", None),
            rope_dim=getattr(config, "qk_rope_head_dim", 0) if getattr(config, "kv_lora_rank", None) else 0,
            layer_windows=layer_windows(config),
            rope_per_layer_type=rope_per_layer_type(config),
        )

    @property
    def sliding_layers(self) -> int:
        """Layers with a sliding window (0 on a model whose every layer sees its whole context)."""
        return sum(w is not None for w in self.layer_windows)

    def shape(self) -> Shape:
        """The same shape as the closed-form sums (and ``kvserve estimate``) take it."""
        return Shape(self.num_layers, self.num_key_value_heads, self.head_dim, self.head_dim, self.kv_lora_rank,
                     self.rope_dim, layer_windows=self.layer_windows, rope_per_layer_type=self.rope_per_layer_type)


class FullStorage:
    """A stream of per-token vectors, (batch, heads, seq_len, width), kept exactly, appended in place.

    The same interface as :class:`cache_backends.int8.Int8Storage` (``append``, ``read``, ``dot``,
    ``weighted_sum``, byte counts), so a backend that stores something per token (shared heads, a
    latent) can hold it exactly or quantized, and attend to it without rebuilding it.
    """

    def __init__(self):
        self.buffer = TokenBuffer()

    @property
    def length(self) -> int:
        return self.buffer.length

    @property
    def heads(self) -> int:
        """Heads of the stream (the second dimension)."""
        return self.buffer.data.shape[1]

    def reserve(self, max_tokens: int) -> None:
        """Cap the capacity at ``max_tokens`` (the request's reservation); call before the first append."""
        self.buffer.max_tokens = max_tokens

    @staticmethod
    def reserved_bytes(max_tokens: int, heads: int, width: int, dtype_bytes: int) -> int:
        """The most bytes a store reserved for ``max_tokens`` can allocate."""
        return max_tokens * heads * width * dtype_bytes

    def append(self, x: torch.Tensor) -> None:
        self.buffer.append(x)

    def read(self) -> torch.Tensor:
        """Every token, (batch, heads, seq_len, width): a view, no copy."""
        return self.buffer.view()

    def dot(self, query: torch.Tensor) -> torch.Tensor:
        """Scores of every stored token against ``query`` (batch, heads, R, width) → (batch, heads, R, seq_len)."""
        return query @ self.buffer.view().transpose(-1, -2)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """``weights`` (batch, heads, R, seq_len) times the stored tokens → (batch, heads, R, width)."""
        return weights @ self.buffer.view()

    def nbytes(self) -> int:
        """Bytes of the tokens held."""
        return self.buffer.used_bytes()

    def allocated_bytes(self) -> int:
        """Bytes allocated, including free capacity."""
        return self.buffer.allocated_bytes()

    def release(self) -> None:
        self.buffer.release()


class KVLayer(CacheLayerMixin):
    """One layer of a KV store. Subclasses hold their tensors, count their bytes, and attend to them.

    ``update`` (transformers' ``CacheLayerMixin`` contract) appends the new tokens, then returns a
    :class:`cache_backends.attention.LayerRead` in place of the keys, so the model's attention calls
    :meth:`attend` on what the layer stores (see :mod:`cache_backends.attention`). When the store was
    made with ``in_place=False`` (models whose attention transforms K/V after the cache read, e.g.
    DeepSeek-V3) it returns :meth:`materialize` instead.
    """

    is_sliding = False
    is_croppable = False
    in_place = True
    own_window = False  # a layer that masks its own window (the window backend's), whatever the model passes

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new tokens (1, num_key_value_heads, n, head_dim); return a read object or K/V."""
        self.is_initialized = True
        self.append(key_states, value_states)
        if self.in_place:
            return LayerRead(self), None
        return self.materialize()

    @abstractmethod
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store new tokens' keys (after RoPE) and values, (1, num_key_value_heads, n, head_dim)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of the tokens this layer holds right now (what the closed formulas count)."""

    def allocated_bytes(self) -> int:
        """Bytes allocated by this layer, free capacity included (>= :meth:`nbytes`)."""
        return self.nbytes()

    def reserve(self, max_tokens: int) -> None:
        """Cap this layer's capacity at ``max_tokens`` tokens (before the first append); no-op by default."""

    @abstractmethod
    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (after RoPE) and values of every cached token, (1, num_key_value_heads, seq_len, head_dim),
        rebuilt from what the layer holds (transient: the caller must not keep them)."""

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Causal attention of the newest ``q_len`` tokens' queries over this layer's cache.

        Args:
            query: (1, num_attention_heads, q_len, head_dim), after RoPE.
            scaling: the softmax scale.

        Returns:
            (1, num_attention_heads, q_len, head_dim). The default rebuilds K/V with :meth:`materialize`
            (prefill); backends override the decode path to attend in their stored form.
        """
        keys, values = self.materialize()
        return attend_kv(query, keys, values, scaling)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class StreamPairLayer(KVLayer):
    """A layer that keeps one key-like and one value-like per-token stream (``key_store``, ``value_store``,
    each a :class:`FullStorage` or an ``Int8Storage``): reservation, length, release and byte counts."""

    key_store: "FullStorage"
    value_store: "FullStorage"

    def reserve(self, max_tokens: int) -> None:
        self.key_store.reserve(max_tokens)
        self.value_store.reserve(max_tokens)

    def get_seq_length(self) -> int:
        return self.key_store.length

    def reset(self) -> None:
        self.key_store.release()
        self.value_store.release()
        self.is_initialized = False

    def nbytes(self) -> int:
        return self.key_store.nbytes() + self.value_store.nbytes()

    def allocated_bytes(self) -> int:
        return self.key_store.allocated_bytes() + self.value_store.allocated_bytes()


class KVStore(Cache):
    """One sequence's KV cache: a ``transformers.Cache`` made of a backend's :class:`KVLayer` objects."""

    def __init__(self, layers: list[KVLayer], in_place: bool = True):
        super().__init__(layers=layers)
        self.in_place = in_place
        for layer in layers:
            layer.in_place = in_place

    def nbytes(self) -> int:
        """Bytes of the cached tokens over all layers (what the closed formulas count)."""
        return sum(layer.nbytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        """Bytes allocated over all layers, free capacity included (the memory the store holds)."""
        return sum(layer.allocated_bytes() for layer in self.layers)

    def reserve(self, max_tokens: int) -> None:
        """Cap every layer's capacity at ``max_tokens`` (the request's token budget); call before prefill.
        The store then never allocates more than its backend's :meth:`KVBackend.reserved_bytes`."""
        for layer in self.layers:
            layer.reserve(max_tokens)

    @property
    def supports_chunked_prefill(self) -> bool:
        """Whether a prompt may be written in several forward passes (``dca`` decides once per prompt)."""
        return True

    def num_tokens(self) -> int:
        """Tokens cached (the sequence length seen by layer 0)."""
        return self.get_seq_length(0)

    def skip_kv_projection(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` may skip its K/V projections this step (only ``dca`` says yes)."""
        return False

    def stats(self) -> dict:
        """Backend-specific live numbers for metrics (e.g. dca's reuse layers); empty by default."""
        return {}

    def release(self) -> None:
        """Drop every tensor at once (a finished or cancelled sequence frees its KV here)."""
        for layer in self.layers:
            layer.reset()


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
        return HybridLayout([PageLayout(spec.with_layers(len(layers)), dtype, page_bytes) for _, layers in groups],
                            [w for w, _ in groups], [layers for _, layers in groups])

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
        write_layer(views, index, meta, self.encode_paged(layer, key_states, value_states, meta))
        if self.attends_in_place:
            reads = in_place_layer(views, index)
            if reads is not None:
                return reads
        return read_layer(views, index, meta)

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
