"""Quantization kernels of the int8/int4 tiers: codes, scales and zero points, 4-bit packing, the Hadamard
rotation, and attention products on the codes. A leaf: it imports torch and no backend, so the backends
(:mod:`cache_backends.int8`, ``gqa``, ``mla``) and the paged reads (:mod:`cache_backends.paged`) share it.

Codes, as their format's row says (:data:`cache_backends.quant_formats.FORMATS`): 8-bit codes are int8 in
[-128, 127]; 4-bit codes are unsigned nibbles in [0, 15], two per byte (:func:`pack`: channel j in the low nibble of
byte j, channel j + d/2 in the high nibble), so a 4-bit stream's codes are (…, d/2) uint8. Either way
``value = code * scale + zero``. A 4-bit stream keeps its scales and zero points in a 2-byte float
(:func:`scale_dtype`); 8-bit streams keep the model dtype.

Axes (KIVI, arXiv 2402.02750): ``"channel"`` streams (keys, latents) have one scale and zero per channel over a
group of ``group_size`` tokens; ``"token"`` streams (values) one per token and head.

Rotation (QuaRot, arXiv 2404.00456): :func:`rotate` multiplies by an orthonormal, symmetric Hadamard matrix
(:func:`hadamard`), its own inverse, so a query is rotated once to score rotated codes and a weighted sum of
rotated values is un-rotated once.
"""

from __future__ import annotations

import functools
import math

import torch

from cache_backends.quant_formats import code_format


def code_range(bits: int) -> tuple[int, int]:
    """Smallest and largest code: int8's signed [-128, 127]; 4-bit unsigned nibbles [0, 15]."""
    fmt = code_format(bits)
    return fmt.code_min, fmt.code_max


def code_dtype(bits: int) -> torch.dtype:
    """The dtype of a ``bits``-bit stream's stored codes (int8; uint8 for packed 4-bit codes)."""
    return getattr(torch, code_format(bits).code_dtype)


def scale_dtype(bits: int, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a ``bits``-bit stream's scales and zero points: the model ``dtype`` at 8 bits; at 4 bits a
    2-byte float (``dtype`` if it is one, else float16)."""
    cap = code_format(bits).scale_max_bytes
    if cap is None or dtype.itemsize <= cap:
        return dtype
    return torch.float16


def quantize(x: torch.Tensor, dim: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric ``bits``-bit quantization of ``x`` with one (scale, zero) per slice along ``dim``.

    The arithmetic runs in fp32 whatever ``x``'s dtype (bf16 has 8 bits of mantissa: scales computed
    in it would cost the codes about one bit); ``scale`` and ``zero`` are returned in
    :func:`scale_dtype` ``(bits, x.dtype)`` (clamped to its finite range).

    Returns:
        ``(q, scale, zero)``: int8 codes shaped like ``x`` (one code per element, in :func:`code_range`;
        :func:`pack` packs 4-bit ones); ``scale`` and ``zero`` with ``dim`` reduced to size 1.
        ``x ≈ q * scale + zero`` (``zero`` = the slice minimum - qmin * scale, so a code times the scale plus
        the zero point is the value: no offset to subtract when attending).
    """
    qmin, qmax = code_range(bits)
    xf = x.float()
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / (qmax - qmin)).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((xf - lo) / scale) + qmin
    out = scale_dtype(bits, x.dtype)
    big = torch.finfo(out).max
    zero = (lo - qmin * scale).clamp_(-big, big)
    return q.clamp_(qmin, qmax).to(torch.int8), scale.clamp_max(big).to(out), zero.to(out)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The stored form of :func:`quantize`'s codes (…, w): int8 as they are; codes of a format that packs n a byte
    (4-bit: two) → (…, w / n) uint8, channel j + i w/n in bits [i * bits, (i + 1) * bits) of byte j (halves, not
    neighbours: unpacking is one concatenation, no interleave).

    Raises:
        ValueError: if ``w`` is not a multiple of the codes a byte packs (4-bit: odd).
    """
    fmt = code_format(bits)
    n = fmt.per_byte
    if n == 1:
        return q
    w = q.shape[-1]
    why = fmt.width_refusal(w, f"width {w}")
    if why:
        raise ValueError(why)
    u, part = q.to(torch.uint8), w // n
    out = u[..., :part]
    for i in range(1, n):
        out = out | (u[..., i * part : (i + 1) * part] << (i * bits))
    return out


def widen(codes: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored codes → one code per channel in ``dtype`` (the transient the matrix products read):
    (…, w) int8 at 8 bits, (…, w / 2) uint8 → (…, w) at 4 bits (:func:`pack`'s inverse)."""
    n = code_format(bits).per_byte
    if n == 1:
        return codes.to(dtype)
    mask = (1 << bits) - 1
    parts = [(codes >> (i * bits) if i else codes) & mask for i in range(n - 1)] + [codes >> ((n - 1) * bits)]
    return torch.cat(parts, dim=-1).to(dtype)


@functools.lru_cache(maxsize=64)
def hadamard(width: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal rotation of ``width`` channels: block-diagonal Sylvester Hadamard blocks of the largest
    power of two n dividing ``width``, scaled by 1/sqrt(n) — (width, width), symmetric, R @ R = I (QuaRot,
    arXiv 2404.00456, rotates with Hadamard matrices for the same reason: orthogonal, and no calibration).
    An odd width has n = 1: the identity."""
    n = width & -width
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    blocks = torch.block_diag(*([h / math.sqrt(n)] * (width // n)))
    return blocks.to(dtype=dtype, device=device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ R`` over the last axis (:func:`hadamard`), computed in fp32 and returned in ``x``'s dtype; R is its
    own inverse, so this also un-rotates."""
    return (x.float() @ hadamard(x.shape[-1], torch.float32, x.device)).to(x.dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return q.to(scale.dtype) * scale + zero


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, axis: str,
                     group_size: int, bits: int = 8, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stored codes (batch, heads, T, width_c) with their scales → values (batch, heads, T, width) in ``dtype``
    (default: the scales').

    ``scale``/``zero``: (batch, heads, T / group_size, width) on the channel axis, (batch, heads, T, 1) on
    the token axis. Rotated streams come back rotated (the caller un-rotates).
    """
    dtype = dtype or scale.dtype
    scale, zero = scale.to(dtype), zero.to(dtype)
    codes = widen(codes, bits, dtype)
    if axis != "channel":
        return dequantize(codes, scale, zero)
    b, h, t, w = codes.shape
    g = group_size
    return dequantize(codes.reshape(b, h, t // g, g, w), scale.unsqueeze(3), zero.unsqueeze(3)).reshape(b, h, t, w)


def codes_dot(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, axis: str,
              group_size: int, bits: int = 8) -> torch.Tensor:
    """Scores of int8 tokens against ``query`` (batch, heads, R, width) → (batch, heads, R, T), on the codes.

    Channel axis: ``q · (c * s_g + z_g) = (q * s_g) · c + q · z_g`` per token group g;
    token axis: ``q · (c_t * s_t + z_t) = s_t (q · c_t) + z_t Σ q``. Only the codes are widened to the
    query's dtype (a transient the size of the codes); nothing is dequantized.

    Args:
        codes: (batch, heads, T, width) int8, or (batch, heads, T, width / 2) uint8 at 4 bits; ``scale``, ``zero``
            as in :func:`dequantize_codes`.
    """
    codes = widen(codes, bits, query.dtype)
    scale, zero = scale.to(query.dtype), zero.to(query.dtype)  # 4-bit streams: fp16 scales in an fp32 model
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
                       axis: str, group_size: int, bits: int = 8) -> torch.Tensor:
    """``weights`` (batch, heads, R, T) times int8 tokens → (batch, heads, R, width), on the codes.

    Token axis: ``Σ_t p_t (c_t s_t + z_t) = (p * s) · c + p · z``; channel axis: per group,
    ``(p_g · c_g) * s_g + (Σ p_g) z_g``.
    """
    codes = widen(codes, bits, weights.dtype)
    scale, zero = scale.to(weights.dtype), zero.to(weights.dtype)
    if axis == "token":
        return (weights * scale.transpose(-1, -2)) @ codes + weights @ zero
    b, h, r, tq = weights.shape
    g, n, w = group_size, tq // group_size, codes.shape[-1]
    pg = weights.reshape(b, h, r, n, g).transpose(2, 3)  # (b, h, n, R, g)
    per_group = pg @ codes.reshape(b, h, n, g, w)  # (b, h, n, R, w)
    return (per_group * scale.unsqueeze(3)).sum(2) + pg.sum(-1).transpose(2, 3) @ zero
