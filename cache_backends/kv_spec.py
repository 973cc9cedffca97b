"""What one backend's KV cache holds, as plain data, and every byte count computed from it in one place.

A backend describes its KV cache with a :class:`KVSpec` (:meth:`cache_backends.base.KVBackend.kv_spec`): the
per-token *streams* one layer stores (:class:`StreamSpec`: K and V for ``full``, the shared heads for ``gqa``,
a latent for ``mla``, the model's latent and rope key on native MLA), how many layers store them, the element
size, and how they are quantized (:class:`Quantization`, KIVI, arXiv 2402.02750: keys per channel over groups
of ``group_size`` tokens, values per token; 8-bit codes, or 4-bit codes two a byte; the newest tokens exact).

Every figure kvserve reports or plans with is a method here: the pool's page sizes and what a page of each tier
holds (:class:`cache_backends.page_layout.PageLayout`), the tokens' stored bytes behind admission's charge,
``/info`` and the metrics (:meth:`KVSpec.stored_bytes`), and the closed-form sums ``kvserve estimate`` and
``kvserve advise`` print (:meth:`KVSpec.bytes_per_token_per_layer`, through :mod:`cache_backends.estimate`).
Plain Python (no torch import). Units: bytes and tokens.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from cache_backends.quant_formats import code_format

ALIGN = 64  # bytes: every slab of a page starts at a multiple of this


def align(n: int) -> int:
    """``n`` bytes rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


class Axis(str, enum.Enum):
    """How a quantized stream groups its scales: per channel over token groups (keys, latents, rope keys), or
    per token and head (values)."""

    CHANNEL = "channel"
    TOKEN = "token"


@dataclass(frozen=True)
class StreamSpec:
    """One per-token stream a backend stores in every layer: ``(heads, width)`` per token.

    Attributes:
        heads: heads of the stream (num_key_value_heads for K/V, G for gqa, 1 for a latent).
        width: channels per head (head_dim, the latent rank, the rope key width).
        axis: how a quantized tier groups its scales (:class:`Axis`).
    """

    heads: int
    width: int
    axis: Axis = Axis.CHANNEL

    @property
    def elements(self) -> int:
        """Elements per token (heads x width)."""
        return self.heads * self.width


def kv_streams(heads: int, head_dim: int) -> list[StreamSpec]:
    """Keys (grouped per channel once quantized) and values (per token), ``(heads, head_dim)`` each per token."""
    return [StreamSpec(heads, head_dim, Axis.CHANNEL), StreamSpec(heads, head_dim, Axis.TOKEN)]


@dataclass(frozen=True)
class Quantization:
    """A quantized tier (KIVI, arXiv 2402.02750; 4-bit codes and rotation: QuaRot, arXiv 2404.00456).

    Attributes:
        group_size: tokens per key quantization group (a key-like stream has one scale and zero point per
            channel per group).
        residual: tokens always exact (the residual window): once ``residual + group_size`` tokens are exact, the
            oldest ``group_size`` are quantized. ``None``: the tier is filled on demand only (``elastic``), never
            by writes.
        key_bits, value_bits: code widths of the per-channel and the per-token streams, 8 or 4.
        rotate: Hadamard-rotated before quantizing (no byte per token).
        window: an on-demand tier's newest tokens that always stay exact (0 otherwise).
    """

    group_size: int
    residual: int | None
    key_bits: int = 8
    value_bits: int = 8
    rotate: bool = False
    window: int = 0

    @property
    def on_demand(self) -> bool:
        """Whether the tier is filled on demand only (``elastic``), not by a residual window."""
        return self.residual is None

    def bits(self, axis: Axis) -> int:
        """Code width of a stream: ``key_bits`` per channel (keys, latents, rope keys), ``value_bits`` per token."""
        return self.key_bits if axis == Axis.CHANNEL else self.value_bits

    @property
    def tier(self) -> str:
        """The tier's name: ``int8``, ``int4``, or ``k8v4`` for 8-bit keys and 4-bit values."""
        kb, vb = self.key_bits, self.value_bits
        return f"int{kb}" if kb == vb else f"k{kb}v{vb}"

    def exact_held(self, seq_len: int) -> int:
        """Tokens still exact in a sequence of ``seq_len`` written tokens: the residual window plus the forming
        group once ``seq_len >= residual + group_size``, else all (an on-demand tier: all)."""
        r, g = self.residual, self.group_size
        if r is None or seq_len < r + g:
            return seq_len
        return r + (seq_len - r) % g


def scale_bytes(bits: int, dtype_bytes: int) -> int:
    """Bytes of one scale or zero point of a ``bits``-bit stream in a model of ``dtype_bytes``: the model dtype's
    at 8 bits, at most 2 at 4 bits (its format's row, :meth:`cache_backends.quant_formats.CodeFormat.scale_bytes`;
    the rule of :func:`cache_backends.quant.scale_dtype`)."""
    return code_format(bits).scale_bytes(dtype_bytes)


@dataclass(frozen=True)
class KVSpec:
    """A backend's KV cache: ``streams`` in each of ``num_layers`` layers, ``dtype_bytes`` per exact element,
    and an optional quantized tier.

    Raises:
        ValueError: (at construction) for no streams, a non-positive size, or an odd stream width under 4-bit
            codes (two channels a byte).
    """

    streams: tuple[StreamSpec, ...]
    num_layers: int
    dtype_bytes: int
    quantization: Quantization | None = None

    def __post_init__(self):
        if not self.streams or self.num_layers < 1 or self.dtype_bytes < 1:
            raise ValueError(f"a KV spec needs streams, layers and an element size: {self}")
        q = self.quantization
        for s in self.streams:
            if s.heads < 1 or s.width < 1:
                raise ValueError(f"a stream needs heads and channels: {s}")
            why = q and code_format(q.bits(s.axis)).width_refusal(s.width, f"a stream width of {s.width}")
            if why:
                raise ValueError(why)

    def with_layers(self, num_layers: int) -> "KVSpec":
        """The same streams in ``num_layers`` layers (``dca``'s groups of pages)."""
        return dataclasses.replace(self, num_layers=num_layers)

    def with_quantization(self, quantization: Quantization | None) -> "KVSpec":
        return dataclasses.replace(self, quantization=quantization)

    # ---- bytes of a number of tokens, all layers --------------------------------------------------------
    def exact_bytes(self, tokens: int, aligned: bool = False) -> int:
        """Bytes of ``tokens`` exact tokens in every layer (``aligned``: each layer's slab of each stream rounded up
        to :data:`ALIGN`, as a page lays them out)."""
        fit = align if aligned else int
        return self.num_layers * sum(fit(tokens * s.elements * self.dtype_bytes) for s in self.streams)

    def q_bytes(self, tokens: int, aligned: bool = False) -> int:
        """Bytes of ``tokens`` quantized tokens (whole groups for a per-channel stream) in every layer: codes at
        each stream's bits, one scale and one zero point per channel per group (per channel) or per token and
        head (per token). ``aligned`` as in :meth:`exact_bytes`.

        Raises:
            ValueError: for a spec without a quantized tier.
        """
        q = self.quantization
        if q is None:
            raise ValueError("this KV spec has no quantized tier")
        fit = align if aligned else int
        total = 0
        for s in self.streams:
            bits = q.bits(s.axis)
            scales = (tokens // q.group_size) * s.elements if s.axis == Axis.CHANNEL else tokens * s.heads
            codes = code_format(bits).code_bytes(tokens * s.elements)
            total += fit(codes) + 2 * fit(scales * scale_bytes(bits, self.dtype_bytes))
        return self.num_layers * total

    def stored_bytes(self, exact_tokens: int, q_tokens: int = 0) -> int:
        """Bytes of a sequence's tokens in their stored form: ``exact_tokens`` exact and ``q_tokens`` quantized,
        in every layer (the pages that hold them are counted by the pool, not here)."""
        total = self.exact_bytes(exact_tokens)
        return total + self.q_bytes(q_tokens) if q_tokens else total

    def tokens_held(self, seq_len: int) -> tuple[int, int]:
        """``(exact, quantized)`` tokens a sequence of ``seq_len`` written tokens holds (an on-demand tier: every
        token exact, its most)."""
        if self.quantization is None:
            return seq_len, 0
        exact = self.quantization.exact_held(seq_len)
        return exact, seq_len - exact

    def bytes_at(self, seq_len: int) -> int:
        """Bytes a sequence of ``seq_len`` written tokens holds, all layers."""
        return self.stored_bytes(*self.tokens_held(seq_len))

    def bytes_per_token_per_layer(self, seq_len: int) -> float:
        """:meth:`bytes_at` per token per layer (an int8-family spec depends on ``seq_len`` through its exact
        window)."""
        return self.bytes_at(seq_len) / (max(seq_len, 1) * self.num_layers)

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block of ``block_size`` tokens in the stored form, slabs aligned (rounded up to whole
        quantization groups; an on-demand tier: the exact block every token starts in, or one group of codes where
        that is more, so that a page holds a group: ``elastic`` alone in fp16 at 16 tokens a block had pages too small
        for its 32-token groups): the page size of a pool that serves only this backend."""
        q = self.quantization
        if q and not q.on_demand:
            return self.q_bytes(q.group_size * -(-block_size // q.group_size), aligned=True)
        exact = self.exact_bytes(block_size, aligned=True)
        return max(exact, self.q_bytes(q.group_size, aligned=True)) if q else exact
