"""``int8``: quantized K/V with a full-precision residual window.

Method (KIVI, Liu et al., arXiv 2402.02750; asymmetric 8-bit here): keys have outlier *channels*, so
keys are quantized per channel over a group of ``group_size`` consecutive tokens; values are quantized
per token (one scale and zero point per token and head, over its head_dim channels). The newest tokens
stay in full precision: once ``residual + group_size`` tokens are unquantized, the oldest
``group_size`` of them are quantized as one group, so between ``residual`` and
``residual + group_size - 1`` tokens are full precision. Quantized tokens are never re-quantized.

Storage per sequence and layer (H = num_key_value_heads, d = head_dim, Tq quantized tokens,
Tr residual tokens, n = Tq / group_size):

* keys (``Int8Layer.key_store``): ``q`` (1, H, Tq, d) int8, ``scale`` and ``minimum`` (1, H, n, d);
* values (``Int8Layer.value_store``): ``q`` (1, H, Tq, d) int8, ``scale`` and ``minimum`` (1, H, Tq, 1);
* each store's ``recent`` window (1, H, Tr, d) in the model dtype.

:class:`Int8Storage` quantizes any per-token stream this way; the compositions ``gqa+int8`` and
``mla+int8`` use it for the shared heads and for the latent.

Bytes per token per layer (asymptotically): ``2*H*d + 2*H*d*B/group_size + 2*H*B`` — about 0.31x of
``full`` in fp32 and 0.63x in fp16/bf16 at group size 32 (the closed formula with the residual window
is :func:`cache_backends.estimate.int8_bytes_per_token_per_layer`). Dequantized K/V exist only while
a layer attends; nothing full-precision but the residual window survives a step.
"""

from __future__ import annotations

import torch

from cache_backends.base import KVBackend, KVLayer, ModelGeometry, tensor_bytes
from cache_backends.estimate import int8_bytes_per_token_per_layer

QMIN, QMAX = -128, 127


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int8 quantization of ``x`` with one (scale, min) per slice along ``dim``.

    Returns:
        ``(q, scale, minimum)``: int8 codes shaped like ``x``; ``scale`` and ``minimum`` with ``dim``
        reduced to size 1, in ``x``'s dtype. ``x ≈ (q - QMIN) * scale + minimum``.
    """
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / (QMAX - QMIN)).clamp_min(torch.finfo(x.dtype).tiny)
    q = torch.round((x - lo) / scale) + QMIN
    return q.clamp_(QMIN, QMAX).to(torch.int8), scale, lo


def dequantize(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    return (q.to(scale.dtype) - QMIN) * scale + minimum


class Int8Storage:
    """A stream of per-token vectors, (batch, heads, seq_len, width), held as int8 plus a residual window.

    Args:
        axis: ``"channel"`` — one scale and minimum per channel over each group of ``group_size``
            tokens (KIVI's keys); ``"token"`` — one scale and minimum per token and head over its
            channels (KIVI's values).
        group_size: tokens quantized together (the residual drains in whole groups).
        residual: newest tokens always kept in full precision.
    """

    def __init__(self, axis: str, group_size: int, residual: int):
        self.axis = axis
        self.group_size = group_size
        self.residual = residual
        self.q = self.scale = self.minimum = self.recent = None
        self.length = 0

    def _init(self, x: torch.Tensor) -> None:
        b, h, _, w = x.shape
        self.q = torch.empty(b, h, 0, w, dtype=torch.int8, device=x.device)
        self.scale = torch.empty(b, h, 0, w if self.axis == "channel" else 1, dtype=x.dtype, device=x.device)
        self.minimum = torch.empty_like(self.scale)
        self.recent = x[..., :0, :]

    def append(self, x: torch.Tensor) -> None:
        """Add ``n`` tokens (batch, heads, n, width); quantize the oldest whole groups past the window."""
        if self.q is None:
            self._init(x)
        self.recent = torch.cat([self.recent, x], dim=-2)
        self.length += x.shape[-2]
        g = self.group_size
        n_groups = max(0, (self.recent.shape[-2] - self.residual) // g)
        if n_groups == 0:
            return
        n = n_groups * g
        old = self.recent[..., :n, :]
        b, h, _, w = old.shape
        if self.axis == "channel":
            q, scale, minimum = quantize(old.reshape(b, h, n_groups, g, w), dim=3)  # (b, h, groups, 1, w)
            q, scale, minimum = q.reshape(b, h, n, w), scale.squeeze(3), minimum.squeeze(3)
        else:
            q, scale, minimum = quantize(old, dim=-1)  # (b, h, n, 1)
        self.q = torch.cat([self.q, q], dim=-2)
        self.scale = torch.cat([self.scale, scale], dim=-2)
        self.minimum = torch.cat([self.minimum, minimum], dim=-2)
        self.recent = self.recent[..., n:, :].clone()

    def read(self) -> torch.Tensor:
        """Every token, dequantized, then the full-precision window: (batch, heads, seq_len, width)."""
        b, h, tq, w = self.q.shape
        if self.axis == "channel":
            g = self.group_size
            old = dequantize(self.q.reshape(b, h, tq // g, g, w), self.scale.unsqueeze(3),
                             self.minimum.unsqueeze(3)).reshape(b, h, tq, w)
        else:
            old = dequantize(self.q, self.scale, self.minimum)
        return torch.cat([old, self.recent], dim=-2)

    def nbytes(self) -> int:
        return tensor_bytes(self.q, self.scale, self.minimum, self.recent)


class Int8Layer(KVLayer):
    """One layer's KIVI cache: keys in a per-channel :class:`Int8Storage`, values in a per-token one."""

    def __init__(self, group_size: int, residual: int):
        super().__init__()
        self.group_size, self.residual = group_size, residual
        self.reset()

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new tokens; return all keys and values dequantized, (1, H, seq_len, head_dim)."""
        self.is_initialized = True
        self.key_store.append(key_states)
        self.value_store.append(value_states)
        return self.materialize()

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_store.read(), self.value_store.read()

    def get_seq_length(self) -> int:
        return self.key_store.length

    def reset(self) -> None:
        self.key_store = Int8Storage("channel", self.group_size, self.residual)
        self.value_store = Int8Storage("token", self.group_size, self.residual)
        self.is_initialized = False

    def nbytes(self) -> int:
        return self.key_store.nbytes() + self.value_store.nbytes()


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

    def bytes_per_token_per_layer(self, seq_len: int = 1024) -> float:
        g = self.geometry
        return int8_bytes_per_token_per_layer(g.num_key_value_heads, g.head_dim, g.dtype_bytes, self.group_size,
                                              self.residual, seq_len)
