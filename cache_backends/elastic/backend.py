"""``elastic``: exact K/V while the KV pool has room, int8 for the oldest tokens only when it runs out.

Every sequence starts exact, as under ``full``. When the engine needs a block and the pool has none free, it
re-encodes the oldest exact tokens of running ``elastic`` sequences into int8 codes (whole groups of
``group_size`` tokens, keys per channel over the group and values per token, as ``int8``: KIVI, arXiv
2402.02750), outside each sequence's newest ``window`` tokens, which always stay exact; the exact pages those
tokens leave go back to the pool. It takes first from the sequence that holds the most compressible exact
tokens (so the quantized share of the running contexts stays even, and the longest exact spans, which hold
the most pages, go first), and preempts only when nothing is left to compress (vLLM preempts at once).
One sequence's attention reads its mixed pages in their stored forms in one pass: the codes scored with the
scales folded into the query and the weights, the exact tokens as they are (no dequantized copy).

With no memory pressure nothing is quantized and the output is ``full``'s. At the other end, every
compressible block quantized, it stores what ``int8:group_size=g,residual=window`` stores for the tokens it
holds. Bytes per token therefore range from ``full``'s to int8's; ``/info`` and the metrics show the live mix
(``kvserve_kv_cache_tier_tokens``). The quantized tier depends on when the pool ran short, not on the prompt
alone, so ``elastic`` blocks are not shared through the prefix cache.
"""

from __future__ import annotations

import dataclasses

from cache_backends.base import KVBackend
from cache_backends.geometry import ModelGeometry
from cache_backends.full.backend import FullLayer
from cache_backends.kv_spec import KVSpec, Quantization, kv_streams
from cache_backends.paged_attention import attend_pair
from cache_backends.quant_formats import BITS, bits_choices


class ElasticBackend(KVBackend):
    """Exact K/V, quantized to int8 on demand under memory pressure.

    Args:
        geometry: the model's attention shape.
        group_size: tokens per key quantization group (``KV_INT8_GROUP_SIZE``, default 32).
        window: newest tokens of each sequence that always stay exact (``KV_ELASTIC_WINDOW``, default 32).
        bits: code width of the compressed tier, 8 (``int8``) or 4 (``int4``: two codes a byte, scales in a
            2-byte float) (``KV_ELASTIC_BITS``, default 8).

    Raises:
        ValueError: if ``group_size`` < 1, ``window`` < 0 or ``bits`` is not 4 or 8.
    """

    name = "elastic"
    attends_in_place = True

    def __init__(self, geometry: ModelGeometry, group_size: int = 32, window: int = 32, bits: int = 8):
        if group_size < 1:
            raise ValueError(f"elastic group_size={group_size} must be >= 1")
        if window < 0:
            raise ValueError(f"elastic window={window} must be >= 0")
        if bits not in BITS:
            raise ValueError(f"elastic bits={bits} must be {bits_choices()}")
        super().__init__(geometry, group_size=group_size, window=window, bits=bits)
        self.group_size, self.window, self.bits = group_size, window, bits
        self.quantization = Quantization(group_size, None, bits, bits, window=window)  # filled on demand only
        self.tiers = ("exact", f"int{bits}")

    def new_layer(self, index: int, position_offset: int = 0) -> FullLayer:
        """A per-sequence store holds exact K/V (the on-demand tier lives in the paged pool only)."""
        return FullLayer()

    def sums_spec(self) -> tuple[str, dict]:
        return "elastic", {"group_size": self.group_size, "window": self.window, "bits": self.bits}

    def reserved_bytes(self, max_tokens: int) -> int:
        g = self.geometry
        return 2 * g.num_key_value_heads * g.head_dim * g.dtype_bytes * max_tokens * g.num_layers

    def details(self) -> dict:
        return {"tiers": list(self.tiers), "window": self.window, "group_size": self.group_size, "bits": self.bits,
                "compress": "under pool pressure, oldest exact groups of the sequence with the most compressible "
                            "tokens first; preemption only when none is left"}

    def min_bytes_per_token_per_layer(self, seq_len: int = 1024) -> float:
        """Every compressible group quantized: its tier with the window as the residual window (what
        ``int8:group_size=g,residual=window`` holds; :func:`cache_backends.estimate.elastic_min_bytes_per_token_per_layer`)."""
        tier = dataclasses.replace(self.quantization, residual=self.window, window=0)
        return self.kv_spec().with_quantization(tier).bytes_per_token_per_layer(seq_len)

    def kv_spec(self) -> KVSpec:
        """A block holds keys (grouped per channel once quantized) and values (per token), (num_key_value_heads,
        head_dim) each per token, exact until the pool runs short: an on-demand tier (no residual window), the
        newest ``window`` tokens always exact."""
        g = self.geometry
        return self._kv_spec(kv_streams(g.num_key_value_heads, g.head_dim), self.quantization)

    def attend_paged(self, layer, query, reads, meta, scaling, module=None):
        """Exact pages through ``scaled_dot_product_attention`` while nothing is quantized; else the codes scored
        in their stored form beside the exact tokens, in one softmax."""
        return attend_pair(query, reads[0], reads[1], meta, scaling)
