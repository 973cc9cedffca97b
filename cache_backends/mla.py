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
Bytes per token per layer: ``r * dtype_bytes``. P (2Hd x r) and mu are per-model constants.

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

from cache_backends.base import KVBackend, KVLayer, ModelGeometry, make_storage
from cache_backends.estimate import int8_latent_bytes_per_token_per_layer, mla_bytes_per_token_per_layer
from cache_backends.rope import RopeTable


class LatentBasis:
    """One layer's projection: ``basis`` (2*H*d, r) with orthonormal columns, ``mean`` (2*H*d,)."""

    def __init__(self, basis: torch.Tensor, mean: torch.Tensor):
        self.basis = basis
        self.mean = mean

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
        _, vecs = torch.linalg.eigh(xc.T @ xc)
        basis = vecs[:, -rank:].flip(-1)  # (2Hd, r), strongest first
        return cls(basis.float(), mean.float())


class MLALayer(KVLayer):
    """One layer's latent cache, (1, 1, seq_len, rank), held exactly or as int8 (``mla+int8``).

    Args:
        basis: the layer's projection.
        rope: the model's RoPE table.
        heads, head_dim: H and d.
        quantize: ``None`` or int8 options (the latent is quantized per channel over token groups,
            since principal components differ in scale by orders of magnitude).
        position_offset: the position of the first token this layer will hold.
    """

    def __init__(self, basis: LatentBasis, rope: RopeTable, heads: int, head_dim: int, quantize: dict | None = None,
                 position_offset: int = 0):
        super().__init__()
        self.p = basis
        self.rope = rope
        self.heads, self.head_dim = heads, head_dim
        self.quantize = quantize
        self.position_offset = position_offset
        self.reset()

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens' latents; return keys (RoPE re-applied) and values rebuilt from all latents.

        Args:
            key_states: (1, H, new, d) after RoPE, at positions ``offset + seq_len ..``.
            value_states: (1, H, new, d).

        Returns:
            keys, values of shape (1, H, seq_len + new, d).
        """
        self.is_initialized = True
        b, h, n, d = key_states.shape
        k_pre = self.rope.invert(key_states, self.position_offset + self.latent.length)  # (b, H, n, d)
        x = torch.cat([k_pre.transpose(1, 2).reshape(b, n, h * d), value_states.transpose(1, 2).reshape(b, n, h * d)],
                      dim=-1)  # (b, n, 2Hd)
        basis, mean = self.p.basis.to(x.dtype), self.p.mean.to(x.dtype)
        self.latent.append(((x - mean) @ basis).unsqueeze(1))  # (b, 1, n, r)
        return self.materialize()

    def materialize(self):
        latent = self.latent.read()[:, 0]  # (b, T, r)
        b, t, _ = latent.shape
        h, d = self.heads, self.head_dim
        rebuilt = latent @ self.p.basis.to(latent.dtype).T + self.p.mean.to(latent.dtype)  # (b, T, 2Hd), transient
        keys = rebuilt[..., : h * d].reshape(b, t, h, d).transpose(1, 2)
        values = rebuilt[..., h * d :].reshape(b, t, h, d).transpose(1, 2)
        return self.rope.apply(keys, self.position_offset), values

    def get_seq_length(self) -> int:
        return self.latent.length

    def reset(self) -> None:
        self.latent = make_storage("channel", self.quantize)
        self.is_initialized = False

    def nbytes(self) -> int:
        return self.latent.nbytes()


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

    def __init__(self, geometry: ModelGeometry, rank: int | None = None, quantize: dict | None = None):
        self.native = bool(geometry.kv_lora_rank)
        if self.native:
            if rank not in (None, geometry.kv_lora_rank):
                raise ValueError(f"KV_MLA_RANK={rank}: this model is natively MLA and caches its own latent of "
                                 f"kv_lora_rank={geometry.kv_lora_rank}; leave KV_MLA_RANK unset or equal to it")
            if quantize:
                raise ValueError("mla+int8 is supported on post-hoc latents (MHA/GQA models), not native MLA")
            super().__init__(geometry, rank=geometry.kv_lora_rank, rope_dim=geometry.rope_dim, native=True)
            self.rank, self.quantize, self.bases, self.rope = geometry.kv_lora_rank, None, None, None
            return
        width = 2 * geometry.num_key_value_heads * geometry.head_dim
        rank = max(1, width // 8) if rank is None else rank
        if not 1 <= rank <= width:
            raise ValueError(f"KV_MLA_RANK={rank} must be between 1 and 2*num_key_value_heads*head_dim={width}")
        super().__init__(geometry, rank=rank, **(quantize or {}))
        self.rank, self.quantize = rank, quantize
        self.bases: list[LatentBasis] | None = None
        self.rope: RopeTable | None = None

    def prepare(self, model, calibration_ids: list[int] | None = None) -> None:
        """Fit one basis per layer on the calibration slice (a progress bar shows it); nothing on native MLA."""
        if self.native:
            return
        from cache_backends.calibration import calibration_ids as calib_ids
        from cache_backends.calibration import collect_kv

        ids = calibration_ids if calibration_ids is not None else calib_ids(model)
        kv = collect_kv(model, self.geometry, ids, desc="mla calibration")
        device = next(model.parameters()).device
        self.bases = []
        for k, v in tqdm(kv, desc="mla bases", leave=False):
            b = LatentBasis.fit(k, v, self.rank)
            self.bases.append(LatentBasis(b.basis.to(device), b.mean.to(device)))
        self.rope = RopeTable(model, model.config.max_position_embeddings)

    def new_layer(self, index: int, position_offset: int = 0) -> KVLayer:
        if self.native:
            from cache_backends.full import FullLayer

            return FullLayer()  # holds exactly what the model hands over: its latent and its rope key
        if self.bases is None:
            raise RuntimeError("mla backend used before prepare(model)")
        g = self.geometry
        return MLALayer(self.bases[index], self.rope, g.num_key_value_heads, g.head_dim, self.quantize, position_offset)

    def bytes_per_token_per_layer(self, seq_len: int = 1024) -> float:
        if self.native:
            g = self.geometry
            return mla_bytes_per_token_per_layer(g.kv_lora_rank, g.rope_dim, g.dtype_bytes)
        if self.quantize:  # mla+int8: one "head" of width r, quantized per channel; no per-token scales
            q = self.quantize
            return int8_latent_bytes_per_token_per_layer(self.rank, self.geometry.dtype_bytes, q["group_size"],
                                                         q["residual"], seq_len)
        return mla_bytes_per_token_per_layer(self.rank, 0, self.geometry.dtype_bytes)
