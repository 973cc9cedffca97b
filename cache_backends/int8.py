"""``int8``: quantized K/V with a full-precision residual window.

Method (KIVI, Liu et al., arXiv 2402.02750; asymmetric 8-bit here): keys have outlier *channels*, so
keys are quantized per channel over a group of ``group_size`` consecutive tokens; values are quantized
per token (one scale and zero point per token and head, over its head_dim channels). The newest tokens
stay in full precision: once ``residual + group_size`` tokens are unquantized, the oldest
``group_size`` of them are quantized as one group, so between ``residual`` and
``residual + group_size - 1`` tokens are full precision. Quantized tokens are never re-quantized.

Storage per sequence and layer (H = num_key_value_heads, d = head_dim, Tq quantized tokens,
Tr residual tokens, n = Tq / group_size):

* keys (``Int8Layer.key_store``): ``codes`` (1, H, Tq, d) int8, ``scale`` and ``zero`` (1, H, n, d);
* values (``Int8Layer.value_store``): ``codes`` (1, H, Tq, d) int8, ``scale`` and ``zero`` (1, H, Tq, 1);
* each store's ``recent`` window (1, H, Tr, d) in the model dtype.

:class:`Int8Storage` quantizes any per-token stream this way; the compositions ``gqa+int8`` and
``mla+int8`` use it for the shared heads and for the latent.

Bytes per token per layer (asymptotically): ``2*H*d + 2*H*d*B/group_size + 2*H*B`` — about 0.31x of
``full`` in fp32 and 0.56x in fp16/bf16 at group size 32 (0.33x and 0.58x at 1024 tokens with the
residual window: :func:`cache_backends.estimate.int8_bytes_per_token_per_layer`). Decode attends to the codes
directly (scales folded into the query and the attention weights, :meth:`Int8Storage.dot` and
:meth:`Int8Storage.weighted_sum`); nothing full-precision but the residual window survives a step.
"""

from __future__ import annotations

import torch

from cache_backends.attention import grouped_query, ungroup
from cache_backends.base import FullStorage, KVBackend, ModelGeometry, StreamPairLayer
from cache_backends.buffer import TokenBuffer

QMIN, QMAX = -128, 127


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int8 quantization of ``x`` with one (scale, zero) per slice along ``dim``.

    The arithmetic runs in fp32 whatever ``x``'s dtype (bf16 has 8 bits of mantissa: scales computed
    in it would cost the codes about one bit); ``scale`` and ``zero`` are returned in ``x``'s dtype.

    Returns:
        ``(q, scale, zero)``: int8 codes shaped like ``x``; ``scale`` and ``zero`` with ``dim`` reduced to
        size 1. ``x ≈ q * scale + zero`` (``zero`` = the slice minimum + 128 * scale, so a code times
        the scale plus the zero point is the value: no offset to subtract when attending).
    """
    xf = x.float()
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / (QMAX - QMIN)).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((xf - lo) / scale) + QMIN
    return q.clamp_(QMIN, QMAX).to(torch.int8), scale.to(x.dtype), (lo - QMIN * scale).to(x.dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return q.to(scale.dtype) * scale + zero


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, axis: str,
                     group_size: int) -> torch.Tensor:
    """Int8 codes (batch, heads, T, width) with their scales → values (batch, heads, T, width).

    ``scale``/``zero``: (batch, heads, T / group_size, width) on the channel axis, (batch, heads, T, 1) on
    the token axis.
    """
    if axis != "channel":
        return dequantize(codes, scale, zero)
    b, h, t, w = codes.shape
    g = group_size
    return dequantize(codes.reshape(b, h, t // g, g, w), scale.unsqueeze(3), zero.unsqueeze(3)).reshape(b, h, t, w)


def codes_dot(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, axis: str,
              group_size: int) -> torch.Tensor:
    """Scores of int8 tokens against ``query`` (batch, heads, R, width) → (batch, heads, R, T), on the codes.

    Channel axis: ``q · (c * s_g + z_g) = (q * s_g) · c + q · z_g`` per token group g;
    token axis: ``q · (c_t * s_t + z_t) = s_t (q · c_t) + z_t Σ q``. Only the codes are widened to the
    query's dtype (a transient the size of the codes); nothing is dequantized.

    Args:
        codes: (batch, heads, T, width) int8; ``scale``, ``zero`` as in :func:`dequantize_codes`.
    """
    codes = codes.to(query.dtype)
    b, h, tq, w = codes.shape
    if axis == "channel":
        g, n = group_size, tq // group_size
        folded = query.unsqueeze(2) * scale.unsqueeze(3)  # (b, h, n, R, w)
        scores = folded @ codes.reshape(b, h, n, g, w).transpose(-1, -2)  # (b, h, n, R, g)
        bias = (query @ zero.transpose(-1, -2)).unsqueeze(-1)  # (b, h, R, n, 1)
        return (scores.permute(0, 1, 3, 2, 4) + bias).reshape(b, h, -1, tq)  # (b, h, R, n * g)
    scores = (query @ codes.transpose(-1, -2)) * scale.transpose(-1, -2)  # (b, h, R, tq)
    return scores + query.sum(-1, keepdim=True) * zero.transpose(-1, -2)


def codes_weighted_sum(weights: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                       axis: str, group_size: int) -> torch.Tensor:
    """``weights`` (batch, heads, R, T) times int8 tokens → (batch, heads, R, width), on the codes.

    Token axis: ``Σ_t p_t (c_t s_t + z_t) = (p * s) · c + p · z``; channel axis: per group,
    ``(p_g · c_g) * s_g + (Σ p_g) z_g``.
    """
    codes = codes.to(weights.dtype)
    if axis == "token":
        return (weights * scale.transpose(-1, -2)) @ codes + weights @ zero
    b, h, r, tq = weights.shape
    g, n, w = group_size, tq // group_size, codes.shape[-1]
    pg = weights.reshape(b, h, r, n, g).transpose(2, 3)  # (b, h, n, R, g)
    per_group = pg @ codes.reshape(b, h, n, g, w)  # (b, h, n, R, w)
    return (per_group * scale.unsqueeze(3)).sum(2) + pg.sum(-1).transpose(2, 3) @ zero


class Int8Storage:
    """A stream of per-token vectors, (batch, heads, seq_len, width), held as int8 plus a residual window.

    Every part lives in an in-place :class:`cache_backends.buffer.TokenBuffer`: codes (int8), scales and
    zero points (model dtype), the full-precision window. Attention reads it without dequantizing the
    whole cache: :meth:`dot` folds the scales and zero points into the query, :meth:`weighted_sum`
    folds them into the attention weights; only the int8 codes are widened to the query's dtype (into
    a transient the size of the codes) for the matrix product.

    Args:
        axis: ``"channel"`` — one scale and zero per channel over each group of ``group_size``
            tokens (KIVI's keys); ``"token"`` — one scale and zero per token and head over its
            channels (KIVI's values).
        group_size: tokens quantized together (the residual drains in whole groups).
        residual: newest tokens always kept in full precision.
    """

    def __init__(self, axis: str, group_size: int, residual: int):
        self.axis = axis
        self.group_size = group_size
        self.residual = residual
        self.codes = TokenBuffer()
        self.scale = TokenBuffer()
        self.zero = TokenBuffer()
        self.recent = TokenBuffer(max_tokens=max(1, residual + group_size - 1))

    @property
    def length(self) -> int:
        return self.codes.length + self.recent.length

    @property
    def heads(self) -> int:
        """Heads of the stream (the second dimension)."""
        return (self.codes.data if self.codes.data is not None else self.recent.data).shape[1]

    def reserve(self, max_tokens: int) -> None:
        """Cap the capacities for a request of ``max_tokens`` tokens (before the first append)."""
        self.codes.max_tokens = max_tokens
        groups = max(1, max_tokens // self.group_size)
        self.scale.max_tokens = self.zero.max_tokens = groups if self.axis == "channel" else max_tokens

    @staticmethod
    def reserved_bytes(axis: str, group_size: int, residual: int, max_tokens: int, heads: int, width: int,
                       dtype_bytes: int) -> int:
        """The most bytes a storage reserved for ``max_tokens`` can allocate (codes, scales, zeros, window)."""
        codes = max_tokens * heads * width
        if axis == "channel":
            scales = 2 * max(1, max_tokens // group_size) * heads * width * dtype_bytes
        else:
            scales = 2 * max_tokens * heads * dtype_bytes
        window = max(1, residual + group_size - 1) * heads * width * dtype_bytes
        return codes + scales + window

    def append(self, x: torch.Tensor) -> None:
        """Add ``n`` tokens (batch, heads, n, width); quantize the oldest whole groups past the window."""
        g = self.group_size
        pending = self.recent.length + x.shape[-2]
        n_groups = max(0, (pending - self.residual) // g)
        if n_groups == 0:
            self.recent.append(x)
            return
        src = torch.cat([self.recent.view(), x], dim=-2) if self.recent.length else x  # O(residual + n)
        n = n_groups * g
        old = src[..., :n, :]
        b, h, _, w = old.shape
        if self.axis == "channel":
            q, scale, zero = quantize(old.reshape(b, h, n_groups, g, w), dim=3)  # (b, h, groups, 1, w)
            q, scale, zero = q.reshape(b, h, n, w), scale.squeeze(3), zero.squeeze(3)
        else:
            q, scale, zero = quantize(old, dim=-1)  # (b, h, n, 1)
        self.codes.append(q)
        self.scale.append(scale)
        self.zero.append(zero)
        rest = src[..., n:, :].clone()  # may alias the window's own buffer
        self.recent.truncate(0)
        if rest.shape[-2]:
            self.recent.append(rest)

    def read(self) -> torch.Tensor:
        """Every token, dequantized, then the full-precision window: (batch, heads, seq_len, width)."""
        recent = self.recent.view() if self.recent.data is not None else None
        if self.codes.length == 0:
            return recent
        old = dequantize_codes(self.codes.view(), self.scale.view(), self.zero.view(), self.axis, self.group_size)
        return old if recent is None else torch.cat([old, recent], dim=-2)

    def dot(self, query: torch.Tensor) -> torch.Tensor:
        """Scores of every token against ``query`` (batch, heads, R, width) → (batch, heads, R, seq_len)
        (:func:`codes_dot` on the codes, then the window)."""
        parts = []
        if self.codes.length:
            parts.append(codes_dot(query, self.codes.view(), self.scale.view(), self.zero.view(), self.axis,
                                   self.group_size))
        if self.recent.length:
            parts.append(query @ self.recent.view().transpose(-1, -2))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """``weights`` (batch, heads, R, seq_len) times every token → (batch, heads, R, width)
        (:func:`codes_weighted_sum` on the codes, plus the window)."""
        tq = self.codes.length
        out = None
        if tq:
            out = codes_weighted_sum(weights[..., :tq], self.codes.view(), self.scale.view(), self.zero.view(),
                                     self.axis, self.group_size)
        if self.recent.length:
            window = weights[..., tq:] @ self.recent.view()
            out = window if out is None else out + window
        return out

    def nbytes(self) -> int:
        return sum(buf.used_bytes() for buf in (self.codes, self.scale, self.zero, self.recent))

    def allocated_bytes(self) -> int:
        return sum(buf.allocated_bytes() for buf in (self.codes, self.scale, self.zero, self.recent))

    def release(self) -> None:
        for buf in (self.codes, self.scale, self.zero, self.recent):
            buf.release()


def make_storage(axis: str, quantize: dict | None):
    """An exact :class:`FullStorage`, or an :class:`Int8Storage` when ``quantize`` gives group_size and residual.

    Args:
        axis: ``"channel"`` (key-like streams) or ``"token"`` (value-like streams), for int8.
        quantize: ``None``, or ``{"group_size": int, "residual": int}``.
    """
    if quantize is None:
        return FullStorage()
    return Int8Storage(axis, quantize["group_size"], quantize["residual"])


def storage_reserved_bytes(quantize: dict | None, axis: str, max_tokens: int, heads: int, width: int,
                           dtype_bytes: int) -> int:
    """The most bytes :func:`make_storage` ``(axis, quantize)`` reserved for ``max_tokens`` can allocate."""
    if quantize is None:
        return FullStorage.reserved_bytes(max_tokens, heads, width, dtype_bytes)
    return Int8Storage.reserved_bytes(axis, quantize["group_size"], quantize["residual"], max_tokens, heads, width,
                                      dtype_bytes)


def attend_stored(query: torch.Tensor, key_store, value_store, scaling: float) -> torch.Tensor:
    """One decode query's attention over a key storage and a value storage, read in their stored form.

    Args:
        query: (1, Hq, 1, d) with Hq a multiple of the stores' heads H.
        key_store, value_store: :class:`Int8Storage` or :class:`cache_backends.base.FullStorage`,
            (1, H, T, d) each.

    Returns:
        (1, Hq, 1, dv).
    """
    q = grouped_query(query, key_store.heads)  # (1, H, rep, d)
    probs = torch.softmax(key_store.dot(q) * scaling, dim=-1)  # (1, H, rep, T)
    return ungroup(value_store.weighted_sum(probs))


class Int8Layer(StreamPairLayer):
    """One layer's KIVI cache: keys in a per-channel :class:`Int8Storage`, values in a per-token one."""

    def __init__(self, group_size: int, residual: int):
        super().__init__()
        self.group_size, self.residual = group_size, residual
        self.key_store = Int8Storage("channel", group_size, residual)
        self.value_store = Int8Storage("token", group_size, residual)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.key_store.append(key_states)
        self.value_store.append(value_states)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_store.read(), self.value_store.read()

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Decode: scores from the int8 keys with scales folded into the query, output from the int8
        values with scales folded into the weights (no dequantized cache). Prefill: rebuilt K/V."""
        if query.shape[-2] > 1:
            return super().attend(query, scaling)
        return attend_stored(query, self.key_store, self.value_store, scaling)



class Int8Backend(KVBackend):
    """KIVI-style int8 KV cache.

    Args:
        geometry: the model's attention shape.
        group_size: tokens per key quantization group (``KV_INT8_GROUP_SIZE``, default 32).
        residual: tokens always kept in full precision (``KV_INT8_RESIDUAL``, default 32).

    Raises:
        ValueError: if ``group_size`` < 1 or ``residual`` < 0.
    """

    name = "int8"

    def __init__(self, geometry: ModelGeometry, group_size: int = 32, residual: int = 32):
        if group_size < 1:
            raise ValueError(f"KV_INT8_GROUP_SIZE={group_size} must be >= 1")
        if residual < 0:
            raise ValueError(f"KV_INT8_RESIDUAL={residual} must be >= 0")
        super().__init__(geometry, group_size=group_size, residual=residual)
        self.group_size, self.residual = group_size, residual

    def new_layer(self, index: int, position_offset: int = 0) -> Int8Layer:
        return Int8Layer(self.group_size, self.residual)

    def sums_spec(self) -> tuple[str, dict]:
        return "int8", {"group_size": self.group_size, "residual": self.residual}

    def reserved_bytes(self, max_tokens: int) -> int:
        g = self.geometry
        per_layer = sum(Int8Storage.reserved_bytes(axis, self.group_size, self.residual, max_tokens,
                                                   g.num_key_value_heads, g.head_dim, g.dtype_bytes)
                        for axis in ("channel", "token"))
        return per_layer * g.num_layers

    def paged_streams(self) -> list:
        """Keys (grouped per channel) and values (per token), (num_key_value_heads, head_dim) each per token."""
        from cache_backends.paged import StreamSpec

        g = self.geometry
        return [StreamSpec(g.num_key_value_heads, g.head_dim, "channel"),
                StreamSpec(g.num_key_value_heads, g.head_dim, "token")]

    def paged_quantize(self) -> dict:
        return {"group_size": self.group_size, "residual": self.residual}

    def attend_paged(self, layer, query, reads, meta, scaling, module=None):
        """Scores on the int8 key codes (scales folded into the query), output from the int8 value codes
        (scales folded into the weights), the residual window exact: no dequantized copy of the context."""
        from cache_backends.paged import attend_pair

        return attend_pair(query, reads[0], reads[1], meta, scaling)
