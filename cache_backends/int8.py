"""``int8``: quantized K/V with a full-precision residual window.

Method (KIVI, Liu et al., arXiv 2402.02750; asymmetric 8-bit here): keys have outlier *channels*, so
keys are quantized per channel over a group of ``group_size`` consecutive tokens; values are quantized
per token (one scale and zero point per token and head, over its head_dim channels). The newest tokens
stay in full precision: once ``residual + group_size`` tokens are unquantized, the oldest
``group_size`` of them are quantized as one group, so between ``residual`` and
``residual + group_size - 1`` tokens are full precision. Quantized tokens are never re-quantized.

Storage per sequence and layer (H = num_key_value_heads, d = head_dim, Tq quantized tokens,
Tr residual tokens, n = Tq / group_size):

* ``key_q``   (1, H, Tq, d) int8, ``key_scale`` and ``key_min`` (1, H, n, d) model dtype;
* ``value_q`` (1, H, Tq, d) int8, ``value_scale`` and ``value_min`` (1, H, Tq, 1) model dtype;
* ``key_res``, ``value_res`` (1, H, Tr, d) model dtype.

Bytes per token per layer (asymptotically): ``2*H*d + 2*H*d*B/group_size + 2*H*B`` — about 0.31x of
``full`` in fp32 and 0.63x in fp16/bf16 at group size 32 (the closed formula with the residual window
is :func:`cache_backends.estimate.int8_bytes_per_token_per_layer`). Dequantized K/V exist only while
a layer attends; nothing full-precision but the residual window survives a step.
"""

from __future__ import annotations

import torch

from cache_backends.base import KVBackend, KVLayer, KVStore, ModelGeometry, tensor_bytes
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


class Int8Layer(KVLayer):
    """One layer's int8 K/V plus the full-precision residual window (shapes in the module docstring)."""

    def __init__(self, group_size: int, residual: int):
        super().__init__()
        self.group_size = group_size
        self.residual = residual
        self.length = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        b, h, _, d = key_states.shape
        dt, dev = key_states.dtype, key_states.device
        self.key_q = torch.empty(b, h, 0, d, dtype=torch.int8, device=dev)
        self.key_scale = torch.empty(b, h, 0, d, dtype=dt, device=dev)
        self.key_min = torch.empty(b, h, 0, d, dtype=dt, device=dev)
        self.value_q = torch.empty(b, h, 0, value_states.shape[-1], dtype=torch.int8, device=dev)
        self.value_scale = torch.empty(b, h, 0, 1, dtype=dt, device=dev)
        self.value_min = torch.empty(b, h, 0, 1, dtype=dt, device=dev)
        self.key_res = key_states[..., :0, :]
        self.value_res = value_states[..., :0, :]
        self.is_initialized = True

    def _quantize_full_groups(self) -> None:
        """Move whole groups of the oldest residual tokens into int8 storage."""
        g = self.group_size
        n_groups = max(0, (self.key_res.shape[-2] - self.residual) // g)
        if n_groups == 0:
            return
        n = n_groups * g
        k, v = self.key_res[..., :n, :], self.value_res[..., :n, :]
        b, h, _, d = k.shape
        # keys: per channel over each group of g tokens
        kq, ks, km = quantize(k.reshape(b, h, n_groups, g, d), dim=3)  # scale/min: (b, h, n_groups, 1, d)
        self.key_q = torch.cat([self.key_q, kq.reshape(b, h, n, d)], dim=-2)
        self.key_scale = torch.cat([self.key_scale, ks.squeeze(3)], dim=-2)
        self.key_min = torch.cat([self.key_min, km.squeeze(3)], dim=-2)
        # values: per token (and head) over its channels
        vq, vs, vm = quantize(v, dim=-1)  # scale/min: (b, h, n, 1)
        self.value_q = torch.cat([self.value_q, vq], dim=-2)
        self.value_scale = torch.cat([self.value_scale, vs], dim=-2)
        self.value_min = torch.cat([self.value_min, vm], dim=-2)
        self.key_res = self.key_res[..., n:, :].clone()
        self.value_res = self.value_res[..., n:, :].clone()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new tokens; return all keys and values dequantized, (1, H, seq_len, head_dim)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.key_res = torch.cat([self.key_res, key_states], dim=-2)
        self.value_res = torch.cat([self.value_res, value_states], dim=-2)
        self.length += key_states.shape[-2]
        self._quantize_full_groups()
        b, h, tq, d = self.key_q.shape
        g = self.group_size
        keys = dequantize(self.key_q.reshape(b, h, tq // g, g, d), self.key_scale.unsqueeze(3),
                          self.key_min.unsqueeze(3)).reshape(b, h, tq, d)
        values = dequantize(self.value_q, self.value_scale, self.value_min)
        return torch.cat([keys, self.key_res], dim=-2), torch.cat([values, self.value_res], dim=-2)

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        for name in ("key_q", "key_scale", "key_min", "value_q", "value_scale", "value_min", "key_res", "value_res"):
            setattr(self, name, None)
        self.is_initialized = False
        self.length = 0

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return tensor_bytes(self.key_q, self.key_scale, self.key_min, self.value_q, self.value_scale,
                            self.value_min, self.key_res, self.value_res)


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

    def new_store(self) -> KVStore:
        return KVStore([Int8Layer(self.group_size, self.residual) for _ in range(self.geometry.num_layers)])

    def bytes_per_token_per_layer(self, seq_len: int = 1024) -> float:
        g = self.geometry
        return int8_bytes_per_token_per_layer(g.num_key_value_heads, g.head_dim, g.dtype_bytes, self.group_size,
                                              self.residual, seq_len)
