"""``dca`` in the paged pool, one step: the kept layers' and each reuse candidate's step metadata, a source layer's
K/V as the candidate after it reads them, and a candidate's attention through its map and its own pages (gathered,
or read in place by the attention kernel)."""

from __future__ import annotations

import torch

from cache_backends.base import KVBackend
from cache_backends.dca.maps import LayerMap
from cache_backends.dca.plan import DCALayout, Feedback
from cache_backends import kernels
from cache_backends.paged import InPlaceRead, StreamRead, read_layer
from cache_backends.paged_attention import grouped_rows, ungroup_rows
from cache_backends.step_meta import StepMeta


# ---- the paged pool: kept layers in one group of pages, each reuse candidate in its own (.plan) ------------------
class DCAStepMeta:
    """One step's metadata for a backend's dca rows: a :class:`cache_backends.step_meta.StepMeta` of the kept layers'
    group and one of each candidate's, and what the forward measures (read back by :meth:`DCABackend.step_feedback`).

    Args:
        layout: the backend's :class:`cache_backends.dca.plan.DCALayout`.
        rows: each sequence's :class:`~cache_backends.dca.plan.DCABlocks` (this step's pages added) and
            :class:`~cache_backends.dca.plan.DCAPlan`, in batch order.
        device: where the index tensors go.

    Attributes:
        kept, candidates: the groups' step metadata (``candidates[i]`` over candidate ``i``'s own tokens, from each
            row's ``first``).
        own_from: per candidate, per row, the first position read from its own pages (plain ints; a probe that makes
            the layer fall back moves its row's to the plan's ``own_from_fallback`` within the step).
        sources: layer → a source layer's :class:`_Source` in this step, kept for the candidate after it.
        feedback: per row, the similarities measured (:class:`cache_backends.dca.plan.Feedback`).
    """

    def __init__(self, layout: DCALayout, rows: list[tuple], device):
        self.layout, self.rows = layout, rows
        self.kept = StepMeta(layout.groups[0], [(b.groups[0], p.groups[0]) for b, p in rows], device)
        self.candidates = [StepMeta(layout.groups[1 + i], [(b.groups[1 + i], p.groups[1 + i]) for b, p in rows],
                                    device, exact_rows=[p.exact_rows[1 + i] for _, p in rows])
                           for i in range(len(layout.candidates))]
        self.query_positions, self.n, self.batch = self.kept.query_positions, self.kept.n, self.kept.batch
        self.own_from = [[p.own_from[i] for _, p in rows] for i in range(len(layout.candidates))]
        widths = [m.positions.shape[1] for m in (self.kept, *self.candidates)]
        self.position_limit = max(b.length for b, _ in rows) + self.n + max(widths)  # every gathered position below
        self.sources: dict[int, tuple] = {}
        self.feedback = [Feedback() for _ in rows]


class _Source:
    """A source layer's step, as the reuse candidate after it reads it: the K/V its gathered pages stand for and its
    new tokens' K/V as stored (:meth:`KVBackend.stored_kv`, :meth:`KVBackend.as_stored`), each computed once, when
    first asked for (``mla`` rebuilds them from its latent: not for a step no row reads or probes)."""

    def __init__(self, inner: KVBackend, layer: int, reads: list, meta: StepMeta, key_states, value_states):
        self.inner, self.layer, self.reads, self.meta, self.new = inner, layer, reads, meta, (key_states, value_states)
        self._kv = None

    def kv(self) -> tuple:
        if self._kv is None:
            self._kv = self.inner.stored_kv(self.layer, gathered(self.reads, self.meta), self.meta)
        return self._kv

    def new_as_stored(self) -> tuple:
        return self.inner.as_stored(self.layer, *self.new, self.meta)


def gathered(reads: list, meta: StepMeta) -> list[StreamRead]:
    """``reads`` as gathered streams: those read in place (:class:`cache_backends.paged.InPlaceRead`) gathered now."""
    if reads and isinstance(reads[0], InPlaceRead):  # every stream of the layer, in one gather
        return read_layer(reads[0].views, reads[0].layer, meta)
    return reads


class _CandidateRead:
    """What a candidate layer hands its attention: which candidate it is, its own tokens' stored form (in place, or
    gathered), and (:meth:`own_kv`, when the torch path needs them) the K/V they stand for
    (:meth:`KVBackend.stored_kv`)."""

    def __init__(self, index: int, own: list, inner: KVBackend, layer: int, meta: StepMeta):
        self.index, self.own, self._inner, self._layer, self._meta = index, own, inner, layer, meta

    def own_kv(self) -> tuple:
        return self._inner.stored_kv(self._layer, gathered(self.own, self._meta), self._meta)


def _exact_mask(meta: StepMeta) -> torch.Tensor:
    """A prefill step's mask (B, n, Tq + Te) reading every row's tokens from its exact slots (written first, still
    there for the tokens the step quantizes) and none as codes: causal over the tokens the rows hold."""
    tq = meta.q_width
    exact = meta.positions[:, tq:]  # (B, Te): the exact slots' positions (before the step's drain moved them)
    end = meta.query_positions[:, -1:] + 1  # (B, 1)
    seen = (exact[:, None, :] <= meta.query_positions[:, :, None]) & (exact < end)[:, None, :]
    return torch.cat([torch.zeros_like(meta.mask[..., :tq]), seen], dim=-1)


def _exact_ranges(meta: StepMeta, mask: torch.Tensor) -> torch.Tensor | None:
    """:attr:`StepMeta.ranges` (its shape) saying what an exact-only ``mask`` (:func:`_exact_mask`) says: no codes,
    each query's exact slots ``[lo, hi)``; ``None`` where a query's slots are not one interval."""
    seen = mask[..., meta.q_width:]  # (B, n, Te)
    count = seen.sum(-1)
    lo = seen.int().argmax(-1)
    hi = torch.where(count > 0, seen.shape[-1] - seen.flip(-1).int().argmax(-1), lo)
    if bool((hi - lo != count).any()):
        return None
    ranges = torch.zeros_like(meta.ranges)
    ranges[..., 1], ranges[..., 2] = lo, hi
    return ranges


def _similarity_rows(own_k, own_v, pred_k, pred_v) -> list[float]:
    """Per row, (cos(K) + cos(V)) / 2 averaged over heads and tokens: (B, H, n, d) inputs → B floats."""
    cos = torch.nn.functional.cosine_similarity
    both = cos(own_k.float(), pred_k.float(), dim=-1) + cos(own_v.float(), pred_v.float(), dim=-1)  # (B, H, n)
    return (0.5 * both.mean(dim=(1, 2))).tolist()


def attend_through_map(layer_map: LayerMap, query: torch.Tensor, src: list[StreamRead], src_meta: StepMeta,
                       own: list[StreamRead], own_meta: StepMeta, own_from: torch.Tensor, scaling: float,
                       limit: int) -> torch.Tensor:
    """A candidate layer's attention for a batch: the positions before each row's ``own_from`` through its source's
    stored K/V read with the map folded in (:meth:`LayerMap.attend`, batched), the later ones from its own pages,
    in one softmax.

    Args:
        query: (B, Hq, n, d) after RoPE.
        src, src_meta: the source layer's gathered keys and values (H heads) and the kept group's step metadata.
        own, own_meta: this layer's own gathered keys and values and its group's step metadata.
        own_from: (B,) the first position each row reads from its own pages.
        limit: above every gathered position (:attr:`DCAStepMeta.position_limit`).

    Returns:
        (B, Hq, n, d).
    """
    b, hq, n, d = query.shape
    h = src[0].exact.shape[0]
    gq = grouped_rows(query, h).transpose(0, 1)  # (H, B, rep * n, d)
    if layer_map.key_mix is None:  # the source's K/V as they are
        from_source = src[0].dot(gq).transpose(0, 1).reshape(b, hq, n, -1)
    else:
        key_fold, value_map, value_bias = layer_map._per_query_head(hq)
        folded = (query.float() @ key_fold).view(b, hq, n, h, d).permute(3, 0, 1, 2, 4).reshape(h, b, hq * n, d)
        from_source = src[0].dot(folded.to(query.dtype)).sum(0).view(b, hq, n, -1)  # (B, Hq, n, Ts)
        bias = layer_map.bias_at(src_meta.positions, limit, query.dtype)  # (H, B, Ts, d)
        from_source = from_source + (gq @ bias.transpose(-1, -2)).transpose(0, 1).reshape(b, hq, n, -1)
    from_own = own[0].dot(gq).transpose(0, 1).reshape(b, hq, n, -1)  # (B, Hq, n, To)
    src_mask = src_meta.mask & (src_meta.positions < own_from[:, None])[:, None, :]  # (B, n, Ts)
    own_mask = own_meta.mask & (own_meta.positions >= own_from[:, None])[:, None, :]  # (B, n, To)
    mask = torch.cat([src_mask, own_mask], dim=-1)[:, None]  # (B, 1, n, Ts + To)
    scores = torch.cat([from_source, from_own], dim=-1) * scaling
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # (B, Hq, n, Ts + To)
    ts = from_source.shape[-1]
    p_src, p_own = probs[..., :ts], probs[..., ts:]
    own_out = own[1].weighted_sum(grouped_rows(p_own, h).transpose(0, 1))  # (H, B, rep * n, d)
    own_out = ungroup_rows(own_out.transpose(0, 1), hq)  # (B, Hq, n, d)
    if layer_map.key_mix is None:
        src_out = ungroup_rows(src[1].weighted_sum(grouped_rows(p_src, h).transpose(0, 1)).transpose(0, 1), hq)
        return (src_out + own_out).to(query.dtype)
    weights = p_src.reshape(1, b, hq * n, ts).expand(h, b, hq * n, ts)
    mixed = src[1].weighted_sum(weights).view(h, b, hq, n, d).permute(1, 2, 3, 0, 4).reshape(b, hq, n, h * d)
    # the value map in fp32 (see LayerMap.attend)
    out = mixed.float() @ value_map + value_bias[None, :, None, :] * p_src.sum(-1, keepdim=True).float()
    return (out + own_out.float()).to(query.dtype)


def cuts_at(src_meta: StepMeta, own_meta: StepMeta, own_from: list[int]) -> list[int]:
    """Where each row's tokens split between a reuse layer's source and its own pages, as
    :func:`cache_backends.kernels.dca_attention` takes it: four ints a row, its own pages' first exact slot and first
    code seen, its source's exact slots' and codes' ends (what :meth:`StepMeta.ranges_from` and
    :meth:`StepMeta.ranges_before` cut at ``own_from``), in plain ints: no tensor op."""
    cuts = []
    for p, (src_shift, src_first), (own_shift, own_first) in zip(own_from, src_meta.row_offsets,
                                                                   own_meta.row_offsets):
        cuts += [max(p + own_shift, 0), max(p - own_first, 0), max(p + src_shift, 0), max(p - src_first, 0)]
    return cuts


def attend_in_place_through_map(layer_map: LayerMap, query: torch.Tensor, src: list, src_meta: StepMeta, own: list,
                                own_meta: StepMeta, own_from: list[int], scaling: float, limit: int,
                                latents: tuple = ()) -> torch.Tensor:
    """:func:`attend_through_map`'s attention with both layers' pages read in place by the kernel, in one op
    (:func:`cache_backends.kernels.dca_attention`): the layer's own tokens (positions from each row's ``own_from``)
    and its source's (those before) with the map folded in (every source head scored at once, the key bias rotated
    inside the op; with no map, the source's K/V as they are), merged as one softmax over both.

    Args:
        query: (B, Hq, n, d) after RoPE.
        src, own: the source layer's and this layer's :class:`cache_backends.paged.InPlaceRead` (K/V pairs of H heads,
            or post-hoc latents: :func:`cache_backends.kernels.reads_dca`); src_meta, own_meta: their groups' step
            metadata.
        own_from: per row, the first position it reads from its own pages (plain ints).
        limit: above every position the step reads (:attr:`DCAStepMeta.position_limit`).
        latents: for post-hoc latents (``dca+mla``), ``(source layer's bases, own bases, cos, sin)``
            (:func:`cache_backends.kernels.dca_attention`).

    Returns:
        (B, Hq, n, d) in the query's dtype.
    """
    if layer_map.key_mix is None:  # the source's K/V as they are
        map_args = []
    else:
        key_fold, value_map, value_bias = layer_map._per_query_head(query.shape[1])
        map_args = [key_fold, value_map, value_bias, layer_map.key_bias, *layer_map.rope.float_tables(limit)]
    return kernels.dca_attention(query, src[0], src_meta, own[0], own_meta, cuts_at(src_meta, own_meta, own_from),
                                 scaling, map_args, latents)
