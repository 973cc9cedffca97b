"""What a page of the KV pool holds: a backend's per-token *streams* and how every layer's slab of each fills a page.

The pool (:class:`cache_backends.pool.KVPool`) is ``num_pages`` pages of ``page_bytes`` bytes. A backend
describes the per-token streams it keeps per layer (:class:`StreamSpec`: K and V for ``full``, the shared
heads for ``gqa``, a latent for ``mla``, the model's latent and rope key on native MLA) and whether they are
quantized (``int8`` options). :class:`PageLayout` carves a page into every layer's slab of every stream, in
one of two *tiers*:

* ``exact`` — ``exact_tokens`` tokens of every stream in the model dtype;
* ``q`` (quantized backends only) — ``q_tokens`` tokens as codes with their scales and zero points
  (keys per channel over groups of ``group_size`` tokens, values per token: KIVI, arXiv 2402.02750): int8
  codes, or two 4-bit codes a byte (``key_bits``/``value_bits`` = 4), Hadamard-rotated when ``rotate``
  (:mod:`cache_backends.int8`).

A sequence's tokens are its quantized tokens (``q`` pages, oldest first) followed by its exact tokens
(``exact`` pages, a FIFO): for a quantized backend the exact tokens are its full-precision residual window;
once ``residual + group_size`` tokens are exact, the oldest ``group_size`` are quantized into the ``q``
pages (the rule of :class:`cache_backends.int8.Int8Storage`, so the same tokens form the same groups
however the prompt was chunked) and exact pages that hold no live token go back to the pool after the
step. Pages are taken on demand (:meth:`PageLayout.plan`, :mod:`cache_backends.page_plan`'s planning), so a
sequence holds only the pages its tokens need (PagedAttention, Kwon et al., arXiv 2309.06180).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache_backends.estimate import scale_bytes
from cache_backends.page_plan import SeqBlocks, TierPlan
from cache_backends.quant import scale_dtype, stream_bits

ALIGN = 64  # bytes: every slab of a page starts at a multiple of this


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class StreamSpec:
    """One per-token stream a backend stores in every layer: ``(heads, width)`` per token.

    Attributes:
        heads: heads of the stream (num_key_value_heads for K/V, G for gqa, 1 for a latent).
        width: channels per head (head_dim, the latent rank, the rope key width).
        axis: how int8 groups its scales: ``"channel"`` (per channel over token groups: keys, latents) or
            ``"token"`` (per token and head: values).
    """

    heads: int
    width: int
    axis: str = "channel"


@dataclass
class Slab:
    """Where one tensor of one layer's stream sits in a page: ``offset`` bytes, laid out ``(heads, units, width)``
    (head-major, so that gathering a batch's pages gives ``(heads, batch, tokens, width)`` with no copy)."""

    offset: int
    units: int
    heads: int
    width: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.units * self.heads * self.width * self.dtype.itemsize


class PageLayout(TierPlan):
    """How one backend's streams fill a page of ``page_bytes`` bytes; its planning (:meth:`plan`, :meth:`pages_for`,
    ...) is :class:`cache_backends.page_plan.TierPlan`'s, on the tokens a page of each tier holds.

    Args:
        streams: the per-token streams of one layer.
        num_layers: decoder layers (every page holds its tokens for all of them).
        dtype: the model dtype (exact tokens, scales and zero points).
        page_bytes: bytes per page.
        quantize: ``None``, ``{"group_size": g, "residual": r}`` (a quantized tier with a residual window, with
            optional ``key_bits`` / ``value_bits`` (8 or 4: :func:`cache_backends.quant.stream_bits`) and
            ``rotate``), or ``{"group_size": g, "residual": None, "window": w}``: an int8 tier filled only on
            demand (:meth:`plan_compress`, ``elastic``), never by writes, the newest ``w`` tokens always exact.

    Raises:
        ValueError: if a page cannot hold one exact token, or one quantization group.
    """

    def __init__(self, streams: list[StreamSpec], num_layers: int, dtype: torch.dtype, page_bytes: int,
                 quantize: dict | None = None):
        self.streams, self.num_layers, self.dtype, self.page_bytes = streams, num_layers, dtype, page_bytes
        exact_tokens = self._fit(lambda t: self.exact_bytes(streams, num_layers, dtype, t), 1)
        q_tokens = 0
        if quantize:
            g = quantize["group_size"]
            q_tokens = self._fit(lambda t: self.q_bytes(streams, num_layers, dtype, quantize, t), g)
        super().__init__(exact_tokens, q_tokens, quantize)
        self.exact_slabs = self._slabs_exact(self.exact_tokens)
        if quantize:
            self.q_slabs = self._slabs_q(self.q_tokens)

    # ---- sizes ----------------------------------------------------------------------------------------
    @staticmethod
    def exact_bytes(streams, num_layers: int, dtype: torch.dtype, tokens: int) -> int:
        """Bytes of a page of ``tokens`` exact tokens (slabs aligned)."""
        e = dtype.itemsize
        return num_layers * sum(_align(tokens * s.heads * s.width * e) for s in streams)

    @staticmethod
    def q_bytes(streams, num_layers: int, dtype: torch.dtype, quantize: dict, tokens: int) -> int:
        """Bytes of a page of ``tokens`` quantized tokens (a multiple of ``group_size``) with scales and zeros
        (each stream's codes at its bits: :func:`cache_backends.quant.stream_bits`)."""
        e = dtype.itemsize
        group_size, total = quantize["group_size"], 0
        for s in streams:
            bits = stream_bits(quantize, s.axis)
            scales = (tokens // group_size) * s.heads * s.width if s.axis == "channel" else tokens * s.heads
            total += _align(tokens * s.heads * s.width * bits // 8) + 2 * _align(scales * scale_bytes(bits, e))
        return num_layers * total

    @classmethod
    def natural_page_bytes(cls, streams, num_layers: int, dtype: torch.dtype, block_size: int,
                           quantize: dict | None) -> int:
        """Bytes of one block of ``block_size`` tokens in this backend's stored form (rounded up to whole
        quantization groups; an on-demand tier: the exact block every token starts in): the page size a pool
        serving only this backend uses."""
        if quantize and quantize["residual"] is not None:
            g = quantize["group_size"]
            return cls.q_bytes(streams, num_layers, dtype, quantize, g * -(-block_size // g))
        return cls.exact_bytes(streams, num_layers, dtype, block_size)

    def _fit(self, size, step: int) -> int:
        """The most tokens (a multiple of ``step``) whose page fits ``page_bytes``."""
        if size(step) > self.page_bytes:
            raise ValueError(f"a KV page of {self.page_bytes} bytes cannot hold {step} token(s) of this backend")
        lo, hi = 1, max(1, self.page_bytes // step)  # in units of step; size() is monotone
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if size(mid * step) <= self.page_bytes else (lo, mid - 1)
        return lo * step

    def _slabs_exact(self, tokens: int) -> list[list[Slab]]:
        off, out = 0, []
        for _ in range(self.num_layers):
            row = []
            for s in self.streams:
                slab = Slab(off, tokens, s.heads, s.width, self.dtype)
                row.append(slab)
                off += _align(slab.nbytes)
            out.append(row)
        return out

    def _slabs_q(self, tokens: int) -> list[list[tuple[Slab, Slab, Slab]]]:
        g = self.quantize["group_size"]
        off, out = 0, []
        for _ in range(self.num_layers):
            row = []
            for s in self.streams:
                bits = stream_bits(self.quantize, s.axis)  # 4 bits: (width / 2) bytes, two codes each
                codes = Slab(off, tokens, s.heads, s.width * bits // 8, torch.int8 if bits == 8 else torch.uint8)
                off += _align(codes.nbytes)
                units, width = (tokens // g, s.width) if s.axis == "channel" else (tokens, 1)
                scale = Slab(off, units, s.heads, width, scale_dtype(bits, self.dtype))
                off += _align(scale.nbytes)
                zero = Slab(off, units, s.heads, width, scale_dtype(bits, self.dtype))
                off += _align(zero.nbytes)
                row.append((codes, scale, zero))
            out.append(row)
        return out

    @property
    def q_tier(self) -> str:
        """The quantized tier's name: ``int8``, ``int4``, or ``k8v4`` for 8-bit keys and 4-bit values."""
        kb, vb = stream_bits(self.quantize, "channel"), stream_bits(self.quantize, "token")
        return f"int{kb}" if kb == vb else f"k{kb}v{vb}"

    def used_bytes(self) -> int:
        """Bytes of a page this backend fills (its tokens' slabs; the rest of the page is unused); with an
        on-demand tier, the emptier of its two tiers."""
        if self.on_demand:
            return min(self.exact_bytes(self.streams, self.num_layers, self.dtype, self.exact_tokens),
                       self.q_bytes(self.streams, self.num_layers, self.dtype, self.quantize, self.q_tokens))
        if self.quantize:
            return self.q_bytes(self.streams, self.num_layers, self.dtype, self.quantize, self.q_tokens)
        return self.exact_bytes(self.streams, self.num_layers, self.dtype, self.exact_tokens)

    def tier_tokens(self, blocks: SeqBlocks) -> dict[str, int]:
        """Tokens ``blocks`` holds per tier (``exact``, and for a quantized layout ``int8``, ``int4`` or ``k8v4``)."""
        if self.quantize:
            return {"exact": blocks.exact_len, self.q_tier: blocks.q_len}
        return {"exact": blocks.exact_len}

    def stats(self, blocks: SeqBlocks) -> dict:
        """Backend figures of one sequence for ``/info`` and the metrics (none here)."""
        return {}

    def stored_bytes(self, blocks: SeqBlocks) -> int:
        """Bytes of the tokens ``blocks`` holds in their stored form (what the closed formulas count; the
        pages it holds are :meth:`SeqBlocks.pages` x ``page_bytes``)."""
        e = self.dtype.itemsize
        per_exact = sum(s.heads * s.width for s in self.streams) * e
        total = blocks.exact_len * per_exact
        if self.quantize and blocks.q_len:
            g, q = self.quantize["group_size"], blocks.q_len
            for s in self.streams:
                bits = stream_bits(self.quantize, s.axis)
                scales = (q // g) * s.heads * s.width if s.axis == "channel" else q * s.heads
                total += q * s.heads * s.width * bits // 8 + 2 * scales * scale_bytes(bits, e)
        return total * self.num_layers
