"""A sequence's KV store on the reference path: a backend makes per-sequence KV stores of its own layers.

A *KV store* is one sequence's cache: a ``transformers.Cache`` whose layers are ``CacheLayerMixin``
subclasses owned by the backend. The model writes each layer's new keys and values through
``Cache.update`` (keys after RoPE, shape ``(batch, num_key_value_heads, new_tokens, head_dim)``) and
reads back the keys and values it attends to. A store reports the bytes it really holds — the sum of
``tensor.nelement() * tensor.element_size()`` over every tensor it keeps (scales and metadata
included) — through :meth:`KVStore.nbytes`; the engine never infers memory from shapes.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from cache_backends.attention import LayerRead, attend_kv
from cache_backends.buffer import TokenBuffer


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
        The store then never allocates more than its backend's :meth:`cache_backends.base.KVBackend.reserved_bytes`."""
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
