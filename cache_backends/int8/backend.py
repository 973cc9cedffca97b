"""``int8`` and ``int4``: quantized K/V with a full-precision residual window, optionally rotated.

Method (KIVI, Liu et al., arXiv 2402.02750; asymmetric 8- or 4-bit here): keys have outlier *channels*, so
keys are quantized per channel over a group of ``group_size`` consecutive tokens; values are quantized
per token (one scale and zero point per token and head, over its head_dim channels). The newest tokens
stay in full precision: once ``residual + group_size`` tokens are unquantized, the oldest
``group_size`` of them are quantized as one group, so between ``residual`` and
``residual + group_size - 1`` tokens are full precision. Quantized tokens are never re-quantized.

Bits (``key_bits``, ``value_bits``: 8 or 4 each; ``int4`` is this backend with 4 and 4, ``int8`` with 8 and 8,
``int8:value_bits=4`` the keys-8/values-4 mix vLLM calls ``k8v4``). 8-bit codes are int8 in [-128, 127];
4-bit codes are unsigned nibbles in [0, 15], two per byte (:func:`cache_backends.quant.pack`: channel j in the low
nibble of byte j, channel j + d/2 in the high nibble), so a 4-bit stream's codes are (…, d/2) uint8: real bytes, no
wider copy. Either way ``value = code * scale + zero`` (the zero point absorbs the offset). A 4-bit stream keeps its scales
and zero points in a 2-byte float (:func:`scale_dtype`: the model dtype if it has 2 bytes, else float16, as
KIVI and llama.cpp's ``q4_0`` do): in fp32 they would cost as much as the 4-bit codes themselves at group
size 32 and head_dim 32 (0.25 bytes per value each). 8-bit streams keep the model dtype, as before.

Rotation (``rotate``; QuaRot, Ashkboos et al., arXiv 2404.00456): before quantizing, each token's vector of
d channels is multiplied by an orthonormal Hadamard matrix R (:func:`hadamard`; block-diagonal with blocks
of the largest power of two dividing d), which spreads outlier channels over all channels so a 4-bit grid
loses less. R is symmetric and orthogonal (R = R^T = R^-1), and it is folded where it can be instead of
un-rotating the cache: scores ``q · k = (q R) · (k R)``, so the query is rotated once per step and scored
against the rotated key codes; a weighted sum of rotated values is ``(Σ p v) R``, so it is un-rotated once per
output row. Only quantized tokens are rotated; the full-precision window is kept as it came.

Storage per sequence and layer (H = num_key_value_heads, d = head_dim, Tq quantized tokens,
Tr residual tokens, n = Tq / group_size, d_c = d at 8 bits and d / 2 at 4 bits):

* keys (``Int8Layer.key_store``): ``codes`` (1, H, Tq, d_c) int8/uint8, ``scale`` and ``zero`` (1, H, n, d);
* values (``Int8Layer.value_store``): ``codes`` (1, H, Tq, d_c), ``scale`` and ``zero`` (1, H, Tq, 1);
* each store's ``recent`` window (1, H, Tr, d) in the model dtype.

:class:`Int8Storage` quantizes any per-token stream this way; the compositions ``gqa+int8`` and
``mla+int8`` use it for the shared heads and for the latent.

Bytes per token per layer (asymptotically, 8 bits): ``2*H*d + 2*H*d*B/group_size + 2*H*B`` — about 0.31x of
``full`` in fp32 and 0.56x in fp16/bf16 at group size 32 (0.33x and 0.58x at 1024 tokens with the
residual window: :meth:`cache_backends.kv_spec.KVSpec.bytes_at`); 4-bit codes halve the
``2*H*d`` term. Decode attends to the codes
directly (scales folded into the query and the attention weights, :meth:`Int8Storage.dot` and
:meth:`Int8Storage.weighted_sum`); nothing full-precision but the residual window survives a step.

Each width's format is one row of :data:`cache_backends.quant_formats.FORMATS`. The kernels (:func:`pack`,
:func:`scale_dtype`, :func:`hadamard`, the products on the codes) are
:mod:`cache_backends.quant`'s, a leaf the paged reads share.
"""

from __future__ import annotations

import torch

from cache_backends.attention import grouped_query, ungroup
from cache_backends.base import KVBackend
from cache_backends.geometry import ModelGeometry
from cache_backends.kv_store import FullStorage, StreamPairLayer
from cache_backends.buffer import TokenBuffer
from cache_backends.kv_spec import KVSpec, Quantization, kv_streams, scale_bytes
from cache_backends.paged_attention import attend_pair
from cache_backends.quant import codes_dot, codes_weighted_sum, dequantize_codes, pack, quantize, rotate
from cache_backends.quant_formats import BITS, bits_choices, code_format, width_refusal

class Int8Storage:
    """A stream of per-token vectors, (batch, heads, seq_len, width), held as 8- or 4-bit codes plus a residual
    window.

    Every part lives in an in-place :class:`cache_backends.buffer.TokenBuffer`: codes (int8, or uint8 with two
    4-bit codes a byte), scales and zero points (model dtype), the full-precision window. Attention reads it
    without dequantizing the whole cache: :meth:`dot` folds the scales and zero points (and the rotation) into
    the query, :meth:`weighted_sum` folds them into the attention weights (and un-rotates the output); only the
    codes are widened to the query's dtype (into a transient the size of the codes) for the matrix product.

    Args:
        axis: ``"channel"`` — one scale and zero per channel over each group of ``group_size``
            tokens (KIVI's keys); ``"token"`` — one scale and zero per token and head over its
            channels (KIVI's values).
        group_size: tokens quantized together (the residual drains in whole groups).
        residual: newest tokens always kept in full precision.
        bits: 8 or 4 (4: the width must be even).
        rotate: quantize ``x R`` (:func:`cache_backends.quant.hadamard`) instead of ``x``.
    """

    def __init__(self, axis: str, group_size: int, residual: int, bits: int = 8, rotate: bool = False):
        self.axis = axis
        self.group_size = group_size
        self.residual = residual
        self.bits, self.rotate = bits, rotate
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
                       dtype_bytes: int, bits: int = 8) -> int:
        """The most bytes a storage reserved for ``max_tokens`` can allocate (codes, scales, zeros, window)."""
        codes = code_format(bits).code_bytes(max_tokens * heads * width)
        sb = scale_bytes(bits, dtype_bytes)
        if axis == "channel":
            scales = 2 * max(1, max_tokens // group_size) * heads * width * sb
        else:
            scales = 2 * max_tokens * heads * sb
        window = max(1, residual + group_size - 1) * heads * width * dtype_bytes
        return codes + scales + window

    def append(self, x: torch.Tensor) -> None:
        """Add ``n`` tokens (batch, heads, n, width); quantize the oldest whole groups past the window."""
        g = self.group_size
        self.dtype = x.dtype  # the model dtype (4-bit scales may be narrower)
        pending = self.recent.length + x.shape[-2]
        n_groups = max(0, (pending - self.residual) // g)
        if n_groups == 0:
            self.recent.append(x)
            return
        src = torch.cat([self.recent.view(), x], dim=-2) if self.recent.length else x  # O(residual + n)
        n = n_groups * g
        old = rotate(src[..., :n, :]) if self.rotate else src[..., :n, :]
        b, h, _, w = old.shape
        if self.axis == "channel":
            q, scale, zero = quantize(old.reshape(b, h, n_groups, g, w), 3, self.bits)  # (b, h, groups, 1, w)
            q, scale, zero = q.reshape(b, h, n, w), scale.squeeze(3), zero.squeeze(3)
        else:
            q, scale, zero = quantize(old, -1, self.bits)  # (b, h, n, 1)
        self.codes.append(pack(q, self.bits))  # (b, h, n, w) int8 or (b, h, n, w / 2) uint8
        self.scale.append(scale)
        self.zero.append(zero)
        rest = src[..., n:, :].clone()  # may alias the window's own buffer
        self.recent.truncate(0)
        if rest.shape[-2]:
            self.recent.append(rest)

    def read(self) -> torch.Tensor:
        """Every token, dequantized (and un-rotated), then the full-precision window: (batch, heads, seq_len, width)."""
        recent = self.recent.view() if self.recent.data is not None else None
        if self.codes.length == 0:
            return recent
        old = dequantize_codes(self.codes.view(), self.scale.view(), self.zero.view(), self.axis, self.group_size,
                               self.bits, self.dtype)
        old = rotate(old) if self.rotate else old
        return old if recent is None else torch.cat([old, recent], dim=-2)

    def dot(self, query: torch.Tensor) -> torch.Tensor:
        """Scores of every token against ``query`` (batch, heads, R, width) → (batch, heads, R, seq_len)
        (:func:`codes_dot` on the codes, the query rotated once if the codes are, then the window)."""
        parts = []
        if self.codes.length:
            parts.append(codes_dot(rotate(query) if self.rotate else query, self.codes.view(), self.scale.view(),
                                   self.zero.view(), self.axis, self.group_size, self.bits))
        if self.recent.length:
            parts.append(query @ self.recent.view().transpose(-1, -2))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """``weights`` (batch, heads, R, seq_len) times every token → (batch, heads, R, width)
        (:func:`codes_weighted_sum` on the codes, un-rotated once if the codes are rotated, plus the window)."""
        tq = self.codes.length
        out = None
        if tq:
            out = codes_weighted_sum(weights[..., :tq], self.codes.view(), self.scale.view(), self.zero.view(),
                                     self.axis, self.group_size, self.bits)
            out = rotate(out) if self.rotate else out
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


def quant_spec(quantization: Quantization) -> tuple[str, dict]:
    """The quantized part of a spec, as the sums and ``/info`` name it: ``int4`` when keys and values are both
    4-bit, else ``int8``; its options are group_size and residual, the bits where they differ from that name's
    (``int8:value_bits=4`` is k8v4), and ``rotate`` when on."""
    kb, vb = quantization.key_bits, quantization.value_bits
    name = "int4" if kb == vb == 4 else "int8"
    default = 4 if name == "int4" else 8
    options = {"group_size": quantization.group_size, "residual": quantization.residual}
    options.update({k: b for k, b in (("key_bits", kb), ("value_bits", vb)) if b != default})
    if quantization.rotate:
        options["rotate"] = True
    return name, options


def make_storage(axis: str, quantization: Quantization | None):
    """An exact :class:`FullStorage`, or an :class:`Int8Storage` with ``quantization``'s options.

    Args:
        axis: ``"channel"`` (key-like streams) or ``"token"`` (value-like streams).
        quantization: ``None``, or the tier (:class:`cache_backends.kv_spec.Quantization`, with a residual window).
    """
    if quantization is None:
        return FullStorage()
    return Int8Storage(axis, quantization.group_size, quantization.residual, quantization.bits(axis),
                       quantization.rotate)


def storage_reserved_bytes(quantization: Quantization | None, axis: str, max_tokens: int, heads: int, width: int,
                           dtype_bytes: int) -> int:
    """The most bytes :func:`make_storage` ``(axis, quantization)`` reserved for ``max_tokens`` can allocate."""
    if quantization is None:
        return FullStorage.reserved_bytes(max_tokens, heads, width, dtype_bytes)
    return Int8Storage.reserved_bytes(axis, quantization.group_size, quantization.residual, max_tokens, heads, width,
                                      dtype_bytes, quantization.bits(axis))


def attend_stored(query: torch.Tensor, key_store, value_store, scaling: float) -> torch.Tensor:
    """One decode query's attention over a key storage and a value storage, read in their stored form.

    Args:
        query: (1, Hq, 1, d) with Hq a multiple of the stores' heads H.
        key_store, value_store: :class:`Int8Storage` or :class:`cache_backends.kv_store.FullStorage`,
            (1, H, T, d) each.

    Returns:
        (1, Hq, 1, dv).
    """
    q = grouped_query(query, key_store.heads)  # (1, H, rep, d)
    probs = torch.softmax(key_store.dot(q) * scaling, dim=-1)  # (1, H, rep, T)
    return ungroup(value_store.weighted_sum(probs))


class Int8Layer(StreamPairLayer):
    """One layer's KIVI cache: keys in a per-channel :class:`Int8Storage`, values in a per-token one.

    Args:
        quantization: the tier of :func:`make_storage`.
    """

    def __init__(self, quantization: Quantization):
        super().__init__()
        self.key_store = make_storage("channel", quantization)
        self.value_store = make_storage("token", quantization)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.key_store.append(key_states)
        self.value_store.append(value_states)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_store.read(), self.value_store.read()

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Decode: scores from the key codes with scales folded into the query, output from the value
        codes with scales folded into the weights (no dequantized cache). Prefill: rebuilt K/V."""
        if query.shape[-2] > 1:
            return super().attend(query, scaling)
        return attend_stored(query, self.key_store, self.value_store, scaling)


def check_quantize(prefix: str, group_size: int, residual: int, key_bits: int, value_bits: int,
                   widths: tuple[int, ...] = ()) -> None:
    """Refuse quantization options no storage can take, naming the setting (``prefix`` is ``KV_INT8`` or
    ``KV_INT4``).

    Raises:
        ValueError: for ``group_size`` < 1, ``residual`` < 0, bits other than 4 or 8, or 4-bit codes of an
            odd stream width in ``widths`` (two channels a byte).
    """
    if group_size < 1:
        raise ValueError(f"{prefix}_GROUP_SIZE={group_size} must be >= 1")
    if residual < 0:
        raise ValueError(f"{prefix}_RESIDUAL={residual} must be >= 0")
    for var, bits in (("KEY_BITS", key_bits), ("VALUE_BITS", value_bits)):
        if bits not in BITS:
            raise ValueError(f"{prefix}_{var}={bits} must be {bits_choices()}")
    for width in widths:
        why = width_refusal(width, f"a stream width of {width}", key_bits, value_bits)
        if why:
            raise ValueError(why)


class Int8Backend(KVBackend):
    """KIVI-style quantized KV cache (8-bit by default; ``int4`` and the k8v4 mix by its bits).

    Args:
        geometry: the model's attention shape.
        group_size: tokens per key quantization group (``KV_INT8_GROUP_SIZE``, default 32).
        residual: tokens always kept in full precision (``KV_INT8_RESIDUAL``, default 32).
        key_bits, value_bits: code widths, 8 or 4 (``KV_INT8_KEY_BITS``, ``KV_INT8_VALUE_BITS``, default 8).
        rotate: Hadamard-rotate keys and values before quantizing (``KV_INT8_ROTATE``, default false).

    Raises:
        ValueError: if ``group_size`` < 1, ``residual`` < 0, or a bit width is not 4 or 8.
    """

    name = "int8"
    attends_in_place = True
    BITS_DEFAULT = 8
    windowed_pool = True  # on a hybrid model its sliding layers' pages keep only their windows (whole code pages)

    def __init__(self, geometry: ModelGeometry, group_size: int = 32, residual: int = 32, key_bits: int | None = None,
                 value_bits: int | None = None, rotate: bool = False):
        key_bits = self.BITS_DEFAULT if key_bits is None else key_bits
        value_bits = self.BITS_DEFAULT if value_bits is None else value_bits
        check_quantize(f"KV_{self.name.upper()}", group_size, residual, key_bits, value_bits, (geometry.head_dim,))
        extra = {k: b for k, b in (("key_bits", key_bits), ("value_bits", value_bits)) if b != self.BITS_DEFAULT}
        super().__init__(geometry, group_size=group_size, residual=residual, **extra,
                         **({"rotate": True} if rotate else {}))
        self.group_size, self.residual = group_size, residual
        self.quantization = Quantization(group_size, residual, key_bits, value_bits, bool(rotate))

    def new_layer(self, index: int, position_offset: int = 0) -> Int8Layer:
        return Int8Layer(self.quantization)

    def sums_spec(self) -> tuple[str, dict]:
        name, options = quant_spec(self.quantization)
        options.pop("rotate", None)  # a per-model constant: no byte per token
        return name, options

    def reserved_bytes(self, max_tokens: int) -> int:
        g = self.geometry
        per_layer = sum(storage_reserved_bytes(self.quantization, axis, max_tokens, g.num_key_value_heads, g.head_dim,
                                               g.dtype_bytes) for axis in ("channel", "token"))
        return per_layer * g.num_layers

    def kv_spec(self) -> KVSpec:
        """A block holds keys (grouped per channel) and values (per token), (num_key_value_heads, head_dim) each
        per token: quantized, the residual window exact."""
        g = self.geometry
        return self._kv_spec(kv_streams(g.num_key_value_heads, g.head_dim), self.quantization)

    def attend_paged(self, layer, query, reads, meta, scaling, module=None):
        """Scores on the key codes (scales and rotation folded into the query), output from the value codes
        (scales folded into the weights, rotation undone once per output), the residual window exact: no
        dequantized copy of the context."""
        return attend_pair(query, reads[0], reads[1], meta, scaling)


class Int4Backend(Int8Backend):
    """``int4``: the same storage with 4-bit keys and values (two codes a byte), optionally rotated
    (``int4:rotate=true``; QuaRot, arXiv 2404.00456). Settings ``KV_INT4_GROUP_SIZE``, ``KV_INT4_RESIDUAL``,
    ``KV_INT4_KEY_BITS``, ``KV_INT4_VALUE_BITS`` (default 4) and ``KV_INT4_ROTATE``."""

    name = "int4"
    BITS_DEFAULT = 4
