"""``full``: exact K/V, the baseline every other backend is measured against.

Stores, per layer, keys (after RoPE) and values of shape ``(1, num_key_value_heads, seq_len, head_dim)``
in the model's dtype, in preallocated buffers appended in place (:mod:`cache_backends.buffer`); decode
attends through a view of them (no copy). Bytes per token per layer:
``2 * num_key_value_heads * head_dim * dtype_bytes``. (On a native-MLA model such as DeepSeek-V3,
transformers hands the cache the model's latent and rope key instead, so ``full`` holds those exactly:
``(kv_lora_rank + qk_rope_head_dim) * dtype_bytes``; it pages them and attends with absorbed attention,
:mod:`cache_backends.absorbed_mla`, as ``mla`` does on such a model.)
"""

from __future__ import annotations

import torch

from cache_backends.absorbed_mla import absorbed_attention, install_absorbed_attention
from cache_backends.attention import attend_kv
from cache_backends.base import KVBackend
from cache_backends.kv_store import FullStorage, StreamPairLayer
from cache_backends.kv_spec import KVSpec, StreamSpec, kv_streams
from cache_backends.paged_attention import attend_pair


class FullLayer(StreamPairLayer):
    """Exact keys and values, (1, H, seq_len, d) each, in two in-place :class:`FullStorage` buffers."""

    def __init__(self):
        super().__init__()
        self.key_store, self.value_store = FullStorage(), FullStorage()

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.key_store.append(key_states)
        self.value_store.append(value_states)

    def materialize(self):
        return self.key_store.read(), self.value_store.read()

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        return attend_kv(query, self.key_store.read(), self.value_store.read(), scaling)


class FullBackend(KVBackend):
    """Exact keys and values (no compression)."""

    name = "full"
    windowed_pool = True  # on a hybrid model its sliding layers' pages keep only their windows

    #: K/V pairs go through the attention kernel, and so does a native-MLA model's latent and rope key (absorbed
    #: attention, :func:`cache_backends.absorbed_mla.absorbed_attention`).
    attends_in_place = True

    def prepare(self, model, calibration_ids: list[int] | None = None, cache=None) -> None:
        """Nothing to fit; on a native-MLA model, switch its attention to absorbed attention over the cached latent
        (the model's own entries, exactly)."""
        if self.geometry.kv_lora_rank:
            install_absorbed_attention(model)

    def new_layer(self, index: int, position_offset: int = 0) -> FullLayer:
        return FullLayer()

    def sums_spec(self) -> tuple[str, dict]:
        g = self.geometry
        if g.kv_lora_rank:  # native-MLA models hand the cache their latent and rope key, not per-head K/V
            return "mla", {"rank": g.kv_lora_rank, "rope_dim": g.rope_dim}
        return "full", {}

    def reserved_bytes(self, max_tokens: int) -> int:
        """A per-sequence store keeps every token in every layer (windows are kept in the pool only)."""
        return int(self.kv_spec().bytes_per_token_per_layer(max_tokens) * max_tokens * self.geometry.num_layers)

    def kv_spec(self) -> KVSpec:
        """A block holds keys and values, (num_key_value_heads, head_dim) each per token; on a native-MLA model the
        model's latent (1, kv_lora_rank) and shared rope key (1, qk_rope_head_dim)."""
        g = self.geometry
        if g.kv_lora_rank:
            return self._kv_spec([StreamSpec(1, g.kv_lora_rank), StreamSpec(1, g.rope_dim)])
        return self._kv_spec(kv_streams(g.num_key_value_heads, g.head_dim))

    def attend_paged(self, layer, query, reads, meta, scaling, module=None):
        """Exact attention over the K/V (the kernel in place, or ``scaled_dot_product_attention`` over the gathered
        pages under the step's mask); on a native-MLA model absorbed attention over the latent and rope key."""
        if self.geometry.kv_lora_rank:
            return absorbed_attention(query, reads[0], reads[1], meta, scaling, module)
        return attend_pair(query, reads[0], reads[1], meta, scaling)
