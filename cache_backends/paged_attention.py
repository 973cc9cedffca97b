"""Attention of a step's queries over gathered streams in their stored form (a leaf: it imports no backend). Exact
streams go through ``scaled_dot_product_attention`` under the step's mask; quantized tiers are scored on their codes
(:class:`cache_backends.paged.StreamRead`)."""

from __future__ import annotations

import torch

from cache_backends import kernels
from cache_backends.paged import InPlaceRead

def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax of ``scores * scaling`` over the last axis where ``mask`` is True (0 elsewhere)."""
    return torch.softmax((scores * scaling).masked_fill(~mask, float("-inf")), dim=-1)


def grouped_rows(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, R, d) queries → (B, kv_heads, rep * R, d): each K/V head's query heads together."""
    b, hq, r, d = query.shape
    return query.reshape(b, kv_heads, (hq // kv_heads) * r, d)


def ungroup_rows(out: torch.Tensor, hq: int) -> torch.Tensor:
    """Inverse of :func:`grouped_rows`: (B, kv_heads, rep * R, d) → (B, Hq, R, d)."""
    b, h, rows, d = out.shape
    return out.reshape(b, hq, rows * h // hq, d)


def group_mask(mask: torch.Tensor, rep: int) -> torch.Tensor:
    """(B, R, T) step mask → (B, 1, rep * R, T), rows ordered as :func:`grouped_rows` orders them."""
    b, r, t = mask.shape
    return mask[:, None].expand(b, rep, r, t).reshape(b, 1, rep * r, t)


def attend_pair(query: torch.Tensor, keys, values, meta,
                scaling: float) -> torch.Tensor:
    """Attention of a step's queries over a key stream and a value stream in their stored form.

    Streams read in place (:class:`cache_backends.paged.InPlaceRead`) go through the attention kernel in one op
    (:func:`cache_backends.kernels.paged_attention`). Gathered exact streams go through
    ``scaled_dot_product_attention`` with the step's mask; gathered quantized tiers are scored on their codes
    (scales and rotation folded into the query and the weights; no dequantized copy of the context).

    Args:
        query: (B, Hq, R, d) after RoPE; Hq a multiple of the streams' heads H.

    Returns:
        (B, Hq, R, dv).
    """
    if isinstance(keys, InPlaceRead):  # the kernel reads the pool in place: one op
        return kernels.paged_attention(query, keys, values, meta, scaling)
    hq, h = query.shape[1], keys.exact.shape[0]
    rep = hq // h
    q = grouped_rows(query, h).transpose(0, 1)  # (H, B, rep * R, d): the gathered streams' order
    grouped = meta.grouped_mask(rep)  # (B, 1, rep * R, T), or None: the first meta.unmasked_len tokens, all seen
    mask = None if grouped is None else grouped.transpose(0, 1)  # (1, B, rep * R, T)
    if keys.codes is None and values.codes is None:
        k, v = keys.exact, values.exact
        if mask is None:  # no mask: the rows' own tokens, without the padding of their last page (views)
            k, v = k[:, :, :meta.unmasked_len], v[:, :, :meta.unmasked_len]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    else:
        probs = masked_softmax(keys.dot(q), mask, scaling)  # a quantized layout's mask is never dropped
        out = values.weighted_sum(probs)
    return ungroup_rows(out.transpose(0, 1), hq)
