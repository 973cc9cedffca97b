"""Closed-form KV sums written out by hand, as references for tests that check what kvserve computes
(:mod:`cache_backends.kv_spec`) against the formulas of the README and docs. Bytes."""

from __future__ import annotations


def full_bytes_per_token_per_layer(num_key_value_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Exact K and V: ``2 * num_key_value_heads * head_dim * dtype_bytes``."""
    return 2 * num_key_value_heads * head_dim * dtype_bytes


def int8_bytes_per_token_per_layer(num_key_value_heads: int, head_dim: int, dtype_bytes: int, group_size: int,
                                   residual: int, seq_len: int) -> float:
    """KIVI int8 at ``seq_len`` tokens: int8 codes, a scale and a zero point per key channel per group of
    ``group_size`` tokens and per value token and head, and ``residual + (seq_len - residual) % group_size``
    tokens exact once ``seq_len >= residual + group_size`` (before that, all)."""
    hd = num_key_value_heads * head_dim
    exact = seq_len if seq_len < residual + group_size else residual + (seq_len - residual) % group_size
    q = seq_len - exact
    keys = q * hd + (q // group_size) * hd * 2 * dtype_bytes
    values = q * hd + q * num_key_value_heads * 2 * dtype_bytes
    return (keys + values + exact * 2 * hd * dtype_bytes) / max(seq_len, 1)
