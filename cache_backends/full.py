"""``full``: exact K/V, the baseline every other backend is measured against.

Stores, per layer, keys (after RoPE) and values of shape ``(1, num_key_value_heads, seq_len, head_dim)``
in the model's dtype, grown by concatenation like transformers' ``DynamicLayer``.
Bytes per token per layer: ``2 * num_key_value_heads * head_dim * dtype_bytes``. (On a native-MLA model
such as DeepSeek-V3, transformers hands the cache the model's latent and rope key instead, so ``full``
holds those exactly: ``(kv_lora_rank + qk_rope_head_dim) * dtype_bytes``.)
"""

from __future__ import annotations

from transformers.cache_utils import DynamicLayer

from cache_backends.base import KVBackend, KVLayer, tensor_bytes
from cache_backends.estimate import full_bytes_per_token_per_layer, mla_bytes_per_token_per_layer


class FullLayer(DynamicLayer, KVLayer):
    """transformers' ``DynamicLayer`` with byte accounting."""

    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values) if self.is_initialized else 0

    def materialize(self):
        return self.keys, self.values


class FullBackend(KVBackend):
    """Exact keys and values (no compression)."""

    name = "full"

    def new_layer(self, index: int, position_offset: int = 0) -> FullLayer:
        return FullLayer()

    def bytes_per_token_per_layer(self, seq_len: int = 1024) -> float:
        g = self.geometry
        if g.kv_lora_rank:  # native-MLA models hand the cache their latent and rope key, not per-head K/V
            return mla_bytes_per_token_per_layer(g.kv_lora_rank, g.rope_dim, g.dtype_bytes)
        return full_bytes_per_token_per_layer(g.num_key_value_heads, g.head_dim, g.dtype_bytes)
