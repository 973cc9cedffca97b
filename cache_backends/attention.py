"""kvserve's attention function: each KV layer attends in its own stored representation, in place.

Registered in transformers' attention-function registry (``AttentionInterface``) as ``"kvserve"``
and installed on the served model with :func:`install`. A kvserve cache layer's ``update`` returns a
*read* object in place of the keys (and ``None`` for the values); this function hands the query to it,
so the layer computes attention over what it actually stores — full K/V through a view of its
buffer, shared GQA heads with codec-folded queries, int8 codes with scales folded into the query and
the probabilities, a latent with the value projection absorbed — without building a padded or
dequantized copy of the whole cache. A plain ``(keys, values)`` pair (transformers' own caches, or a
layer that still rebuilds its K/V) goes through transformers' SDPA attention unchanged, with the
standard SDPA mask (registered for ``"kvserve"`` too).

In a batched decode step (:class:`BatchRead`) each sequence's layer attends to its own cache with its
own length: a ragged batch without padding, at the price of one small attention call per sequence.

Sliding-window layers (Gemma 2/3, Mistral; Beltagy et al., Longformer, arXiv 2004.05150): transformers passes each
layer's ``sliding_window`` with the call (``None`` on a global layer); a query at position ``p`` then sees the
cached tokens at positions ``p - sliding_window < t <= p`` (transformers' ``sliding_window_overlay``), and every
read object takes that ``window``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME = "kvserve"


def grouped_query(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(1, Hq, 1, d) decode query → (1, kv_heads, Hq / kv_heads, d): each K/V head's query heads together."""
    _, hq, _, d = query.shape
    return query.reshape(1, kv_heads, hq // kv_heads, d)


def ungroup(out: torch.Tensor) -> torch.Tensor:
    """(1, kv_heads, rep, d) → (1, kv_heads * rep, 1, d), the inverse of :func:`grouped_query`."""
    _, h, rep, d = out.shape
    return out.reshape(1, h * rep, 1, d)


def causal_mask(q_len: int, kv_len: int, device, window: int | None = None, sinks: int = 0) -> torch.Tensor | None:
    """Bool mask (q_len, kv_len) for queries at the last ``q_len`` positions, each seeing only its last ``window``
    tokens (itself included) when ``window`` is given, and then also the first ``sinks`` tokens (attention sinks,
    StreamingLLM arXiv 2309.17453); ``None`` when nothing is masked (q_len == 1 and no window shorter than kv_len)."""
    if q_len == 1 and (window is None or window >= kv_len):
        return None
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
    cols = torch.arange(kv_len, device=device).unsqueeze(0)
    mask = cols <= rows
    return mask if window is None else mask & ((cols > rows - window) | (cols < sinks))


def attend_kv(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
              window: int | None = None, sinks: int = 0) -> torch.Tensor:
    """Causal attention of one sequence's new queries over its cached K/V (the queries are the newest tokens).

    Args:
        query: (1, Hq, q_len, d).
        keys: (1, H, T, d) with T >= q_len, H dividing Hq (GQA); views are fine.
        values: (1, H, T, dv).
        scaling: softmax scale (seconds-free: 1/sqrt(d) by default in the model).
        window: a sliding window: each query sees only the last ``window`` tokens up to itself; ``None``: all.
        sinks: with ``window``, the first ``sinks`` tokens are seen too (attention sinks, arXiv 2309.17453).

    Returns:
        (1, Hq, q_len, dv).
    """
    h = keys.shape[1]
    q_len = query.shape[-2]
    if sinks and window is not None and window < keys.shape[-2]:  # sinks and a window: a mask
        mask = causal_mask(q_len, keys.shape[-2], query.device, window, sinks)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                              enable_gqa=query.shape[1] != h)
    if window is not None and q_len == 1 and window < keys.shape[-2]:  # decode: the window is the last tokens
        keys, values = keys[:, :, -window:], values[:, :, -window:]
    if q_len == 1:  # decode: one matrix product per K/V head, no repeat of K/V for GQA
        out = F.scaled_dot_product_attention(grouped_query(query, h), keys, values, scale=scaling)
        return ungroup(out)
    mask = causal_mask(q_len, keys.shape[-2], query.device, window)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                          enable_gqa=query.shape[1] != h)


class TensorRead:
    """Plain K/V tensors of one sequence, (1, H, T, d), attended causally."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def attend(self, query: torch.Tensor, scaling: float, window: int | None = None) -> torch.Tensor:
        return attend_kv(query, self.keys, self.values, scaling, window)


class LayerRead:
    """A kvserve cache layer, returned by its ``update`` in place of the keys: it attends itself."""

    def __init__(self, layer):
        self.layer = layer

    def attend(self, query: torch.Tensor, scaling: float, window: int | None = None) -> torch.Tensor:
        """(1, Hq, q_len, d) queries → (1, Hq, q_len, dv) attention output. Under a ``window`` shorter than the
        layer's tokens, the layer's K/V are rebuilt (:meth:`cache_backends.kv_store.KVLayer.materialize`, a transient
        copy) and attended under the window's mask: the per-sequence stores' reference path. A layer with a window
        of its own (``own_window``: :class:`cache_backends.window.WindowLayer`) applies its own rule."""
        if window is not None and window < self.layer.get_seq_length() and not self.layer.own_window:
            keys, values = self.layer.materialize()
            return attend_kv(query, keys, values, scaling, window)
        return self.layer.attend(query, scaling)


class BatchRead:
    """One read per sequence of a batched decode step; row ``i`` of the query attends with read ``i``."""

    def __init__(self, reads: list):
        self.reads = reads

    def attend(self, query: torch.Tensor, scaling: float, window: int | None = None) -> torch.Tensor:
        """(batch, Hq, q_len, d) → (batch, Hq, q_len, dv), each row against its own cache (under ``window``)."""
        out = None
        for row, read in enumerate(self.reads):
            o = read.attend(query[row : row + 1], scaling, window)
            if out is None:
                out = o.new_empty(len(self.reads), *o.shape[1:])
            out[row] = o[0]
        return out


def as_read(keys, values):
    """A read object for what a cache layer returned: itself if it is one, else a :class:`TensorRead`."""
    return keys if hasattr(keys, "attend") else TensorRead(keys, values)


def kvserve_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-function signature; returns ``(output (batch, q_len, Hq, dv), None)``.

    ``scaling`` (Gemma 3: ``query_pre_attn_scalar ** -0.5``) and ``sliding_window`` (the layer's window; ``None``
    on a global layer) are the call's own, so every layer attends with its own. Plain K/V (transformers' caches) go
    through SDPA with the mask transformers built for the layer (its window included).

    Raises:
        ValueError: for a read object on a layer that soft-caps logits (a guard: :func:`install` refuses
            such models first).
    """
    if not hasattr(key, "attend"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("softcap"):
        raise ValueError("kvserve attention does not implement logit soft-capping")
    scaling = module.scaling if scaling is None else scaling
    out = key.attend(query, scaling, kwargs.get("sliding_window"))
    return out.transpose(1, 2).contiguous(), None


def unsupported_features(config) -> list[str]:
    """Attention features of ``config`` that kvserve's attention does not implement (empty: supported)."""
    features = []
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        features.append(f"attention logit soft-capping (attn_logit_softcapping={softcap})")
    return features


def install(model) -> None:
    """Register ``"kvserve"`` (attention function and SDPA mask) and switch ``model`` to it (idempotent).

    Raises:
        ValueError: one line naming the model type and the attention features kvserve does not implement
            (logit soft-capping: Gemma 2's ``attn_logit_softcapping``; Gemma 3 has none).
    """
    features = unsupported_features(model.config)
    if features:
        raise ValueError(f"{model.config.model_type}: kvserve's attention does not implement "
                         + "; ".join(features))
    ALL_ATTENTION_FUNCTIONS.register(NAME, kvserve_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
