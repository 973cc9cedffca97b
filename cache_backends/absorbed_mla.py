"""Absorbed MLA attention over a native-MLA model's own cache entries (its latent c_KV and shared rope key):
the attention kernels both ``full`` and ``mla`` serve a DeepSeek-style model with (a leaf: it imports no backend).

DeepSeek-V2, arXiv 2405.04434, section 2.1.2; as vLLM and SGLang serve it: with ``kv_b_proj`` split per head into
W_UK (nope, r) and W_UV (v, r), ``score_h,t = (W_UK_h^T q_nope_h) · c_t + q_rope_h · k_rope_t`` and
``o_h = W_UV_h (Σ_t p_h,t c_t)``: the latent is never expanded to per-head K/V.
"""

from __future__ import annotations

import torch

from cache_backends import kernels
from cache_backends.attention import BatchRead, causal_mask
from cache_backends.paged import InPlaceRead, StreamRead
from cache_backends.paged_attention import masked_softmax


class AbsorbedRead:
    """Absorbed MLA attention of one sequence (DeepSeek-V2, arXiv 2405.04434, section 2.1.2; as vLLM and
    SGLang serve it): with ``kv_b_proj`` split per head into W_UK (nope, r) and W_UV (v, r),
    ``score_h,t = (W_UK_h^T q_nope_h) · c_t + q_rope_h · k_rope_t`` and ``o_h = W_UV_h (Σ_t p_h,t c_t)``:
    the latent is never expanded to per-head K/V.

    Args:
        layer: the sequence's layer holding the latent as its keys and the rope key as its values
            (:class:`cache_backends.mla.NativeLatentLayer`, or ``full``'s layer on a native-MLA model).
        attention: the model's attention module (its ``kv_b_proj`` and head sizes).
    """

    def __init__(self, layer, attention):
        self.layer, self.attention = layer, attention

    def attend(self, query: torch.Tensor, scaling: float, window: int | None = None) -> torch.Tensor:
        """query (1, H, q_len, nope + rope) → (1, H, q_len, v_head_dim).

        Raises:
            ValueError: for a sliding ``window`` (no native-MLA model has one).
        """
        if window is not None:
            raise ValueError("absorbed MLA attention does not implement a sliding window")
        a = self.attention
        nope, h = a.qk_nope_head_dim, query.shape[1]
        w = a.kv_b_proj.weight.view(h, nope + a.v_head_dim, -1)  # (H, nope + v, r)
        q_latent = query[0, :, :, :nope] @ w[:, :nope]  # (H, q_len, r): W_UK folded into the query
        if query.shape[-2] == 1:  # decode: read the stored streams as they are (int8 codes: scales folded in)
            latent_store, rope_store = self.layer.key_store, self.layer.value_store
            scores = (latent_store.dot(q_latent.transpose(0, 1)[None]) +
                      rope_store.dot(query[0, :, :, nope:].transpose(0, 1)[None]))[0, 0]  # (H, T)
            probs = torch.softmax(scores * scaling, dim=-1)
            mixed = latent_store.weighted_sum(probs[None, None])[0, 0]  # (H, r)
            return (mixed[:, None, :] @ w[:, nope:].transpose(1, 2))[None]  # (1, H, 1, v)
        latent, rope_key = self.layer.key_store.read()[0, 0], self.layer.value_store.read()[0, 0]  # (T, r), (T, rope)
        scores = q_latent @ latent.T + query[0, :, :, nope:] @ rope_key.T  # (H, q_len, T)
        mask = causal_mask(query.shape[-2], latent.shape[0], query.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores * scaling, dim=-1)
        return ((probs @ latent) @ w[:, nope:].transpose(1, 2))[None]  # W_UV applied after attention


def absorbed_attention(query: torch.Tensor, latent: StreamRead | InPlaceRead, rope_key: StreamRead | InPlaceRead,
                       meta, scaling: float, attention) -> torch.Tensor:
    """:class:`AbsorbedRead`'s sums for a step's batch, over the pool's latent and rope key: read in place by the
    attention kernel (:class:`cache_backends.paged.InPlaceRead`: one op, MQA over the key (c_t, k_rope_t) and the
    value c_t, :func:`cache_backends.kernels.paged_attention`), or gathered.

    Args:
        query: (B, H, n, nope + rope) after RoPE.
        latent, rope_key: the streams in place, or gathered, (1, B, T, kv_lora_rank) and (1, B, T, qk_rope_head_dim).
        attention: the model's attention module (``kv_b_proj``, ``qk_nope_head_dim``, ``v_head_dim``).

    Returns:
        (B, H, n, v_head_dim).
    """
    a = attention
    nope, (b, h, n, _) = a.qk_nope_head_dim, query.shape
    w = a.kv_b_proj.weight.view(h, nope + a.v_head_dim, -1)  # (H, nope + v, r)
    q_latent = torch.einsum("bhnc,hcr->bhnr", query[..., :nope], w[:, :nope])  # (B, H, n, r): W_UK folded in
    if isinstance(latent, InPlaceRead):  # the kernel: (q_latent, q_rope) against (c_t, k_rope_t), values c_t
        mixed = kernels.paged_attention(torch.cat([q_latent, query[..., nope:]], dim=-1), latent, rope_key, meta,
                                        scaling)  # (B, H, n, r)
        return mixed @ w[:, nope:].transpose(1, 2)  # W_UV applied after attention
    q_latent = q_latent.reshape(1, b, h * n, -1)
    q_rope = query[..., nope:].reshape(1, b, h * n, -1)
    scores = latent.dot(q_latent) + rope_key.dot(q_rope)  # (1, B, H * n, T)
    mask = meta.mask[None, :, None].expand(1, b, h, n, -1).reshape(1, b, h * n, -1)
    probs = masked_softmax(scores, mask, scaling)
    mixed = latent.weighted_sum(probs)[0].reshape(b, h, n, -1)  # (B, H, n, r)
    return mixed @ w[:, nope:].transpose(1, 2)  # W_UV applied after attention


def absorb_reads(reads, attention):
    """Wrap what a native-MLA cache returned (a read, or a batch of them) for absorbed attention."""
    if hasattr(reads, "with_module"):  # a paged step's read: the batch attends in one call
        return reads.with_module(attention)
    if isinstance(reads, BatchRead):
        return BatchRead([absorb_reads(r, attention) for r in reads.reads])
    return AbsorbedRead(reads.layer, attention)


def install_absorbed_attention(model) -> None:
    """Make each DeepSeek-style attention module hand kvserve's latent reads to absorbed attention.

    transformers' ``DeepseekV3Attention`` expands the cached latent with ``expand_kv`` right after the
    cache read; its subclass made here overrides ``expand_kv`` alone: given a kvserve read it returns an
    :class:`AbsorbedRead` (attended by kvserve's attention function), given tensors (other caches,
    ``generate()``) it expands them as before. Idempotent.

    Raises:
        ValueError: if the model's attention modules have no ``expand_kv``/``kv_b_proj``.
    """
    from cache_backends.attention import install

    install(model)
    for layer in model.model.layers:
        attn = layer.self_attn
        if getattr(attn, "absorbs_latent", False):
            continue
        if not (hasattr(attn, "expand_kv") and hasattr(attn, "kv_b_proj")):
            raise ValueError(f"absorbed MLA needs DeepSeek-style attention (expand_kv, kv_b_proj); "
                             f"got {type(attn).__name__}")
        base = type(attn)

        class Absorbing(base):
            absorbs_latent = True

            def expand_kv(self, kv_nope, k_rot):
                if hasattr(kv_nope, "attend"):
                    return absorb_reads(kv_nope, self), None
                return base.expand_kv(self, kv_nope, k_rot)

        Absorbing.__name__ = f"Absorbing{base.__name__}"
        attn.__class__ = Absorbing
