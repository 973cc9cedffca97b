"""The model runner: owns the model, the KV pool and every tensor; turns scheduled rows into logits.

Every backend keeps its KV in the pool (:mod:`cache_backends.pool`): :meth:`ModelRunner.run_paged` runs one
forward for a step — its prefill chunks and one decode token of every running sequence; rows of different lengths
laid end to end as one flat row of tokens (a mixed batch) — through a :class:`StepCache`, which hands each layer's
new K/V to its backend's groups of rows: one write, one gather and one stored-form attention per group and layer
(:meth:`cache_backends.base.KVBackend.paged_layer` and ``attend_paged``). The per-sequence stores each backend
also keeps are run by :mod:`cache_backends.store_path` (the reference path), never here.
"""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from dataclasses import dataclass

from cache_backends.attention import install as install_attention
from cache_backends.base import KVBackend
from cache_backends.paged import PoolViews, drain_layer, drain_sources
from cache_backends.step_meta import Drain, StepMeta
from cache_backends.pool import KVPool
from server.engine.decode_linear import install as install_decode_linear
from server.engine.sampling import RowRequest, prompt_logprobs, sample_batch
from server.engine.step_plan import CompressPlan, RowPlan, RunnerOutput, SchedulerOutput

log = logging.getLogger("kvserve.runner")


@dataclass
class PagedGroup:
    """The rows of a step's batch that one paged backend serves, and that step's metadata for them.

    Attributes:
        backend: the rows' backend.
        views: its views of the pool.
        meta: the step's :class:`cache_backends.step_meta.StepMeta` for these rows (in this order).
        rows: the rows' indices in the batch (``None``: every row, in order); for a step of rows of one length.
        tokens: for a ragged step (rows of different lengths, flattened into one row of tokens), the (B_g * n,)
            token indices of these rows in the flat batch, row-major (``rows`` is then ``None``).
    """

    backend: KVBackend
    views: PoolViews
    meta: StepMeta
    rows: torch.Tensor | None
    tokens: torch.Tensor | None = None
    members: list[int] | None = None  # the rows' indices in the batch, as a list

    @property
    def whole(self) -> bool:
        """Whether the group is the whole step, in order (its tensors need no selecting)."""
        return self.rows is None and self.tokens is None

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The group's part of a step tensor: (B, H, n, d) batch rows, or (1, H, T, d) flat tokens → (B_g, H, n, d)."""
        if self.tokens is not None:
            h, d = x.shape[1], x.shape[-1]
            return x[0].index_select(1, self.tokens).view(h, self.meta.batch, self.meta.n, d).transpose(0, 1)
        return x if self.rows is None else x.index_select(0, self.rows)

    def put(self, out: torch.Tensor, o: torch.Tensor) -> None:
        """Write the group's (B_g, H, n, dv) output ``o`` into the step's output at its rows or tokens."""
        if self.tokens is not None:
            out[0].index_copy_(1, self.tokens, o.transpose(0, 1).reshape(o.shape[1], -1, o.shape[-1]))
        else:
            out[self.rows] = o


def _collect_feedback(groups: list[PagedGroup], feedback: dict | None) -> None:
    """Put what each group's backend measured in the forward (:meth:`KVBackend.step_feedback`) under its rows."""
    if feedback is None:
        return
    for group in groups:
        measured = group.backend.step_feedback(group.meta)
        if measured is not None:
            feedback.update(zip(group.members, measured))


class PagedRead:
    """What a :class:`StepCache` layer hands the attention function: it attends each group of rows in its
    backend's stored form, in one call per group."""

    def __init__(self, layer: int, parts: list, module=None):
        self.layer, self.parts, self.module = layer, parts, module

    def with_module(self, module) -> "PagedRead":
        """The same read with the model's attention module attached (native MLA's absorbed attention)."""
        return PagedRead(self.layer, self.parts, module)

    def attend(self, query: torch.Tensor, scaling: float, window: int | None = None) -> torch.Tensor:
        """(B, num_attention_heads, n, head_dim) queries → (B, num_attention_heads, n, v_head_dim); in a ragged
        step (1, num_attention_heads, T, head_dim) → (1, num_attention_heads, T, v_head_dim). ``window``: the
        layer's sliding window (each group's metadata narrowed to it, :meth:`StepMeta.windowed`)."""
        if len(self.parts) == 1 and self.parts[0][0].whole:
            group, reads = self.parts[0]
            return group.backend.attend_paged(self.layer, query, reads, self._meta(group, window), scaling,
                                              self.module)
        out = None
        for group, reads in self.parts:
            o = group.backend.attend_paged(self.layer, group.take(query), reads, self._meta(group, window), scaling,
                                           self.module)
            if out is None:
                out = o.new_empty(*query.shape[:-1], o.shape[-1])
            group.put(out, o)
        return out

    def _meta(self, group: "PagedGroup", window: int | None):
        """The group's step metadata for this layer: its window group's (a hybrid layout,
        :class:`cache_backends.hybrid.HybridStepMeta`), narrowed to ``window`` (:meth:`StepMeta.windowed`)."""
        meta = group.meta
        if hasattr(meta, "for_layer"):
            meta = meta.for_layer(self.layer)
        return meta if window is None else meta.windowed(window)


class _StepLayer(CacheLayerMixin):
    """One layer of :class:`StepCache`."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: "StepCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - never lazy
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the batch's new K/V (B, num_key_value_heads, n, head_dim), each group's rows into the pool in its
        stored form, and return ``(PagedRead, None)``."""
        i, parts = self.layer_idx, []
        for group in self.cache.groups:
            k, v = group.take(key_states), group.take(value_states)
            parts.append((group, group.backend.paged_layer(group.views, i, group.meta, k, v)))
        return PagedRead(i, parts), None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.past_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.past_len

    def get_max_length(self) -> int:
        return -1


class StepCache(Cache):
    """One step's batch seen by the model as one ``transformers.Cache``: groups of rows whose KV lives in the pool.

    Args:
        groups: the paged groups.
        past_len: the longest cached length in the batch before this step (what the model's mask helpers ask).
        num_layers: decoder layers.
    """

    def __init__(self, groups: list[PagedGroup], past_len: int, num_layers: int):
        self.groups, self.past_len = groups, past_len
        super().__init__(layers=[_StepLayer(self, i) for i in range(num_layers)])


class ModelRunner:
    """Runs the model's forward passes.

    Args:
        model: a loaded causal LM (``eval()`` mode).
        num_layers: decoder layers of ``model``.
        pool: the KV pool every backend's blocks live in.
    """

    def __init__(self, model, num_layers: int, pool: KVPool):
        self.model = model
        install_attention(model)  # the pool's reads are attended by kvserve's attention function
        install_decode_linear(model)  # a decode step's few rows through kvserve's linear kernel (CPU, fp32)
        self.num_layers = num_layers
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.pool = pool

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, backends: dict[str, KVBackend], sampling: dict[int, RowRequest],
                eos_token_ids=()) -> RunnerOutput:
        """Run one scheduled step: its compressions, then each ``alone`` row in a forward of its own, then every
        other row in one forward (a mixed batch), then sample every row that has a token to emit in one sampler
        call.

        Args:
            out: the scheduler's decision (rows, new pages, compressions).
            backends: served backends by name.
            sampling: each sampled row's request (parameters, tokens so far, generator), by ``seq_id``.
            eos_token_ids: ids masked for rows under ``min_tokens``.

        Returns:
            the sampled tokens, the prompt log-probabilities of ``all_logits`` rows, what the forwards measured for
            the commits (``feedback``), and the sequences whose forward or compression failed (with why; a failed
            compression's sequences are not run; the other rows are unaffected).

        Raises:
            what zeroing the step's new pages raises (the caller then fails every sequence of the step).
        """
        result = RunnerOutput()
        for c in out.compress:
            self._compress_plan(c, backends, result.failed)
        self.pool.zero(out.new_pages)
        last: dict[int, torch.Tensor] = {}  # seq_id -> (vocab_size,) logits of the row's last token
        for row in out.rows:
            if row.seq_id in result.failed:
                continue
            if row.alone:
                try:
                    logits = self._run_alone(row, backends, result.feedback)
                    if row.sample and row.all_logits:
                        top_n = sampling[row.seq_id].params.top_n
                        result.prompt_logprobs[row.seq_id] = prompt_logprobs(logits, row.token_ids, top_n)
                except Exception as exc:  # noqa: BLE001 - this request only
                    log.exception("prefill failed")
                    result.failed[row.seq_id] = f"prefill failed: {exc}"
                    continue
                if row.sample:
                    last[row.seq_id] = logits[-1]
        shared = [r for r in out.rows if not r.alone and r.seq_id not in result.failed]
        if shared:
            try:
                logits = self._run_rows(shared, backends, result.feedback)
            except Exception as exc:  # noqa: BLE001 - the step's rows only; the engine goes on
                log.exception("step failed")
                for r in shared:
                    result.failed[r.seq_id] = f"{'decode' if r.decode else 'prefill'} failed: {exc}"
            else:
                for i, r in enumerate(shared):
                    if r.sample:
                        last[r.seq_id] = logits[i]
        if last:
            ids = list(last)
            for seq_id, sampled in zip(ids, sample_batch(torch.stack([last[i] for i in ids]),
                                                         [sampling[i] for i in ids], eos_token_ids)):
                result.sampled[seq_id] = sampled
        return result

    def _compress_plan(self, plan: CompressPlan, backends: dict[str, KVBackend], failed: dict[int, str]) -> None:
        """Run one planned compression (:meth:`compress`); if it raises, its sequences go in ``failed``: their block
        tables already name codes that may not be written."""
        try:
            self.compress([(backends[plan.backend], list(plan.rows))], list(plan.pages))
        except Exception as exc:  # noqa: BLE001 - the compressed sequences only; the step goes on
            log.exception("compression failed")
            for seq_id in plan.seq_ids:
                failed.setdefault(seq_id, f"compression failed: {exc}")

    def _run_alone(self, row: RowPlan, backends: dict[str, KVBackend], feedback: dict) -> torch.Tensor:
        """A prompt in a forward of its own: (n, vocab_size) logits of every position with ``all_logits``, else
        (1, vocab_size) of its last."""
        measured: dict = {}
        logits = self.run_paged([list(row.token_ids)], [(backends[row.backend], [0], [(row.blocks, row.plan)])], [],
                                all_logits=row.all_logits, feedback=measured)
        if 0 in measured:
            feedback[row.seq_id] = measured[0]
        return logits[0] if row.all_logits else logits

    def _run_rows(self, rows: list[RowPlan], backends: dict[str, KVBackend], feedback: dict) -> torch.Tensor:
        """(len(rows), vocab_size) logits of each row's last token, every row in one forward."""
        groups: dict[str, tuple[list[int], list]] = {}
        for i, row in enumerate(rows):
            members, blocks = groups.setdefault(row.backend, ([], []))
            members.append(i)
            blocks.append((row.blocks, row.plan))
        measured: dict = {}
        logits = self.run_paged([list(r.token_ids) for r in rows],
                                [(backends[name], members, blocks) for name, (members, blocks) in groups.items()],
                                [], feedback=measured)
        feedback.update({rows[i].seq_id: m for i, m in measured.items()})
        return logits

    @torch.inference_mode()
    def run_paged(self, input_ids: list[list[int]], groups: list[tuple[KVBackend, list[int], list]],
                  new_pages: list[int], all_logits: bool = False, feedback: dict | None = None) -> torch.Tensor:
        """One forward over a step's batch: row ``i`` writes its ``len(input_ids[i])`` new tokens and attends to its
        cache.

        Rows of one length run as a (B, n) batch. Rows of different lengths (a mixed step: prefill chunks beside
        one-token decode rows, as vLLM v1's unified batch) run as one flat row of all their tokens, so every
        weight is read once for the whole step; each backend's rows of each length attend as one group
        (:class:`PagedGroup` ``tokens``).

        Args:
            input_ids: each row's new tokens (B rows).
            groups: ``(backend, rows, [(blocks, plan), ...])`` per backend: the rows it serves and each row's block
                tables (this step's pages already added) and plan.
            new_pages: pages handed out for this step (zeroed first).
            all_logits: logits of every new token (prompt log-probabilities) instead of the last.
            feedback: filled with what the forward measured per row, by row (:meth:`KVBackend.step_feedback`).

        Returns:
            (B, vocab_size) logits of each row's last token, or (B, n, vocab_size) with ``all_logits``.

        Raises:
            ValueError: ``all_logits`` for rows of different lengths.
        """
        lengths = [len(ids) for ids in input_ids]
        if len(set(lengths)) > 1:
            if all_logits:
                raise ValueError("a step of rows of different lengths returns each row's last logits only")
            return self._run_ragged(input_ids, lengths, groups, new_pages, feedback)
        batch = len(input_ids)
        ids = torch.tensor(input_ids, device=self.device)  # (B, n)
        positions = torch.empty_like(ids)
        paged, past = [], 0
        for backend, rows, blocks in groups:
            meta = backend.step_meta(self.pool.layouts[backend.name], blocks, self.device)
            index = None if rows == list(range(batch)) else torch.tensor(rows, device=self.device)
            positions[rows if index is None else index] = meta.query_positions
            paged.append(PagedGroup(backend, self.pool.views[backend.name], meta, index, members=rows))
            past = max(past, max(b.tokens for b, _ in blocks))
        self.pool.zero(new_pages)
        cache = StepCache(paged, past, self.num_layers)
        out = self.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                         logits_to_keep=0 if all_logits else 1)
        _collect_feedback(paged, feedback)
        return out.logits if all_logits else out.logits[:, -1]

    def _run_ragged(self, input_ids: list[list[int]], lengths: list[int], groups: list[tuple[KVBackend, list[int], list]],
                    new_pages: list[int], feedback: dict | None = None) -> torch.Tensor:
        """:meth:`run_paged` for rows of different lengths: one (1, T) forward of every row's tokens; (B, vocab_size)
        logits of each row's last token."""
        starts = [sum(lengths[:r]) for r in range(len(lengths))]
        ids = torch.tensor([[t for row in input_ids for t in row]], device=self.device)  # (1, T)
        positions = torch.empty_like(ids)
        paged, past = [], 0
        for backend, rows, blocks in groups:
            views = self.pool.views[backend.name]
            by_length: dict[int, tuple[list[int], list]] = {}
            for row, b in zip(rows, blocks):
                by_length.setdefault(lengths[row], ([], []))[0].append(row)
                by_length[lengths[row]][1].append(b)
            for n, (part, part_blocks) in by_length.items():
                meta = backend.step_meta(self.pool.layouts[backend.name], part_blocks, self.device)
                tokens = torch.tensor([starts[r] + j for r in part for j in range(n)], device=self.device)
                positions[0, tokens] = meta.query_positions.reshape(-1)
                paged.append(PagedGroup(backend, views, meta, None, tokens, members=part))
                past = max(past, max(b.tokens for b, _ in part_blocks))
        self.pool.zero(new_pages)
        cache = StepCache(paged, past, self.num_layers)
        last = torch.tensor([s + n - 1 for s, n in zip(starts, lengths)], device=self.device)
        out = self.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=last)
        _collect_feedback(paged, feedback)
        return out.logits[0]  # (B, vocab_size)

    @torch.inference_mode()
    def compress(self, groups: list[tuple[KVBackend, list]], new_pages: list[int]) -> None:
        """Quantize the oldest exact groups the plans name (``elastic`` under pool pressure): per backend,
        ``(backend, [(SeqBlocks, Plan), ...])`` with the plans' quantized pages already added (``new_pages``:
        they may be exact pages these very tokens leave, so every source is read before they are zeroed and
        written); one batched re-encoding per layer and stream. The caller commits the plans."""
        work = []
        for backend, rows in groups:
            views = self.pool.views[backend.name]
            drain = Drain(views.layout, rows, self.device)
            work.append((views, drain, [drain_sources(views, layer, drain) for layer in range(self.num_layers)]))
        self.pool.zero(new_pages)
        for views, drain, sources in work:
            for layer in range(self.num_layers):
                drain_layer(views, layer, drain, sources[layer])
