"""``gqa``: post-hoc head sharing — keep G shared K/V heads instead of num_key_value_heads.

Method (Ainslie et al., "GQA", arXiv 2305.13245, checkpoint conversion by mean pooling): the
``num_key_value_heads`` heads are split into G groups of m = num_key_value_heads / G consecutive heads;
each group stores one shared key head and one shared value head per token; every query head attends to
its group's shared K/V, rebuilt to its own head when read.

Two ways to make the shared head (``KV_GQA_METHOD``):

* ``mean`` — the paper's conversion: shared = mean of the group's heads; every head reads it back as is.
* ``pca`` (calibrated, the default) — the shared head is the group's best rank-``head_dim`` summary on
  the calibration slice, and each head reads back its own reconstruction. Values: the top ``head_dim``
  principal directions of the group's concatenated values (m·head_dim wide). Keys: the same, but in the
  RoPE-compatible family — for each rotary frequency pair the m heads' pairs are treated as complex
  numbers and summarised by their top complex principal component, a per-head complex scale
  (rotation + gain) that commutes with RoPE, so keys can be compressed *after* RoPE. Mean pooling is
  the special case with equal weights, so ``pca`` is never worse in reconstruction error.

Storage per sequence and layer: shared keys and values of shape (1, G, seq_len, head_dim) in the
model's dtype (``gqa+int8``: quantized as in ``int8``, keys per channel, values per token). Bytes per token per layer: ``2 * G * head_dim * dtype_bytes``. The encode/decode
matrices are per-model constants (like weights), not per-token storage, fitted once and kept in the
calibration cache (:mod:`cache_backends.calibration_cache`, keyed by G). With G = num_key_value_heads
both methods are lossless (identity check).
"""

from __future__ import annotations

import torch

from cache_backends import kernels
from cache_backends.base import KVBackend
from cache_backends.geometry import ModelGeometry
from cache_backends.kv_store import StreamPairLayer
from cache_backends.int8.backend import attend_stored, make_storage, quant_spec, storage_reserved_bytes
from cache_backends.kv_spec import KVSpec, Quantization, kv_streams
from cache_backends.paged import InPlaceRead, drain_layer
from cache_backends.paged_attention import attend_pair
from cache_backends.gqa.spec import default_gqa_groups

METHODS = ("pca", "mean")
FIT_VERSION = 1  # of the calibration cache entry (bump when the fit changes)


class GroupCodec:
    """Per-layer encode/decode matrices for the K (or V) heads of every group.

    Args:
        encode: (G, m * head_dim, head_dim) — a group's concatenated heads → its shared head.
        decode: (G, head_dim, m * head_dim) — a shared head → the group's heads.
    """

    def __init__(self, encode: torch.Tensor, decode: torch.Tensor):
        self.encode_m = encode
        self.decode_m = decode
        self.groups = encode.shape[0]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads, seq, head_dim) → (batch, G, seq, head_dim)."""
        b, h, t, d = x.shape
        grouped = x.reshape(b, self.groups, h // self.groups, t, d).permute(0, 1, 3, 2, 4)
        grouped = grouped.reshape(b, self.groups, t, h // self.groups * d)  # (batch, G, seq, m * head_dim)
        return grouped @ self.encode_m.to(x.dtype)

    def decode(self, s: torch.Tensor) -> torch.Tensor:
        """(batch, G, seq, head_dim) → (batch, heads, seq, head_dim)."""
        b, g, t, d = s.shape
        heads = s @ self.decode_m.to(s.dtype)  # (batch, G, seq, m * head_dim)
        m = self.decode_m.shape[-1] // d
        return heads.reshape(b, g, t, m, d).permute(0, 1, 3, 2, 4).reshape(b, g * m, t, d)


def mean_codec(groups: int, per_group: int, head_dim: int) -> GroupCodec:
    eye = torch.eye(head_dim)
    enc = torch.cat([eye / per_group] * per_group, dim=0)  # (m * head_dim, head_dim)
    dec = torch.cat([eye] * per_group, dim=1)  # (head_dim, m * head_dim)
    return GroupCodec(enc.expand(groups, -1, -1).clone(), dec.expand(groups, -1, -1).clone())


def pca_value_codec(values: torch.Tensor, groups: int) -> GroupCodec:
    """Top-``head_dim`` principal directions of each group's concatenated values.

    Args:
        values: (tokens, heads, head_dim) calibration values.
    """
    n, h, d = values.shape
    m = h // groups
    enc, dec = [], []
    for g in range(groups):
        x = values[:, g * m : (g + 1) * m].reshape(n, m * d).double()
        _, vecs = torch.linalg.eigh(x.T @ x)  # ascending eigenvalues
        basis = vecs[:, -d:].flip(-1).float()  # (m * head_dim, head_dim), orthonormal columns
        enc.append(basis)
        dec.append(basis.T)
    return GroupCodec(torch.stack(enc), torch.stack(dec))


def pca_key_codec(keys: torch.Tensor, groups: int) -> GroupCodec:
    """RoPE-commuting summary of each group's keys: one complex weight per head and frequency pair.

    For frequency pair i (channels i and i + head_dim/2), the group's m pairs form z ∈ C^m; the shared
    pair is s = u^H z with u the top eigenvector of E[z z^H], and head j reads back u_j s. RoPE
    multiplies every z_j by the same phase, so E[z z^H] is the same before and after RoPE.

    Args:
        keys: (tokens, heads, head_dim) calibration keys (before or after RoPE).
    """
    n, h, d = keys.shape
    m, half = h // groups, d // 2
    z = torch.complex(keys[..., :half].double(), keys[..., half:].double())  # (tokens, heads, half)
    enc = torch.zeros(groups, m * d, d)
    dec = torch.zeros(groups, d, m * d)
    for g in range(groups):
        zg = z[:, g * m : (g + 1) * m]  # (tokens, m, half)
        cov = torch.einsum("tji,tki->ijk", zg, zg.conj())  # (half, m, m) Hermitian
        _, vecs = torch.linalg.eigh(cov)
        u = vecs[..., -1]  # (half, m): top eigenvector per frequency pair
        for j in range(m):
            a, b = u[:, j].real.float(), u[:, j].imag.float()  # u_j = a + ib, per pair
            rows = slice(j * d, (j + 1) * d)
            idx = torch.arange(half)
            # With row = input channel, column = output channel (y = x @ M):
            #   s1 = a x1 + b x2,  s2 = -b x1 + a x2   (conj(u) * z)
            enc_blk = torch.zeros(d, d)
            enc_blk[idx, idx] = a
            enc_blk[idx + half, idx] = b
            enc_blk[idx, idx + half] = -b
            enc_blk[idx + half, idx + half] = a
            enc[g, rows, :] = enc_blk
            #   z_j = u_j * s:  x1 = a s1 - b s2,  x2 = b s1 + a s2
            dec_blk = torch.zeros(d, d)
            dec_blk[idx, idx] = a
            dec_blk[idx + half, idx] = -b
            dec_blk[idx, idx + half] = b
            dec_blk[idx + half, idx + half] = a
            dec[g, :, rows] = dec_blk
    return GroupCodec(enc, dec)


def folded_maps(codec: GroupCodec, num_attention_heads: int) -> torch.Tensor:
    """Per query head, its K/V head's read-back block of ``codec``: (num_attention_heads, head_dim, head_dim).

    Head j of group g reads ``x_j = s_g @ B_gj`` with ``B_gj = decode[g][:, j*d:(j+1)*d]``. Query head h
    (of K/V head j = h // (num_attention_heads / num_key_value_heads)) gets ``B_gj``.
    """
    g, d, md = codec.decode_m.shape
    m = md // d
    blocks = codec.decode_m.reshape(g, d, m, d).permute(0, 2, 1, 3).reshape(g * m, d, d)  # per K/V head
    return blocks.repeat_interleave(num_attention_heads // (g * m), dim=0)


class GQALayer(StreamPairLayer):
    """One layer's shared K/V heads, (1, G, seq_len, head_dim) each, held exactly or as int8 (``gqa+int8``).

    Decode is grouped-query attention over the G shared heads: query head h scores
    ``q_h · (s_g B^k_h) = (q_h B^k_h^T) · s_g`` and outputs ``(Σ_t p_t s^v_{g,t}) B^v_h``, so the key codec is
    folded into the query and the value codec into the output; no head is rebuilt.
    """

    def __init__(self, key_codec: GroupCodec, value_codec: GroupCodec, quantization: Quantization | None = None,
                 query_map: torch.Tensor | None = None, output_map: torch.Tensor | None = None):
        super().__init__()
        self.key_codec = key_codec
        self.value_codec = value_codec
        self.quantization = quantization
        self.query_map = query_map  # (Hq, d, d): B^k per query head, transposed when applied
        self.output_map = output_map  # (Hq, d, d): B^v per query head
        self.key_store = make_storage("channel", self.quantization)
        self.value_store = make_storage("token", self.quantization)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.key_store.append(self.key_codec.encode(key_states))
        self.value_store.append(self.value_codec.encode(value_states))

    def materialize(self):
        return self.key_codec.decode(self.key_store.read()), self.value_codec.decode(self.value_store.read())

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Decode over the shared heads with folded codecs; prefill over rebuilt heads."""
        if query.shape[-2] > 1 or self.query_map is None:
            return super().attend(query, scaling)
        q = torch.einsum("hd,hed->he", query[0, :, 0], self.query_map.to(query.dtype))  # q_h B_h^T, (Hq, d)
        out = attend_stored(q[None, :, None], self.key_store, self.value_store, scaling)  # (1, Hq, 1, d)
        return torch.einsum("hd,hde->he", out[0, :, 0], self.output_map.to(out.dtype))[None, :, None]



class GQABackend(KVBackend):
    """Post-hoc grouped-query KV cache.

    Args:
        geometry: the model's attention shape.
        groups: shared K/V heads kept per layer (``KV_GQA_GROUPS``); must divide num_key_value_heads.
            Default: the largest divisor of num_key_value_heads up to a quarter of it (at least 1).
        method: ``pca`` (calibrated) or ``mean`` (``KV_GQA_METHOD``).

    Raises:
        ValueError: if ``groups`` does not divide num_key_value_heads or ``method`` is unknown.
    """

    name = "gqa"
    attends_in_place = True

    @classmethod
    def compose(cls, geometry: ModelGeometry, inner: KVBackend, **options) -> "GQABackend":
        """``gqa+int8``/``gqa+int4``: the shared heads stored in ``inner``'s quantized tier."""
        return cls(geometry, quantization=inner.quantization, **options)

    def __init__(self, geometry: ModelGeometry, groups: int | None = None, method: str = "pca",
                 quantization: Quantization | None = None):
        groups = default_gqa_groups(geometry.num_key_value_heads) if groups is None else groups
        if groups < 1 or geometry.num_key_value_heads % groups:
            raise ValueError(f"KV_GQA_GROUPS={groups} must divide num_key_value_heads="
                             f"{geometry.num_key_value_heads}")
        if method not in METHODS:
            raise ValueError(f"KV_GQA_METHOD={method!r}; allowed: {', '.join(METHODS)}")
        super().__init__(geometry, groups=groups, method=method,
                         **(quant_spec(quantization)[1] if quantization else {}))
        self.groups, self.method, self.quantization = groups, method, quantization
        m = geometry.num_key_value_heads // groups
        codec = mean_codec(groups, m, geometry.head_dim)
        self.codecs = [(codec, codec)] * geometry.num_layers
        self.folded: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer, made on first use

    def prepare(self, model, calibration_ids: list[int] | None = None, cache=None) -> None:
        """Fit the ``pca`` codecs on the calibration slice, or load them from ``cache`` (keyed by the
        groups); no-op for ``mean``."""
        from cache_backends.calibration import calibration_ids as calib_ids
        from cache_backends.calibration_cache import CalibrationCache

        device = next(model.parameters()).device
        if self.method == "pca":
            ids = calibration_ids if calibration_ids is not None else calib_ids(model)
            self.codecs = (cache or CalibrationCache()).fetch(
                "gqa", model, ids, {"groups": self.groups, "method": "pca"}, fit=lambda: self._fit(model, ids),
                load=lambda tensors, _: self._load(tensors), version=FIT_VERSION)
        for kc, vc in self.codecs:
            for c in (kc, vc):
                c.encode_m, c.decode_m = c.encode_m.to(device), c.decode_m.to(device)
        self.folded = None

    def _fit(self, model, ids: list[int]) -> tuple[dict[str, torch.Tensor], dict]:
        """Per layer i: ``{i}.{key,value}.{encode,decode}``; figures: each layer's relative squared error of
        the rebuilt K and V on the calibration slice (``|x - decode(encode(x))|² / |x|²``)."""
        from cache_backends.calibration import collect_kv

        kv = collect_kv(model, self.geometry, ids, desc="gqa calibration")
        tensors, errors = {}, {"key_relative_error": [], "value_relative_error": []}
        for i, (k, v) in enumerate(kv):
            codecs = (("key", k, pca_key_codec(k, self.groups)), ("value", v, pca_value_codec(v, self.groups)))
            for part, x, codec in codecs:
                tensors[f"{i}.{part}.encode"], tensors[f"{i}.{part}.decode"] = codec.encode_m, codec.decode_m
                heads = x.transpose(0, 1)[None]  # (1, H, tokens, d)
                err = (codec.decode(codec.encode(heads)) - heads).pow(2).sum() / heads.pow(2).sum().clamp_min(1e-30)
                errors[f"{part}_relative_error"].append(round(err.item(), 6))
        return tensors, errors

    def _load(self, tensors: dict[str, torch.Tensor]) -> list[tuple[GroupCodec, GroupCodec]]:
        from cache_backends.calibration_cache import take

        g, d = self.groups, self.geometry.head_dim
        md = self.geometry.num_key_value_heads // g * d
        return [tuple(GroupCodec(take(tensors, f"{i}.{part}.encode", (g, md, d)),
                                 take(tensors, f"{i}.{part}.decode", (g, d, md))) for part in ("key", "value"))
                for i in range(self.geometry.num_layers)]

    def _folded(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s key read-back folded per query head (Hq, d, d) and value read-back (Hq, d, d)."""
        if self.folded is None:
            heads = self.geometry.num_attention_heads
            self.folded = [(folded_maps(kc, heads), folded_maps(vc, heads)) for kc, vc in self.codecs]
        return self.folded[index]

    def new_layer(self, index: int, position_offset: int = 0) -> GQALayer:
        key_codec, value_codec = self.codecs[index]
        query_map, output_map = self._folded(index)
        return GQALayer(key_codec, value_codec, self.quantization, query_map, output_map)

    def kv_spec(self) -> KVSpec:
        """A block holds the G shared key heads (grouped per channel under int8) and value heads, (G, head_dim)
        each per token."""
        return self._kv_spec(kv_streams(self.groups, self.geometry.head_dim), self.quantization)

    def encode_paged(self, layer, key_states, value_states, meta):
        key_codec, value_codec = self.codecs[layer]
        return [key_codec.encode(key_states), value_codec.encode(value_states)]

    def write_paged(self, views, index, layer, meta, key_states, value_states):
        """Where the attention kernel reads the pool: each group's encoding and the write in one op
        (:func:`cache_backends.kernels.grouped_write`), then the groups the step drains quantized; else
        :meth:`encode_paged` and the write."""
        if not kernels.reads(views):
            return super().write_paged(views, index, layer, meta, key_states, value_states)
        key_codec, value_codec = self.codecs[layer]
        kernels.grouped_write(views, index, meta, key_states, value_states, key_codec.encode_m, value_codec.encode_m)
        drain_layer(views, index, meta.drain)

    def attend_paged(self, layer, query, reads, meta, scaling, module=None):
        """Grouped queries over the G shared heads: the key read-back folded into each query head
        (``q_h B^k_h^T``), the value read-back applied to each head's output; no head is rebuilt. Read in place, all
        three in one op (:func:`cache_backends.kernels.mapped_attention`)."""
        query_map, output_map = self._folded(layer)
        if isinstance(reads[0], InPlaceRead):
            return kernels.mapped_attention(query, reads[0], reads[1], meta, scaling, query_map, output_map)
        q = torch.einsum("bhrd,hed->bhre", query, query_map.to(query.dtype))
        out = attend_pair(q, reads[0], reads[1], meta, scaling)  # (B, Hq, n, d) in the shared heads' space
        return torch.einsum("bhrd,hde->bhre", out, output_map.to(out.dtype))

    def sums_spec(self) -> tuple[str, dict]:
        if self.quantization:  # gqa+int8/int4: the quantized sums with G heads in place of num_key_value_heads
            name, options = quant_spec(self.quantization)
            options.pop("rotate", None)  # a per-model constant: no byte per token
            return f"gqa+{name}", {"groups": self.groups, **options}
        return "gqa", {"groups": self.groups}

    def reserved_bytes(self, max_tokens: int) -> int:
        g = self.geometry
        per_layer = sum(storage_reserved_bytes(self.quantization, axis, max_tokens, self.groups, g.head_dim, g.dtype_bytes)
                        for axis in ("channel", "token"))
        return per_layer * g.num_layers
