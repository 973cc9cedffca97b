"""What a page of the KV pool holds: a backend's per-token *streams* and how every layer's slab of each fills a page.

The pool (:class:`cache_backends.pool.KVPool`) is ``num_pages`` pages of ``page_bytes`` bytes. A backend
describes what it keeps (:class:`cache_backends.kv_spec.KVSpec`: the per-token streams of a layer, K and V for
``full``, the shared heads for ``gqa``, a latent for ``mla``, the model's latent and rope key on native MLA, and
their quantization); :class:`PageLayout` carves a page into every layer's slab of every stream, in one of two
*tiers*, with the sizes the spec computes:

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

from cache_backends.kv_spec import KVSpec, align
from cache_backends.page_plan import SeqBlocks, TierPlan
from cache_backends.quant import code_dtype, scale_dtype
from cache_backends.quant_formats import code_format


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
        spec: what the backend stores (:class:`cache_backends.kv_spec.KVSpec`): its streams, layers per page and
            quantized tier (``residual=None``: an int8 tier filled only on demand, :meth:`plan_compress`,
            ``elastic``, never by writes).
        dtype: the model dtype (exact tokens, scales and zero points), of ``spec.dtype_bytes`` bytes.
        page_bytes: bytes per page.
        q_multiple: a page's quantized tokens are rounded down to a multiple of this (0: as many as fit). A hybrid
            model's groups take their smallest group's count, so that their blocks line up every
            ``max(q_tokens)`` tokens, not every ``lcm(q_tokens)`` (the prefix cache's block,
            :attr:`cache_backends.hybrid.HybridLayout.cache_block_tokens`); the page then holds fewer codes than
            fit, at most one such multiple fewer.

    Raises:
        ValueError: if a page cannot hold one exact token, or one quantization group, or ``dtype`` is not the
            spec's element size.
    """

    def __init__(self, spec: KVSpec, dtype: torch.dtype, page_bytes: int, q_multiple: int = 0):
        if dtype.itemsize != spec.dtype_bytes:
            raise ValueError(f"a {dtype} pool cannot hold a KV spec of {spec.dtype_bytes}-byte elements")
        self.spec, self.streams, self.num_layers = spec, spec.streams, spec.num_layers
        self.dtype, self.page_bytes = dtype, page_bytes
        q = spec.quantization
        exact_tokens = self._fit(lambda t: spec.exact_bytes(t, aligned=True), 1)
        q_tokens = self._fit(lambda t: spec.q_bytes(t, aligned=True), q.group_size) if q else 0
        if q and q_multiple and q_tokens >= q_multiple:
            q_tokens -= q_tokens % q_multiple
        super().__init__(exact_tokens, q_tokens, q)
        self.exact_slabs = self._slabs_exact(self.exact_tokens)
        if q:
            self.q_slabs = self._slabs_q(self.q_tokens)

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
                off += align(slab.nbytes)
            out.append(row)
        return out

    def _slabs_q(self, tokens: int) -> list[list[tuple[Slab, Slab, Slab]]]:
        q = self.quantization
        off, out = 0, []
        for _ in range(self.num_layers):
            row = []
            for s in self.streams:
                bits = q.bits(s.axis)  # 4 bits: (width / 2) bytes, two codes each
                codes = Slab(off, tokens, s.heads, code_format(bits).code_bytes(s.width), code_dtype(bits))
                off += align(codes.nbytes)
                units, width = (tokens // q.group_size, s.width) if s.axis == "channel" else (tokens, 1)
                scale = Slab(off, units, s.heads, width, scale_dtype(bits, self.dtype))
                off += align(scale.nbytes)
                zero = Slab(off, units, s.heads, width, scale_dtype(bits, self.dtype))
                off += align(zero.nbytes)
                row.append((codes, scale, zero))
            out.append(row)
        return out

    @property
    def q_tier(self) -> str:
        """The quantized tier's name: ``int8``, ``int4``, or ``k8v4`` for 8-bit keys and 4-bit values."""
        return self.quantization.tier

    def used_bytes(self) -> int:
        """Bytes of a page this backend fills (its tokens' slabs; the rest of the page is unused); with an
        on-demand tier, the emptier of its two tiers."""
        exact = self.spec.exact_bytes(self.exact_tokens, aligned=True)
        if not self.quantization:
            return exact
        q = self.spec.q_bytes(self.q_tokens, aligned=True)
        return min(exact, q) if self.on_demand else q

    def tier_tokens(self, blocks: SeqBlocks) -> dict[str, int]:
        """Tokens ``blocks`` holds per tier (``exact``, and for a quantized layout ``int8``, ``int4`` or ``k8v4``)."""
        if self.quantization:
            return {"exact": blocks.exact_len, self.q_tier: blocks.q_len}
        return {"exact": blocks.exact_len}

    def stats(self, blocks: SeqBlocks) -> dict:
        """Backend figures of one sequence for ``/info`` and the metrics (none here)."""
        return {}

    def stored_bytes(self, blocks: SeqBlocks) -> int:
        """Bytes of the tokens ``blocks`` holds in their stored form (:meth:`cache_backends.kv_spec.KVSpec.
        stored_bytes`, what the closed formulas count; the pages it holds are :meth:`SeqBlocks.pages` x
        ``page_bytes``)."""
        return self.spec.stored_bytes(blocks.exact_len, blocks.q_len)
