"""The KV-cache sums, in one place: bytes per token per layer for each backend.

Every backend's closed-form check and ``kvserve estimate`` use these functions. Units are bytes.
"""

from __future__ import annotations


def full_bytes_per_token_per_layer(num_key_value_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Exact K and V: ``2 * num_key_value_heads * head_dim * dtype_bytes``."""
    return 2 * num_key_value_heads * head_dim * dtype_bytes


def gqa_bytes_per_token_per_layer(groups: int, head_dim: int, dtype_bytes: int) -> int:
    """G shared K and V heads: ``2 * groups * head_dim * dtype_bytes``."""
    return 2 * groups * head_dim * dtype_bytes


def mla_bytes_per_token_per_layer(rank: int, rope_dim: int, dtype_bytes: int) -> int:
    """A latent of ``rank`` values (plus a shared rope key of ``rope_dim`` on native MLA): ``(rank + rope_dim) * B``."""
    return (rank + rope_dim) * dtype_bytes


def int8_bytes_per_token_per_layer(num_key_value_heads: int, head_dim: int, dtype_bytes: int, group_size: int,
                                   residual: int, seq_len: int) -> float:
    """int8 K and V with scales and zero points, plus a full-precision residual window, averaged at ``seq_len``.

    Keys: one scale and one zero point (``dtype_bytes`` each) per channel per group of ``group_size``
    tokens. Values: one scale and one zero point per token per head. The newest tokens stay in full
    precision: at ``seq_len`` tokens, ``r`` of them, where r = residual + (seq_len - residual) mod
    group_size once seq_len >= residual + group_size (before that, all of them).

    Returns:
        Average bytes per token per layer at ``seq_len`` tokens.
    """
    hd = num_key_value_heads * head_dim
    if seq_len < residual + group_size:
        fp_tokens = seq_len
    else:
        fp_tokens = residual + (seq_len - residual) % group_size
    q_tokens = seq_len - fp_tokens
    key_bytes = q_tokens * hd + (q_tokens // group_size) * hd * 2 * dtype_bytes
    value_bytes = q_tokens * hd + q_tokens * num_key_value_heads * 2 * dtype_bytes
    fp_bytes = fp_tokens * 2 * hd * dtype_bytes
    return (key_bytes + value_bytes + fp_bytes) / max(seq_len, 1)
