"""``mla``: a low-rank latent KV cache.

Post-hoc on an MHA/GQA model (Palu, arXiv 2407.21118; MHA2MLA, arXiv 2502.14837): per layer, the keys
*before* RoPE and the values of a token are concatenated, x = [K_pre ; V] (2 * H * d wide, H =
num_key_value_heads, d = head_dim), and projected onto a rank-r basis P fitted on the calibration
slice (principal components of x around its mean mu): the cache stores only the latent
c = (x - mu) P, r values per token. When a layer attends, K_pre and V are rebuilt as c P^T + mu and RoPE
is applied to K at each cached token's own position. Keys arrive from the model after RoPE; the layer
undoes RoPE exactly (a rotation) before projecting. At r = 2 * H * d the rebuild is exact.

Storage per sequence and layer: ``latent`` of shape (1, 1, seq_len, r) in the model's dtype
(``mla+int8``: int8 per channel over token groups, with a full-precision residual window).
Bytes per token per layer: ``r * dtype_bytes``. P (2Hd x r) and mu are per-model constants, fitted once and kept in the
calibration cache (:mod:`cache_backends.calibration_cache`, keyed by r).

Native MLA models (DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3 in transformers): the model itself computes
the latent c_KV (``kv_lora_rank`` wide, after its layer norm) and one shared rope key (``qk_rope_head_dim``)
and hands exactly these to the cache (transformers' DeepseekV3Attention expands them into per-head K/V
only after the cache read). The backend then caches the model's own latent and rope key, unchanged and
without calibration: (1, 1, seq_len, kv_lora_rank) and (1, 1, seq_len, qk_rope_head_dim). Bytes per token
per layer: ``(kv_lora_rank + qk_rope_head_dim) * dtype_bytes``. ``KV_MLA_RANK`` must then be unset or
equal to ``kv_lora_rank``.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from cache_backends.absorbed_mla import absorbed_attention, install_absorbed_attention
from cache_backends.attention import grouped_query, ungroup
from cache_backends.base import KVBackend
from cache_backends.geometry import ModelGeometry
from cache_backends.kv_store import KVLayer, KVStore
from cache_backends.full.backend import FullLayer
from cache_backends.int8.backend import make_storage, quant_spec, storage_reserved_bytes
from cache_backends.kv_spec import KVSpec, Quantization, StreamSpec
from cache_backends.paged import InPlaceRead, StreamRead, drain_layer
from cache_backends import kernels
from cache_backends.paged_attention import group_mask, grouped_rows, masked_softmax, ungroup_rows
from cache_backends.quant_formats import width_refusal
from cache_backends.rope import RopeTable

FIT_VERSION = 1  # of the calibration cache entry (bump when the fit changes)


class LatentBasis:
    """One layer's projection: ``basis`` (2*H*d, r) with orthonormal columns, ``mean`` (2*H*d,).

    ``explained`` is, after :meth:`fit`, the share of the calibration variance of [K_pre ; V] the basis
    keeps (1 - the relative squared error of the rebuild, on the calibration slice); ``None`` otherwise.
    """

    def __init__(self, basis: torch.Tensor, mean: torch.Tensor, explained: float | None = None):
        self.basis = basis
        self.mean = mean
        self.explained = explained

    @classmethod
    def fit(cls, keys: torch.Tensor, values: torch.Tensor, rank: int) -> "LatentBasis":
        """Principal components of [K_pre ; V].

        Args:
            keys: (tokens, H, d) pre-RoPE calibration keys.
            values: (tokens, H, d) calibration values.
            rank: latent width r (<= 2 * H * d).
        """
        x = torch.cat([keys.flatten(1), values.flatten(1)], dim=1).double()  # (tokens, 2Hd)
        mean = x.mean(0)
        xc = x - mean
        vals, vecs = torch.linalg.eigh(xc.T @ xc)  # ascending
        basis = vecs[:, -rank:].flip(-1)  # (2Hd, r), strongest first
        explained = (vals[-rank:].sum() / vals.sum().clamp_min(1e-30)).item()
        return cls(basis.float(), mean.float(), explained)


class MLALayer(KVLayer):
    """One layer's latent cache, (1, 1, seq_len, rank), held exactly or as int8 (``mla+int8``).

    Args:
        basis: the layer's projection.
        rope: the model's RoPE table.
        heads, head_dim: H and d.
        quantization: ``None`` or int8 options (the latent is quantized per channel over token groups,
            since principal components differ in scale by orders of magnitude).
        position_offset: the position of the first token this layer will hold.
    """

    def __init__(self, basis: LatentBasis, rope: RopeTable, heads: int, head_dim: int,
                 quantization: Quantization | None = None, position_offset: int = 0):
        super().__init__()
        self.p = basis
        self.rope = rope
        self.heads, self.head_dim = heads, head_dim
        self.quantization = quantization
        self.position_offset = position_offset
        self.latent = make_storage("channel", self.quantization)
        hd = heads * head_dim
        rank = basis.basis.shape[1]
        # P_v per head, (H, r, d), and the value mean per head, (H, 1, d): the absorbed value side.
        self.value_up = basis.basis[hd:].reshape(heads, head_dim, rank).transpose(1, 2)
        self.value_mean = basis.mean[hd:].reshape(heads, 1, head_dim)

    def reserve(self, max_tokens: int) -> None:
        self.latent.reserve(max_tokens)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store the new tokens' latents.

        Args:
            key_states: (1, H, new, d) after RoPE, at positions ``offset + seq_len ..``.
            value_states: (1, H, new, d).
        """
        b, h, n, d = key_states.shape
        k_pre = self.rope.invert(key_states, self.position_offset + self.latent.length)  # (b, H, n, d)
        x = torch.cat([k_pre.transpose(1, 2).reshape(b, n, h * d), value_states.transpose(1, 2).reshape(b, n, h * d)],
                      dim=-1)  # (b, n, 2Hd)
        basis, mean = self.p.basis.to(x.dtype), self.p.mean.to(x.dtype)
        self.latent.append(((x - mean) @ basis).unsqueeze(1))  # (b, 1, n, r)

    def _keys(self, latent: torch.Tensor) -> torch.Tensor:
        """Keys after RoPE rebuilt from the latent (b, T, r) → (b, H, T, d) (transient)."""
        b, t, _ = latent.shape
        h, d = self.heads, self.head_dim
        basis, mean = self.p.basis[: h * d].to(latent.dtype), self.p.mean[: h * d].to(latent.dtype)
        keys = (latent @ basis.T + mean).reshape(b, t, h, d).transpose(1, 2)
        return self.rope.apply(keys, self.position_offset)

    def materialize(self):
        latent = self.latent.read()[:, 0]  # (b, T, r)
        b, t, _ = latent.shape
        h, d = self.heads, self.head_dim
        values = latent @ self.p.basis[h * d :].to(latent.dtype).T + self.p.mean[h * d :].to(latent.dtype)
        return self._keys(latent), values.reshape(b, t, h, d).transpose(1, 2)

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Decode with the value side absorbed: ``o_h = (p_h C) P_v,h^T + mu_v,h`` (the weights sum to 1),
        so values are never rebuilt; keys are rebuilt from the latent because RoPE, applied per position
        after the up-projection, blocks folding P_k into the query (the "RoPE price" of post-hoc MLA)."""
        if query.shape[-2] > 1:
            return super().attend(query, scaling)
        h, d = self.heads, self.head_dim
        keys = self._keys(self.latent.read()[:, 0])  # (1, H, T, d)
        q = grouped_query(query, h)  # (1, H, rep, d)
        probs = torch.softmax((q @ keys.transpose(-1, -2)) * scaling, dim=-1)  # (1, H, rep, T)
        rep = q.shape[2]
        mixed = self.latent.weighted_sum(probs.reshape(1, 1, h * rep, -1))  # (1, 1, H*rep, r)
        out = mixed.reshape(h, rep, -1) @ self.value_up.to(mixed.dtype) + self.value_mean.to(mixed.dtype)
        return ungroup(out.unsqueeze(0))  # (1, Hq, 1, d)

    def get_seq_length(self) -> int:
        return self.latent.length

    def reset(self) -> None:
        self.latent.release()
        self.is_initialized = False

    def nbytes(self) -> int:
        return self.latent.nbytes()

    def allocated_bytes(self) -> int:
        return self.latent.allocated_bytes()


class NativeLatentLayer(FullLayer):
    """A native-MLA model's own cache entries, appended in place: what the model hands as "keys" is the
    latent c_KV (1, 1, T, kv_lora_rank) and as "values" the shared rope key (1, 1, T, qk_rope_head_dim).
    Decode attends to them with absorbed attention (:class:`AbsorbedRead`), never through
    :meth:`FullLayer.attend`.

    Args:
        quantization: ``None`` (exact), or int8 options (``mla+int8``): both streams quantized per channel over
            groups of ``group_size`` tokens, the newest ``residual`` tokens in full precision (KIVI's keys).
    """

    def __init__(self, quantization: Quantization | None = None):
        super().__init__()
        if quantization:
            self.key_store = make_storage("channel", quantization)
            self.value_store = make_storage("channel", quantization)


class MLABackend(KVBackend):
    """Post-hoc joint K/V latent (calibrated PCA).

    Args:
        geometry: the model's attention shape.
        rank: latent width per token per layer (``KV_MLA_RANK``); default ``2 * H * d / 8``
            (8x smaller than ``full``); at most ``2 * H * d``.

    Raises:
        ValueError: if ``rank`` is outside 1 .. 2 * num_key_value_heads * head_dim.
    """

    name = "mla"

    @classmethod
    def compose(cls, geometry: ModelGeometry, inner: KVBackend, **options) -> "MLABackend":
        """``mla+int8``/``mla+int4``: the latent stored in ``inner``'s quantized tier.

        Raises:
            ValueError: a 4-bit tier and an odd rank (two channels share a byte).
        """
        tier = inner.quantization
        backend = cls(geometry, quantization=tier, **options)
        why = width_refusal(backend.rank, f"rank={backend.rank}", tier.key_bits, tier.value_bits)
        if why:
            raise ValueError(f"mla+{inner.name}: {why}")
        return backend

    def __init__(self, geometry: ModelGeometry, rank: int | None = None, quantization: Quantization | None = None):
        self.native = bool(geometry.kv_lora_rank)
        if self.native:
            if rank not in (None, geometry.kv_lora_rank):
                raise ValueError(f"KV_MLA_RANK={rank}: this model is natively MLA and caches its own latent of "
                                 f"kv_lora_rank={geometry.kv_lora_rank}; leave KV_MLA_RANK unset or equal to it")
            super().__init__(geometry, rank=geometry.kv_lora_rank, rope_dim=geometry.rope_dim, native=True,
                             **(quant_spec(quantization)[1] if quantization else {}))
            self.rank, self.quantization, self.bases, self.rope = geometry.kv_lora_rank, quantization, None, None
            return
        width = 2 * geometry.num_key_value_heads * geometry.head_dim
        rank = max(1, width // 8) if rank is None else rank
        if not 1 <= rank <= width:
            raise ValueError(f"KV_MLA_RANK={rank} must be between 1 and 2*num_key_value_heads*head_dim={width}")
        super().__init__(geometry, rank=rank, **(quant_spec(quantization)[1] if quantization else {}))
        self.rank, self.quantization = rank, quantization
        self.bases: list[LatentBasis] | None = None
        self.rope: RopeTable | None = None

    def prepare(self, model, calibration_ids: list[int] | None = None, cache=None) -> None:
        """Fit one basis per layer on the calibration slice (a progress bar shows it), or load it from
        ``cache`` (keyed by the rank); on native MLA, switch the model's attention to absorbed attention over
        the cached latent (no calibration)."""
        if self.native:
            install_absorbed_attention(model)
            return
        from cache_backends.calibration import calibration_ids as calib_ids
        from cache_backends.calibration_cache import CalibrationCache

        ids = calibration_ids if calibration_ids is not None else calib_ids(model)
        device = next(model.parameters()).device
        self.bases = (cache or CalibrationCache()).fetch(
            "mla", model, ids, {"rank": self.rank}, fit=lambda: self._fit(model, ids),
            load=lambda tensors, _: self._load(tensors, device), version=FIT_VERSION)
        self.rope = RopeTable(model, model.config.max_position_embeddings)

    def _fit(self, model, ids: list[int]) -> tuple[dict[str, torch.Tensor], dict]:
        """Per layer i: ``{i}.basis`` (2Hd, r) and ``{i}.mean`` (2Hd,); figures: each layer's explained variance."""
        from cache_backends.calibration import collect_kv

        kv = collect_kv(model, self.geometry, ids, desc="mla calibration")
        tensors, explained = {}, []
        for i, (k, v) in enumerate(tqdm(kv, desc="mla bases", leave=False, disable=None)):
            b = LatentBasis.fit(k, v, self.rank)
            tensors[f"{i}.basis"], tensors[f"{i}.mean"] = b.basis, b.mean
            explained.append(round(b.explained, 6))
        return tensors, {"explained_variance": explained}

    def _load(self, tensors: dict[str, torch.Tensor], device) -> list[LatentBasis]:
        from cache_backends.calibration_cache import take

        width = 2 * self.geometry.num_key_value_heads * self.geometry.head_dim
        return [LatentBasis(take(tensors, f"{i}.basis", (width, self.rank)).to(device),
                            take(tensors, f"{i}.mean", (width,)).to(device)) for i in range(self.geometry.num_layers)]

    def new_layer(self, index: int, position_offset: int = 0) -> KVLayer:
        if self.native:
            return NativeLatentLayer(self.quantization)  # what the model hands over: its latent and its rope key
        if self.bases is None:
            raise RuntimeError("mla backend used before prepare(model)")
        g = self.geometry
        return MLALayer(self.bases[index], self.rope, g.num_key_value_heads, g.head_dim, self.quantization, position_offset)

    #: Native: the model's latent and rope key go through the attention kernel (absorbed attention); post-hoc: the
    #: latent goes through its post-hoc form (:func:`cache_backends.kernels.latent_attention`: keys rebuilt block by
    #: block inside the op, values absorbed); both where the kernel reads the pages (exact ones, and ``mla+int8`` /
    #: ``mla+int4``'s codes; a rotated post-hoc tier is gathered, :func:`cache_backends.kernels.fits`).
    attends_in_place = True

    def new_store(self) -> KVStore:
        """One sequence's store; on a native-MLA model it is read in place by absorbed attention."""
        return KVStore([self.new_layer(i) for i in range(self.geometry.num_layers)], in_place=True)

    # ---- paged: one latent stream (post-hoc), or the model's latent and rope key (native) ----------------
    def kv_spec(self) -> KVSpec:
        """A block holds, post-hoc, the latent, (1, rank) per token; native, the model's latent (1, kv_lora_rank)
        and its shared rope key (1, qk_rope_head_dim). Every stream is grouped per channel under int8."""
        streams = [StreamSpec(1, self.rank)] + ([StreamSpec(1, self.geometry.rope_dim)] if self.native else [])
        return self._kv_spec(streams, self.quantization)

    def encode_paged(self, layer, key_states, value_states, meta):
        """Native: what the model hands over, as it is. Post-hoc: the latent ``([K_pre ; V] - mu) P`` of each new
        token, with RoPE undone at the token's own position; (B, 1, n, rank)."""
        if self.native:
            return [key_states, value_states]
        b, h, n, d = key_states.shape
        k_pre = self.rope.invert_at(key_states, meta.query_positions)  # (B, H, n, d)
        x = torch.cat([k_pre.transpose(1, 2).reshape(b, n, h * d), value_states.transpose(1, 2).reshape(b, n, h * d)],
                      dim=-1)  # (B, n, 2Hd)
        p = self.bases[layer]
        return [((x - p.mean.to(x.dtype)) @ p.basis.to(x.dtype)).unsqueeze(1)]

    def write_paged(self, views, index, layer, meta, key_states, value_states):
        """Post-hoc, where the attention kernel reads the pool: the encoding and the write in one op
        (:func:`cache_backends.kernels.latent_write`, the latent in fp32), then the groups the step drains quantized;
        else :meth:`encode_paged` and the write."""
        if self.native or not kernels.reads(views):
            return super().write_paged(views, index, layer, meta, key_states, value_states)
        p = self.bases[layer]  # fp32, as fitted: the op reads it as it is
        cos, sin = self.rope.float_tables(meta.query_stop)
        kernels.latent_write(views, index, meta, key_states, value_states, p.basis, p.mean, cos, sin)
        drain_layer(views, index, meta.drain)

    def attend_paged(self, layer, query, reads, meta, scaling, module=None):
        """Native: absorbed attention over the latent and rope key (:func:`absorbed_attention`). Post-hoc: keys
        rebuilt from the latent and rotated at each token's position (the RoPE price), values absorbed:
        ``o_h = (p_h C) P_v,h^T + mu_v,h``; in place, one op (:func:`cache_backends.kernels.latent_attention`), else
        over the gathered latent with torch ops."""
        if self.native:
            return absorbed_attention(query, reads[0], reads[1], meta, scaling, module)
        g, p = self.geometry, self.bases[layer]
        h, d, b, hq = g.num_key_value_heads, g.head_dim, query.shape[0], query.shape[1]
        if isinstance(reads[0], InPlaceRead):  # one op: keys (and for a prefill, values) rebuilt block by block
            cos, sin = self.rope.float_tables(meta.query_stop)
            return kernels.latent_attention(query, reads[0], meta, scaling, self._kernel_bases(layer), cos, sin)
        latent = reads[0].read()[0]  # (B, T, r)
        keys = latent @ p.basis[: h * d].to(latent.dtype).T + p.mean[: h * d].to(latent.dtype)
        keys = self.rope.apply_at(keys.reshape(b, -1, h, d).transpose(1, 2), meta.positions)  # (B, H, T, d)
        q = grouped_rows(query, h)  # (B, H, rep * n, d)
        probs = masked_softmax(q @ keys.transpose(-1, -2), group_mask(meta.mask, hq // h), scaling)
        rows = q.shape[2]
        mixed = reads[0].weighted_sum(probs.reshape(1, b, h * rows, -1))[0].reshape(b, h, rows, -1)
        value_up = p.basis[h * d :].reshape(h, d, -1).transpose(1, 2)  # (H, r, d)
        value_mean = p.mean[h * d :].reshape(h, 1, d)
        return ungroup_rows(mixed @ value_up.to(mixed.dtype) + value_mean.to(mixed.dtype), hq)

    def _kernel_bases(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer ``layer``'s bases per KV head for the kernel, in fp32, built once: the keys' (H, r, d) and mean (H, d),
        the values' (H, r, d) and mean (H, d); with a rotated tier also (2, H, r, d), both bases times its rotation."""
        cache = self.__dict__.setdefault("_kernel_basis_cache", {})
        p = self.bases[layer]
        if layer not in cache or cache[layer][0] is not p:  # built anew for a basis fitted or loaded since
            h, d = self.geometry.num_key_value_heads, self.geometry.head_dim
            up = p.basis.float().reshape(2, h, d, -1).transpose(2, 3)  # (K/V, H, r, d)
            mean = p.mean.float().reshape(2, h, d)
            bases = (up[0].contiguous(), mean[0].contiguous(), up[1].contiguous(), mean[1].contiguous())
            if self.quantization and self.quantization.rotate:  # codes of c R: rebuilt with R P (R its own inverse)
                from cache_backends.quant import hadamard

                r = hadamard(up.shape[2], torch.float32, up.device)
                bases += (torch.einsum("rs,khsd->khrd", r, up).contiguous(),)
            cache[layer] = (p, bases)
        return cache[layer][1]

    def _rebuild(self, layer: int, latent: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, r) latent at ``positions`` (B, T) → keys after RoPE and values, (B, H, T, d) each."""
        g, p = self.geometry, self.bases[layer]
        h, d, b = g.num_key_value_heads, g.head_dim, latent.shape[0]
        x = latent @ p.basis.to(latent.dtype).T + p.mean.to(latent.dtype)  # (B, T, 2Hd)
        keys = self.rope.apply_at(x[..., : h * d].reshape(b, -1, h, d).transpose(1, 2), positions)
        return keys, x[..., h * d :].reshape(b, -1, h, d).transpose(1, 2)

    def stored_kv(self, layer, reads, meta):
        """Post-hoc: the K/V the gathered latent stands for, rebuilt (transient; keys rotated at each token's
        position), heads first."""
        if self.native:
            raise NotImplementedError("native MLA caches the model's own latent: no per-head K/V to rebuild")
        keys, values = self._rebuild(layer, reads[0].read()[0], meta.positions)
        return StreamRead(keys.transpose(0, 1), None, "channel", 0), StreamRead(values.transpose(0, 1), None, "token", 0)

    def as_stored(self, layer, key_states, value_states, meta):
        """The new tokens' K/V after the latent round trip (encode, then rebuild at their positions)."""
        latent = self.encode_paged(layer, key_states, value_states, meta)[0][:, 0]  # (B, n, r)
        return self._rebuild(layer, latent, meta.query_positions)

    def sums_spec(self) -> tuple[str, dict]:
        spec = {"rank": self.rank, "rope_dim": self.geometry.rope_dim if self.native else 0}
        if not self.quantization:
            return "mla", spec
        # mla+int8/int4: the latent (native: and the rope key) quantized per channel; no per-token scales
        name, options = quant_spec(self.quantization)
        options.pop("rotate", None)  # a per-model constant: no byte per token
        return f"mla+{name}", {**spec, **options}

    def reserved_bytes(self, max_tokens: int) -> int:
        g = self.geometry
        if self.native and self.quantization:
            return sum(storage_reserved_bytes(self.quantization, "channel", max_tokens, 1, width, g.dtype_bytes)
                       for width in (self.rank, g.rope_dim)) * g.num_layers
        if self.native:
            return super().reserved_bytes(max_tokens)
        return storage_reserved_bytes(self.quantization, "channel", max_tokens, 1, self.rank, g.dtype_bytes) * g.num_layers
