"""``dca``'s layer maps: a layer's keys and values predicted from the layer before it through a calibrated map that
commutes with RoPE (per frequency pair a complex mix across heads for keys, a linear map for values; ridge least
squares), and attention through such a map with the map folded into the query (:meth:`LayerMap.attend`)."""

from __future__ import annotations

import torch

from cache_backends.rope import RopeTable

RIDGE = 1e-5  # ridge of the map fits, relative to the mean diagonal of the Gram matrix (see LayerMap.fit)


def _complex(x: torch.Tensor) -> torch.Tensor:
    """(..., d) real → (..., d/2) complex: channel i pairs with i + d/2 (transformers' rotate_half layout)."""
    half = x.shape[-1] // 2
    return torch.complex(x[..., :half], x[..., half:])


def _real(z: torch.Tensor) -> torch.Tensor:
    return torch.cat([z.real, z.imag], dim=-1)


def ridge_solve(x: torch.Tensor, y: torch.Tensor, ridge: float) -> torch.Tensor:
    """argmin_w |x w - y|^2 + λ |w[:-1]|^2 with λ = ``ridge`` x mean(diag(x^H x)): the last column of ``x`` is
    the bias (ones) and is not shrunk. ``x`` (n, k), ``y`` (n, m), real or complex, float64 → w (k, m)."""
    gram = x.conj().T @ x
    shrink = torch.ones(gram.shape[0], dtype=torch.float64)
    shrink[-1] = 0
    gram = gram + torch.diag(ridge * gram.diagonal().real.mean() * shrink).to(gram.dtype)
    return torch.linalg.solve(gram, x.conj().T @ y)


class LayerMap:
    """Predicts layer l's K (after RoPE) and V from its source layer m's, in a form attention can fold.

    Keys: per rotary frequency pair i, the destination's pair of head h is a complex combination of the
    source's pairs over heads, plus a bias: ``z_l[h,i] = Σ_g A[h,g,i] z_m[g,i] + b[h,i]`` (pre-RoPE).
    RoPE multiplies every head's pair i by the same phase, so the map commutes with it: post-RoPE
    source keys map to post-RoPE destination keys (the bias rotated to each position), and a query
    folds the map in: ``q_h · K̂_{h,t} = Σ_g (conj(A[h,g]) ⊙ q_h) · K_{g,t} + q_h · R_t b_h``.
    Values: ``V̂_l[h] = Σ_g V_m[g] W[g,h] + c_h``, applied after attention:
    ``o_h = Σ_g (Σ_t p_{h,t} V_{m,g,t}) W[g,h] + c_h``.

    Args:
        key_mix: (H, H, d/2) complex ``A`` (destination head, source head, pair); ``None`` for ``none``.
        key_bias: (H, d) pre-RoPE bias (real layout).
        value_map: (H, H, d, d) ``W`` (source head, destination head, in, out); value_bias: (H, d).
        rope: the model's RoPE table.
    """

    def __init__(self, key_mix, key_bias, value_map, value_bias, rope: RopeTable):
        self.key_mix, self.key_bias = key_mix, key_bias
        self.value_map, self.value_bias = value_map, value_bias
        self.rope = rope

    @classmethod
    def fit(cls, src_k, src_v, dst_k, dst_v, rope: RopeTable, ridge: float = RIDGE) -> "LayerMap":
        """Ridge least squares on calibration K (pre-RoPE) and V, each (tokens, H, d).

        Plain least squares is ill-conditioned here (neighbouring layers' channels are nearly collinear): on
        the reference model its value maps had column L1 norms up to ~6600, so the 0.4% error of int8-stored
        source values became a 57% error in the prediction (similarity 0.98 → 0.69 in ``dca+int8``). A ridge
        of ``ridge`` x the mean diagonal of the Gram matrix (not on the bias) keeps the norms under ~70 at a
        cost of at most 0.0002 in exact-source similarity (:func:`ridge_solve`).
        """
        n, h, d = src_k.shape
        ones = torch.ones(n, 1, dtype=torch.complex128)
        zs, zd = _complex(src_k.double()), _complex(dst_k.double())  # (tokens, H, d/2)
        mix = torch.zeros(h, h, d // 2, dtype=torch.complex128)
        bias = torch.zeros(h, d // 2, dtype=torch.complex128)
        for i in range(d // 2):
            sol = ridge_solve(torch.cat([zs[:, :, i], ones], 1), zd[:, :, i], ridge)  # (H + 1, H)
            mix[:, :, i] = sol[:h].T
            bias[:, i] = sol[h]
        x = torch.cat([src_v.flatten(1).double(), torch.ones(n, 1, dtype=torch.float64)], 1)
        w = ridge_solve(x, dst_v.flatten(1).double(), ridge)  # (Hd + 1, Hd)
        value_map = w[:-1].reshape(h, d, h, d).permute(0, 2, 1, 3)  # (source, destination, in, out)
        return cls(mix.to(torch.complex64), _real(bias).float(), value_map.float(), w[-1].reshape(h, d).float(), rope)

    def predict_pre_rope(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Calibration-side prediction: (tokens, H, d) pre-RoPE source K and V → predicted K (pre-RoPE), V."""
        z = torch.einsum("hgi,ngi->nhi", self.key_mix, _complex(keys.float()))
        v_hat = torch.einsum("ngd,ghde->nhe", values.float(), self.value_map) + self.value_bias
        return _real(z) + self.key_bias, v_hat

    def to(self, device) -> "LayerMap":
        if self.key_mix is not None:
            self.key_mix, self.key_bias = self.key_mix.to(device), self.key_bias.to(device)
            self.value_map, self.value_bias = self.value_map.to(device), self.value_bias.to(device)
            self._by_query_head = self._bias_table = None
        return self

    def _per_query_head(self, hq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The maps laid out per query head as real matrices (constants, built once per head count), so that
        a decode step applies each with one batched product:

        * key fold (Hq, d, H·d): query head q's row ``q @ fold[q]`` is, per source head g, the query that scores
          g's stored keys as the mapped keys: per pair i, ``conj(A[h, g, i]) * q_i`` as a real 2x2 block
          ((a, -b), (b, a)) on (q_i, q_{i + d/2}), with h the query head's K/V head;
        * value map (Hq, H·d, d): the attention-weighted source values of every source head, concatenated,
          times it give the query head's output;
        * value bias (Hq, d)."""
        cached = getattr(self, "_by_query_head", None)
        if cached is None or cached[0] != hq:
            h, d = self.key_bias.shape
            head = torch.arange(hq, device=self.key_bias.device) // (hq // h)  # each query head's K/V head
            mix = self.key_mix[head]  # (Hq, H, d/2) complex
            a, b, i = mix.real, mix.imag, torch.arange(d // 2, device=mix.device)
            fold = torch.zeros(hq, h, d, d, device=mix.device)  # (query head, source head, in, out)
            fold[..., i, i], fold[..., i + d // 2, i] = a, b
            fold[..., i, i + d // 2], fold[..., i + d // 2, i + d // 2] = -b, a
            value_map = self.value_map[:, head].permute(1, 0, 2, 3).reshape(hq, h * d, d)
            cached = (hq, fold.permute(0, 2, 1, 3).reshape(hq, d, h * d), value_map.contiguous(),
                      self.value_bias[head])
            self._by_query_head = cached
        return cached[1:]

    def _rotated_bias(self, start: int, n: int, dtype) -> torch.Tensor:
        """The key bias after RoPE at positions start .. start + n - 1: (H, n, d)."""
        stop = start + n
        table = getattr(self, "_bias_table", None)
        if table is None or table.shape[1] < stop or table.dtype != dtype:  # a per-model constant, grown x2
            h, d = self.key_bias.shape
            size = max(stop, 2 * table.shape[1] if table is not None else 1024)
            table = self.rope.apply(self.key_bias.to(dtype)[:, None, :].expand(h, size, d), 0)
            self._bias_table = table
        return table[:, start:stop]

    def bias_at(self, positions: torch.Tensor, limit: int, dtype) -> torch.Tensor:
        """The key bias after RoPE at ``positions`` (B, T), each below ``limit`` (a padded slot's is clamped: its
        score is masked): (H, B, T, d)."""
        return self._rotated_bias(0, limit, dtype)[:, positions.clamp(max=limit - 1)]

    def predict(self, keys: torch.Tensor, values: torch.Tensor, start: int | torch.Tensor,
                limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H, n, d) source K (after RoPE) and V at positions ``start``.. (every row), or at ``start`` (B, n)
        positions of each row (all below ``limit``) → predicted K (after RoPE) and V."""
        if self.key_mix is None:
            return keys, values
        z = torch.einsum("hgi,bgni->bhni", self.key_mix, _complex(keys.float()))
        if isinstance(start, int):
            bias = self._rotated_bias(start, keys.shape[-2], keys.dtype)  # (H, n, d)
        else:
            bias = self.bias_at(start, limit, keys.dtype).transpose(0, 1)  # (B, H, n, d)
        k_hat = _real(z).to(keys.dtype) + bias
        v_hat = torch.einsum("bgnd,ghde->bhne", values.float(), self.value_map)  # fp32: see attend
        return k_hat, (v_hat + self.value_bias[None, :, None, :]).to(values.dtype)

    def attend(self, query: torch.Tensor, key_stream, value_stream, length: int, scaling: float,
               own_keys: torch.Tensor | None = None, own_values: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention of one query over the predicted K/V of the first ``length`` positions, read from the
        source's stored streams, and (optionally) the layer's own K/V of the positions after them, in one softmax.

        Args:
            query: (1, Hq, 1, d) after RoPE.
            key_stream, value_stream: the source's key and value storage (``dot``/``weighted_sum``), H heads;
                it may hold more than ``length`` tokens (those are served by ``own_keys``).
            length: positions served from the source.
            own_keys, own_values: (1, H, w, d), the layer's own K/V of positions ``length .. length + w - 1``.

        Returns:
            (1, Hq, 1, d).
        """
        _, hq, _, d = query.shape
        h = self.key_bias.shape[0]
        key_fold, value_map, value_bias = self._per_query_head(hq)
        q = query[0, :, 0]  # (Hq, d)
        grouped = q.reshape(h, hq // h, d)  # each K/V head's query heads together
        folded = (q.float()[:, None, :] @ key_fold).view(hq, h, d).to(q.dtype)  # (Hq, H, d), in fp32 (see below)
        scores = key_stream.dot(folded.transpose(0, 1)[None]).sum(1)[0]  # (Hq, stored)
        stored = scores.shape[-1]
        bias = self._rotated_bias(0, length, q.dtype)  # (H, length, d)
        scores = scores[:, :length] + torch.einsum("grd,gtd->grt", grouped, bias).reshape(hq, length)
        if own_keys is not None:
            own = torch.einsum("grd,gtd->grt", grouped, own_keys[0]).reshape(hq, -1)
            scores = torch.cat([scores, own], dim=-1)
        probs = torch.softmax(scores * scaling, dim=-1)  # (Hq, length [+ w])
        from_source = probs[:, :length]
        if stored > length:  # the source's newer tokens carry no weight here
            from_source = torch.nn.functional.pad(from_source, (0, stored - length))
        mixed = value_stream.weighted_sum(from_source[None, None].expand(1, h, hq, stored))[0]  # (H, Hq, d)
        # The value map is applied in fp32 (a (H, Hq, d, d) product, nothing per token): its weights are
        # large enough (column L1 norms up to ~70 after the ridge) that bf16 rounding would show.
        out = (mixed.float().transpose(0, 1).reshape(hq, 1, h * d) @ value_map)[:, 0]  # (Hq, d)
        out = out + value_bias * probs[:, :length].sum(-1, keepdim=True).float()
        if own_values is not None:
            window = probs[:, length:].reshape(h, hq // h, -1)
            out = out + (window @ own_values[0]).reshape(hq, d).float()
        return out.to(query.dtype)[None, :, None, :]


def fit_full_linear_map(src_k, src_v, dst_k, dst_v) -> torch.Tensor:
    """The unrestricted least-squares affine map [K ; V] → [K ; V] (pre-RoPE), (2Hd + 1, 2Hd): reported in
    calibration as the fidelity ceiling of a linear predictor (it does not commute with RoPE, so serving
    it means rebuilding every source token per step)."""
    x = torch.cat([src_k.flatten(1), src_v.flatten(1), torch.ones(src_k.shape[0], 1)], 1).double()
    y = torch.cat([dst_k.flatten(1), dst_v.flatten(1)], 1).double()
    return torch.linalg.lstsq(x, y).solution.float()


