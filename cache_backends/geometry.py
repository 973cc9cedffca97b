"""A model's attention shape as a backend needs it (:class:`ModelGeometry`), read from a transformers config
(no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cache_backends.sizes import Shape, layer_windows_of, rope_per_layer_type_of

if TYPE_CHECKING:
    import torch


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window from a transformers config (:func:`cache_backends.sizes.layer_windows_of`)."""
    return layer_windows_of(lambda name: getattr(config, name, None), config.num_hidden_layers)


def rope_per_layer_type(config) -> bool:
    """Whether a transformers config rotates its layer types with different RoPE parameters
    (:func:`cache_backends.sizes.rope_per_layer_type_of`)."""
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
