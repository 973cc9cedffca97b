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


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes held by ``tensors`` (``None`` counts as 0)."""
    return sum(t.nelement() * t.element_size() for t in tensors if t is not None)


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
    """

    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    dtype_bytes: int
    kv_lora_rank: int | None = None
    rope_dim: int = 0

    @classmethod
    def from_config(cls, config, dtype: torch.dtype) -> "ModelGeometry":
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            dtype_bytes=torch.empty((), dtype=dtype).element_size(),
            kv_lora_rank=getattr(config, "kv_lora_rank", None),
            rope_dim=getattr(config, "qk_rope_head_dim", 0) if getattr(config, "kv_lora_rank", None) else 0,
        )


class FullStorage:
    """A stream of per-token vectors, (batch, heads, seq_len, width), kept exactly (grown by concatenation).

    The same interface as :class:`cache_backends.int8.Int8Storage`, so a backend that stores something
    per token (shared heads, a latent) can hold it exactly or quantized.
    """

    def __init__(self):
        self.data: torch.Tensor | None = None
        self.length = 0

    def append(self, x: torch.Tensor) -> None:
        self.data = x if self.data is None else torch.cat([self.data, x], dim=-2)
        self.length += x.shape[-2]

    def read(self) -> torch.Tensor:
        return self.data

    def nbytes(self) -> int:
        return tensor_bytes(self.data)


def make_storage(axis: str, quantize: dict | None):
    """An exact :class:`FullStorage`, or an ``Int8Storage`` when ``quantize`` gives group_size and residual.

    Args:
        axis: ``"channel"`` (key-like streams) or ``"token"`` (value-like streams), for int8.
        quantize: ``None``, or ``{"group_size": int, "residual": int}``.
    """
    if quantize is None:
        return FullStorage()
    from cache_backends.int8 import Int8Storage

    return Int8Storage(axis, quantize["group_size"], quantize["residual"])


class KVLayer(CacheLayerMixin):
    """One layer of a KV store. Subclasses hold their tensors and count their bytes."""

    is_sliding = False
    is_croppable = False

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of every tensor this layer holds right now."""

    @abstractmethod
    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (after RoPE) and values of every cached token, (1, num_key_value_heads, seq_len, head_dim),
        rebuilt from what the layer holds (transient: the caller must not keep them)."""

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class KVStore(Cache):
    """One sequence's KV cache: a ``transformers.Cache`` made of a backend's :class:`KVLayer` objects."""

    def __init__(self, layers: list[KVLayer]):
        super().__init__(layers=layers)

    def nbytes(self) -> int:
        """Bytes held by all layers (int)."""
        return sum(layer.nbytes() for layer in self.layers)

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

    Subclasses set :attr:`name`, implement :meth:`new_store` and :meth:`bytes_per_token_per_layer`,
    and may override :meth:`prepare` (calibration) and :meth:`params` (shown in ``/info``).

    Args:
        geometry: the served model's attention shape.
        options: backend parameters (already validated by the settings layer).
    """

    name: ClassVar[str]

    def __init__(self, geometry: ModelGeometry, **options: Any):
        self.geometry = geometry
        self.options = options

    def prepare(self, model, calibration_ids: list[int] | None = None) -> None:
        """Fit whatever the backend needs on the loaded model (no-op by default)."""

    def params(self) -> dict[str, Any]:
        """The backend's parameters (its constructor options), for ``/info`` and reports."""
        return dict(self.options)

    def details(self) -> dict[str, Any]:
        """Extra facts for ``/info`` (e.g. calibration results); empty by default."""
        return {}

    def new_store(self) -> KVStore:
        """An empty KV store for one sequence (one :meth:`new_layer` per model layer)."""
        return KVStore([self.new_layer(i) for i in range(self.geometry.num_layers)])

    @abstractmethod
    def new_layer(self, index: int, position_offset: int = 0) -> KVLayer:
        """An empty cache layer for model layer ``index``; its first token sits at ``position_offset``."""

    @abstractmethod
    def bytes_per_token_per_layer(self, seq_len: int = 1024) -> float:
        """Closed-form bytes one token costs in one layer at the model's dtype (the estimator's formula),
        averaged over a sequence of ``seq_len`` tokens (only windowed backends depend on it)."""
