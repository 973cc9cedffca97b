"""``snapkv``: a prompt's tokens selected per layer and K/V head by its observation window (SnapKV, Li et al., arXiv
2404.14469).

Once a prompt of ``T`` tokens is prefilled (exactly: its attention is ``full``'s, or the inner tier's), every layer
keeps, in each K/V head, the ``capacity`` prompt tokens its observation window votes for: the last ``W`` prompt
tokens (``window``, default 32) and the ``capacity - W`` earlier ones with the highest pooled votes, where

* ``A = softmax(q_win k^T * scaling)``: (H, rep, W, T), the window's queries ``q_win`` (post-RoPE, the last ``W`` of the
  prompt, causal among themselves) against every prompt key ``k`` (H, T, d); ``rep`` query heads share a K/V head;
* ``votes = A[..., :T - W].sum(rep, W)``: (H, T - W), one vote per earlier token and K/V head;
* ``votes`` pooled over ``kernel`` neighbouring tokens (default 7, stride 1, centred: ``avg`` as the paper's code
  does by default, or ``max``), then the top ``capacity - W`` per head kept, in position order.

``capacity`` counts the window (the paper's ``max_capacity_prompt``), so a prompt of ``T <= capacity`` tokens is kept
whole (exact: ``full``'s tokens) and a longer one holds ``capacity`` tokens a layer; the tokens generated after the
prompt are appended and all kept. Keys are stored after RoPE, so a kept token keeps its original position; the next
query is at position ``T``.

Paged layout: the selection is compacted into the sequence's own pages, layer by layer and head by head: slot ``j``
of layer ``l``, head ``h`` holds the ``j``-th kept token of that layer and head (each layer's slab of a page is its own,
each head's run within it too: :class:`cache_backends.page_layout.Slab`), so one block table serves every layer's
different selection. The sequence's tables then describe ``capacity`` tokens (``SeqBlocks.first = T - capacity``: the
positions the engine gives the next queries, :class:`cache_backends.step_meta.StepMeta`, stay the real ones) and the
pages past them are freed at the step's commit (:class:`SnapLayout`). A prompt is prefilled in one step
(:attr:`SnapKVBackend.chunked_prefill` is ``False``, as ``dca``'s) so that its last queries see every prompt key.
``snapkv+int8`` / ``snapkv+int4``: the selected tokens are written as a new sequence of ``capacity`` tokens of the
inner tier (whole groups of codes, then its exact residual window), scored on the exact keys before quantization;
no full-precision copy of a dropped or quantized token stays in the pool. Bytes: ``min(T, capacity)`` tokens of the
inner form per layer for the prompt (:func:`cache_backends.snapkv.spec.snapkv_bytes`), what ``/info``, the metrics
and ``kvserve estimate`` say. A compacted layout is not prefix-cached (its pages hold a selection, not a prefix).

The per-sequence reference stores (:meth:`SnapKVBackend.new_store`: calibration, the quality budget) keep every token
of the inner backend and attend under the selection's mask (:class:`SnapLayer`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cache_backends.attention import causal_mask
from cache_backends.base import KVBackend
from cache_backends.full.backend import FullBackend
from cache_backends.geometry import ModelGeometry
from cache_backends.kv_spec import KVSpec
from cache_backends.kv_store import KVLayer, KVStore
from cache_backends.outer import InnerLayer, OuterBackend
from cache_backends.page_layout import PageLayout
from cache_backends.page_plan import Plan, SeqBlocks, TierPlan
from cache_backends.paged import write_layer
from cache_backends.snapkv.spec import (DEFAULT_CAPACITY, DEFAULT_KERNEL, DEFAULT_WINDOW, POOLINGS, check_options,
                                        snapkv_bytes)
from cache_backends.step_meta import Drain, StepMeta


def select_tokens(query: torch.Tensor, keys: torch.Tensor, scaling: float, capacity: int, window: int, kernel: int,
                  pooling: str = "avg") -> torch.Tensor:
    """SnapKV's selection for one sequence and layer: (H, capacity) indices of the kept prompt tokens, ascending.

    Args:
        query: (Hq, T, d) the prompt's queries after RoPE (only the last ``window`` are read).
        keys: (H, T, d) the prompt's keys after RoPE; ``Hq`` a multiple of ``H`` (query heads ``[h * rep, (h + 1) *
            rep)`` share K/V head ``h``, transformers' ``repeat_kv``).
        scaling: the softmax scale.
        capacity, window, kernel, pooling: the module's; ``T > capacity > window``.
    """
    h, t, d = keys.shape
    rep = query.shape[0] // h
    w = window
    q = query[:, t - w :].float().reshape(h, rep * w, d)
    scores = (q @ keys.float().transpose(-1, -2)) * scaling  # (H, rep * W, T)
    scores = scores.view(h, rep, w, t)
    seen = causal_mask(w, t, keys.device)  # (W, T): the window's query i sees tokens up to T - W + i
    if seen is not None:
        scores = scores.masked_fill(~seen, float("-inf"))
    votes = scores.softmax(dim=-1)[..., : t - w].sum(dim=(1, 2))  # (H, T - W)
    pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
    votes = pool(votes[:, None], kernel_size=kernel, stride=1, padding=kernel // 2)[:, 0]
    chosen = votes.topk(capacity - w, dim=-1).indices.sort(dim=-1).values
    recent = torch.arange(t - w, t, device=keys.device).expand(h, w)
    return torch.cat([chosen, recent], dim=-1)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(H, T, d) tokens at ``index`` (H, C) → (H, C, d): each head its own tokens."""
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))


class SnapStore(KVStore):
    """A per-sequence store that takes a prompt in one forward pass (its selection reads every prompt key)."""

    @property
    def supports_chunked_prefill(self) -> bool:
        return False


class SnapLayer(InnerLayer):
    """One layer of a per-sequence store: the inner backend's layer (every token, in its stored form) attended, once
    its prompt was longer than the capacity, under the selection's mask (tokens generated after it all seen).

    Args:
        inner: the inner backend's layer.
        backend: the :class:`SnapKVBackend` (its options).
    """

    def __init__(self, inner: KVLayer, backend: "SnapKVBackend"):
        super().__init__(inner)
        self.backend = backend
        self.keep: torch.Tensor | None = None  # (H, T) bool over the prompt's tokens once selected
        self._prompt_keys: torch.Tensor | None = None
        self.decided = False

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if not self.decided:  # the prompt's exact keys (scored before any quantization, as the paged path does)
            self._prompt_keys = key_states if self._prompt_keys is None else torch.cat([self._prompt_keys,
                                                                                        key_states], dim=-2)
        self.inner.append(key_states, value_states)

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """(1, Hq, q_len, d) → (1, Hq, q_len, dv): the prompt's own attention exact; later queries see the kept
        prompt tokens and every token after the prompt."""
        if not self.decided:
            out = self.inner.attend(query, scaling)
            self.decided, keys, self._prompt_keys = True, self._prompt_keys, None
            b = self.backend
            if keys.shape[-2] > b.capacity and query.shape[-2] == keys.shape[-2]:
                index = select_tokens(query[0], keys[0], scaling, b.capacity, b.window, b.kernel, b.pooling)
                self.keep = torch.zeros(keys.shape[1], keys.shape[-2], dtype=torch.bool, device=keys.device)
                self.keep.scatter_(1, index, True)
            return out
        if self.keep is None:
            return self.inner.attend(query, scaling)
        keys, values = self.inner.materialize()
        heads, total, q_len = keys.shape[1], keys.shape[-2], query.shape[-2]
        seen = torch.ones(heads, total, dtype=torch.bool, device=keys.device)
        seen[:, : self.keep.shape[1]] = self.keep
        causal = causal_mask(q_len, total, keys.device)
        mask = seen[:, None, :] if causal is None else seen[:, None, :] & causal[None]
        mask = mask.repeat_interleave(query.shape[1] // heads, dim=0)[None]  # (1, Hq, q_len, T)
        return F.scaled_dot_product_attention(query, keys.to(query.dtype), values.to(query.dtype), attn_mask=mask,
                                              scale=scaling, enable_gqa=query.shape[1] != heads)

    def reset(self) -> None:
        super().reset()
        self.keep, self._prompt_keys, self.decided = None, None, False


class SnapPlan(Plan):
    """A sequence's first step (its whole prompt, longer than the capacity): the step's :class:`Plan`, and ``kept``,
    the tokens each layer keeps once it ran."""

    def __init__(self, plan: Plan, kept: int):
        super().__init__(plan.n, plan.drained, plan.new_exact_pages, plan.new_q_pages, plan.free_front,
                         plan.free_q_front)
        self.kept = kept


class SnapLayout(PageLayout):
    """The pages of a snapkv sequence: the inner backend's layout, but a first step longer than ``capacity`` leaves
    the tables of a ``capacity``-token sequence (the module), from position ``T - capacity`` on.

    Args:
        spec, dtype, page_bytes: :class:`PageLayout`'s.
        capacity: tokens a prompt keeps.
    """

    cacheable = False  # its pages hold each layer's selection, not a prefix of the tokens

    def __init__(self, spec: KVSpec, dtype: torch.dtype, page_bytes: int, capacity: int):
        super().__init__(spec, dtype, page_bytes)
        self.capacity = capacity
        self.plain = TierPlan(self.exact_tokens, self.q_tokens, self.quantization)  # the inner layout's planning
        # of the kept tokens, those held as codes (whole groups before the residual window), as a sequence of
        # ``capacity`` tokens written at once holds them; 0 without a quantized tier
        self.kept_drained = self.plain.plan(SeqBlocks(), capacity).drained

    def plan(self, blocks: SeqBlocks, n: int) -> Plan:
        """The inner layout's plan; for a first step of more than ``capacity`` tokens a :class:`SnapPlan`."""
        plan = super().plan(blocks, n)
        if blocks.tokens == 0 and blocks.first == 0 and n > self.capacity:
            return SnapPlan(plan, self.capacity)
        return plan

    def commit(self, blocks: SeqBlocks, plan: Plan, feedback=None) -> list[int]:
        """Apply ``plan``; after a compacting step keep the pages of the ``capacity`` tokens (codes first, then the
        exact ones, slot ``j`` the ``j``-th kept token) and return every other page of the step."""
        kept = getattr(plan, "kept", 0)
        if not kept:
            return super().commit(blocks, plan, feedback)
        te, drained = self.exact_tokens, self.kept_drained
        lo, hi = drained // te, math.ceil(kept / te)
        freed = blocks.exact[:lo] + blocks.exact[hi:]
        blocks.exact[:] = blocks.exact[lo:hi]
        blocks.start, blocks.exact_len = drained - lo * te, kept - drained
        if self.quantization:
            q_pages = math.ceil(drained / self.q_tokens)
            freed += blocks.q[q_pages:]
            del blocks.q[q_pages:]
            blocks.q_len = drained
        blocks.first += plan.n - kept
        return freed

    def pages_to_generate(self, prompt: int, total: int, chunk: int | None = None) -> int:
        """The prompt's step (every prompt token's pages), or the kept tokens' and every generated token's."""
        most = self.pages_for(prompt, chunk)
        kept = min(prompt, self.capacity)
        return max(most, self.plain.pages_to_generate(kept, kept + total - prompt))


class _Compaction:
    """Where a step's compacting rows write their kept tokens: slots ``[0, capacity)`` of each row's exact pages
    (what :func:`cache_backends.paged.write_layer` reads: ``write_pages``, ``write_slots``, ``drain``), the whole
    groups before the residual window then quantized into the first slots of its quantized pages.

    Args:
        layout: the backend's :class:`SnapLayout`.
        rows: the compacting rows' tables (the step's pages added).
        device: where the index tensors go.
    """

    def __init__(self, layout: SnapLayout, rows: list[SeqBlocks], device):
        te, kept, drained = layout.exact_tokens, layout.capacity, layout.kept_drained
        pages = [b.exact[j // te] for b in rows for j in range(kept)]
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        self.write_pages, self.write_slots = as_long(pages), as_long([j % te for _ in rows for j in range(kept)])
        fresh = [(SeqBlocks(exact=b.exact, q=b.q), Plan(kept, drained, 0, 0, 0)) for b in rows]
        self.drain = Drain(layout, fresh, device)


class SnapKVBackend(OuterBackend):
    """SnapKV (arXiv 2404.14469; the module): each layer and K/V head keeps ``capacity`` prompt tokens.

    Args:
        geometry: the model's attention shape.
        capacity: prompt tokens kept per layer and head, the window included (``KV_SNAPKV_CAPACITY``, 1024).
        window: the observation window (``KV_SNAPKV_WINDOW``, 32), below ``capacity``.
        kernel: the pooling kernel (``KV_SNAPKV_KERNEL``, 7), odd.
        pooling: ``avg`` or ``max`` (``KV_SNAPKV_POOLING``).
        inner: what the kept tokens are stored as: ``full`` (default) or ``int8``/``int4`` (``snapkv+int8``).

    Raises:
        ValueError: an option out of its bounds (naming it), ``window >= capacity``, an even ``kernel`` or one over
            ``capacity - window``.
    """

    name = "snapkv"
    chunked_prefill = False  # the selection reads every prompt key against the prompt's last queries
    attends_in_place = True

    def __init__(self, geometry: ModelGeometry, capacity: int = DEFAULT_CAPACITY, window: int = DEFAULT_WINDOW,
                 kernel: int = DEFAULT_KERNEL, pooling: str = "avg", inner: KVBackend | None = None):
        for option, value, low in (("capacity", capacity, 2), ("window", window, 1), ("kernel", kernel, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"snapkv: {option} must be an integer >= {low}, got {value!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"snapkv: pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        check_options(capacity, window, kernel)
        inner = inner if inner is not None else FullBackend(geometry)
        super().__init__(geometry, capacity=capacity, window=window, kernel=kernel, pooling=pooling, **inner.options)
        self.inner, self.capacity, self.window, self.kernel, self.pooling = inner, capacity, window, kernel, pooling
        self.quantization = inner.quantization

    # ---- the per-sequence reference stores ---------------------------------------------------------------
    def new_layer(self, index: int, position_offset: int = 0) -> KVLayer:
        return SnapLayer(self.inner.new_layer(index, position_offset), self)

    def new_store(self) -> KVStore:
        return SnapStore([self.new_layer(i) for i in range(self.geometry.num_layers)])

    # ---- what it costs ----------------------------------------------------------------------------------
    def sums_options(self) -> dict:
        return {"capacity": self.capacity}

    def bytes_per_token_per_layer(self, seq_len: int = 1024) -> float:
        """``min(seq_len, capacity)`` tokens of the inner form a layer, averaged over ``seq_len``
        (:func:`cache_backends.snapkv.spec.snapkv_bytes`)."""
        return snapkv_bytes(self.kv_spec(), self.capacity, seq_len)

    def live_bytes_per_token_per_layer(self, store: KVStore) -> float:
        """The inner form's bytes at the tokens ``store`` holds (a compacted sequence's kept prompt tokens and every
        token after them), which :meth:`bytes_per_token_per_layer`, a prompt's, is not once decode tokens are added."""
        return self.kv_spec().bytes_per_token_per_layer(store.num_tokens())

    def drops_tokens(self, seq_len: int) -> bool:
        """A prompt longer than the capacity loses tokens."""
        return seq_len > self.capacity

    def window_warning(self, priced_tokens: int) -> str | None:
        """What to say when the quality budget prices on windows of ``priced_tokens`` tokens, which a capacity of
        at least as many never drops (its price there is 0); ``None`` when the price sees drops."""
        if self.capacity < priced_tokens:
            return None
        return (f"{self.name} keeps whole every prompt of at most its capacity of {self.capacity} tokens, yet the "
                f"quality budget prices it on windows of {priced_tokens} tokens, which it never compresses: its "
                "price there is 0 and says nothing about longer prompts, where it loses what it did not select "
                "(docs/backends.md, 'snapkv')")

    def details(self) -> dict:
        return {"capacity": self.capacity, "window": self.window, "kernel": self.kernel, "pooling": self.pooling}

    # ---- the paged pool --------------------------------------------------------------------------------
    def page_layout(self, dtype: torch.dtype, page_bytes: int) -> SnapLayout:
        return SnapLayout(self.kv_spec(), dtype, page_bytes, self.capacity)

    def step_meta(self, layout, rows: list, device):
        """The inner layout's :class:`StepMeta`, with :attr:`snap` set (the compacting rows' indices and their
        :class:`_Compaction`) when a row's plan is a :class:`SnapPlan`, else ``None``."""
        meta = StepMeta(layout, rows, device)
        members = [i for i, (_, plan) in enumerate(rows) if getattr(plan, "kept", 0)]
        meta.snap = None
        if members:
            meta.snap = (members, _Compaction(layout, [rows[i][0] for i in members], device))
        return meta

    def paged_layer(self, views, layer: int, meta, key_states: torch.Tensor, value_states: torch.Tensor) -> list:
        """The inner backend's write and reads; a compacting step also keeps the layer's exact new K/V (the whole
        prompt) and views for :meth:`attend_paged`."""
        if getattr(meta, "snap", None) is not None:
            meta.snap_kv = (views, key_states, value_states)
        return super().paged_layer(views, layer, meta, key_states, value_states)

    def attend_paged(self, layer, query, reads, meta, scaling, module=None):
        """The inner backend's attention (exact over the whole prompt); then, on a compacting step, each compacting
        row's selection (:func:`select_tokens`) written over the first slots of its pages in this layer (the
        attention read them already; later layers' slabs are their own)."""
        out = self.inner.attend_paged(layer, query, reads, meta, scaling, module)
        snap = getattr(meta, "snap", None)
        if snap is not None:
            members, compaction = snap
            views, keys, values = meta.snap_kv
            meta.snap_kv = None
            kept_k, kept_v = [], []
            for i in members:
                index = select_tokens(query[i], keys[i], scaling, self.capacity, self.window, self.kernel,
                                      self.pooling)
                kept_k.append(gather_tokens(keys[i], index))
                kept_v.append(gather_tokens(values[i], index))
            kept_k, kept_v = torch.stack(kept_k), torch.stack(kept_v)
            write_layer(views, layer, compaction, self.inner.encode_paged(layer, kept_k, kept_v, compaction))
        return out
