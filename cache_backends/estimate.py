"""The KV-cache sums, in one place: bytes per token per layer for each backend.

Every backend's closed-form check and ``kvserve estimate`` use these functions. Units are bytes.
"""

from __future__ import annotations


def full_bytes_per_token_per_layer(num_key_value_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Exact K and V: ``2 * num_key_value_heads * head_dim * dtype_bytes``."""
    return 2 * num_key_value_heads * head_dim * dtype_bytes
