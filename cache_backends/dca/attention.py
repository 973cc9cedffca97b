"""The attention path for ``dca``: let a reuse layer skip its own K/V projections during decode.

transformers' attention modules always compute ``k_proj``/``v_proj`` before they reach the cache, so
layer reuse needs one step earlier than the ``Cache`` extension point: :class:`ReuseAwareAttention`
wraps a Llama-style attention module (``q_proj``, optional ``q_norm`` as in Qwen3, ``o_proj``,
``head_dim``, ``scaling``, RoPE via ``position_embeddings``) and asks the cache ``skip_kv_projection(layer_idx)`` first. When the cache says
yes, only the query is projected; the cache's ``update(None, None, layer_idx)`` returns the keys and
values to attend to, rebuilt from another layer. In every other case the wrapped module runs unchanged,
so other backends served by the same model see the original attention.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from cache_backends.rope import rotate_half


class ReuseAwareAttention(nn.Module):
    """Wraps one decoder layer's attention module (its parameters stay where they are).

    Args:
        inner: the original attention module (``LlamaAttention`` or one shaped like it).
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.layer_idx = inner.layer_idx

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None,
                **kwargs):
        skip = getattr(cache, "skip_kv_projection", None)
        if skip is None or not skip(self.layer_idx):
            return self.inner(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
                              cache=cache, **kwargs)
        inner = self.inner
        input_shape = hidden_states.shape[:-1]  # (batch, q_len)
        query = inner.q_proj(hidden_states).view(*input_shape, -1, inner.head_dim)
        if getattr(inner, "q_norm", None) is not None:  # Qwen3-style per-head query norm before RoPE
            query = inner.q_norm(query)
        query = query.transpose(1, 2)
        cos, sin = position_embeddings  # (batch, q_len, head_dim)
        query = query * cos.unsqueeze(1) + rotate_half(query) * sin.unsqueeze(1)
        keys, values = cache.update(None, None, self.layer_idx)  # rebuilt, (batch, kv_heads, seq_len, head_dim)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(inner.config._attn_implementation, eager_attention_forward)
        out, weights = attention(inner, query, keys, values, attention_mask, dropout=0.0, scaling=inner.scaling,
                                 **kwargs)
        return inner.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def install(model) -> None:
    """Wrap every decoder layer's ``self_attn`` once (idempotent).

    Raises:
        ValueError: if the model's layers are not Llama-style (``model.model.layers[i].self_attn``
            with ``q_proj``, ``o_proj`` and ``head_dim``).
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("dca needs a decoder with model.model.layers")
    for layer in layers:
        attn = layer.self_attn
        if isinstance(attn, ReuseAwareAttention):
            continue
        if not all(hasattr(attn, a) for a in ("q_proj", "o_proj", "head_dim", "scaling", "layer_idx")):
            raise ValueError(f"dca needs Llama-style attention with separate q_proj/k_proj/v_proj/o_proj; "
                             f"got {type(attn).__name__}")
        layer.self_attn = ReuseAwareAttention(attn)
