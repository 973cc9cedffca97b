"""The model runner: owns the model, the KV pool and every tensor; turns scheduled sequences into logits.

Paged backends (every backend but ``dca``, and ``full`` on a native-MLA model) keep their KV in the pool
(:mod:`cache_backends.pool`): :meth:`ModelRunner.run_paged` runs one forward for a step — its prefill chunks
and one decode token of every running sequence; rows of different lengths laid end to end as one flat row of
tokens (a mixed batch) — through a :class:`StepCache`, which hands
each layer's new K/V to its backend's groups of rows (one write, one gather and one stored-form attention
per group and layer, :mod:`cache_backends.paged`) and its per-sequence stores to the other rows.

Per-sequence stores (``dca``; transformers-style caches): prefill runs one sequence at a time (batch 1, a whole prompt or one chunk of it) into that sequence's
own KV store. Decode runs all active sequences in one batched forward over a ragged batch:
:class:`RaggedView` presents the per-sequence stores to the model as one ``transformers.Cache``; each
layer writes every sequence's new K/V into its own store (in place) and hands the attention a
:class:`cache_backends.attention.BatchRead`, so each sequence attends to its own cache at its own
length, in its backend's stored form: no padded copy of the context, no mask. Models whose attention
needs K/V tensors after the cache read (native MLA, DeepSeek-V3) use :class:`BatchedView` instead,
which left-pads rebuilt K/V to the longest sequence under a 4-D mask (transient, one layer at a time).
"""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from dataclasses import dataclass

from cache_backends.attention import BatchRead, as_read
from cache_backends.attention import install as install_attention
from cache_backends.base import KVBackend, KVStore
from cache_backends.paged import Drain, PoolViews, StepMeta, drain_layer, drain_sources
from cache_backends.pool import KVPool
from server.engine.sampling import RowRequest, prompt_logprobs, sample_batch
from server.engine.step_plan import RowPlan, RunnerOutput, SchedulerOutput

log = logging.getLogger("kvserve.runner")


class _BatchedLayerView(CacheLayerMixin):
    """One layer of :class:`BatchedView`: fans the batch's new K/V out to each sequence's store."""

    is_sliding = False
    is_compileable = False

    def __init__(self, stores: list[KVStore], layer_idx: int, past_len: int):
        super().__init__()
        self.stores = stores
        self.layer_idx = layer_idx
        self.past_len = past_len  # longest cached length in the batch, before this step
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - never lazy
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write each row's new K/V to its store; return padded K/V of every row.

        Args:
            key_states: (batch, num_key_value_heads, q_len, head_dim), after RoPE.
            value_states: (batch, num_key_value_heads, q_len, v_head_dim).

        Returns:
            keys (batch, num_key_value_heads, past_len + q_len, head_dim) and values likewise,
            each row right-aligned (left-padded with zeros).
        """
        q_len = 1 if key_states is None else key_states.shape[-2]  # None: projections skipped (dca)
        total = self.past_len + q_len
        keys = values = None
        for row, store in enumerate(self.stores):
            k, v = store.layers[self.layer_idx].update(
                None if key_states is None else key_states[row : row + 1],
                None if value_states is None else value_states[row : row + 1], *args, **kwargs)
            if keys is None:
                keys = k.new_empty(len(self.stores), k.shape[1], total, k.shape[-1])
                values = v.new_empty(len(self.stores), v.shape[1], total, v.shape[-1])
            pad = total - k.shape[-2]
            keys[row, :, pad:] = k[0]
            values[row, :, pad:] = v[0]
            if pad:  # masked, but must be finite: 0 * NaN garbage would still poison the output
                keys[row, :, :pad] = 0
                values[row, :, :pad] = 0
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.past_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.past_len

    def get_max_length(self) -> int:
        return -1


class _RaggedLayerView(_BatchedLayerView):
    """One layer of :class:`RaggedView`: each row's new K/V go to its own store; the reads go to attention."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append row i's (1, num_key_value_heads, 1, head_dim) K/V to store i; return ``(BatchRead, None)``."""
        reads = []
        for row, store in enumerate(self.stores):
            k, v = store.layers[self.layer_idx].update(
                None if key_states is None else key_states[row : row + 1],
                None if value_states is None else value_states[row : row + 1], *args, **kwargs)
            reads.append(as_read(k, v))
        return BatchRead(reads), None


class BatchedView(Cache):
    """Several sequences' KV stores seen by the model as one left-padded batch cache (one decode step)."""

    layer_view = _BatchedLayerView

    def __init__(self, stores: list[KVStore], num_layers: int):
        self.stores = stores
        self.lengths = [s.num_tokens() for s in stores]
        past = max(self.lengths)
        super().__init__(layers=[self.layer_view(stores, i, past) for i in range(num_layers)])

    def skip_kv_projection(self, layer_idx: int) -> bool:
        """Skip only when every sequence in the batch may skip (else all compute, and those that reuse ignore it)."""
        return all(s.skip_kv_projection(layer_idx) for s in self.stores)


class RaggedView(BatchedView):
    """Several sequences' KV stores seen by the model as one cache for a decode step (no padding)."""

    layer_view = _RaggedLayerView


@dataclass
class PagedGroup:
    """The rows of a step's batch that one paged backend serves, and that step's metadata for them.

    Attributes:
        backend: the rows' backend.
        views: its views of the pool.
        meta: the step's :class:`cache_backends.paged.StepMeta` for these rows (in this order).
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
    backend's stored form, in one call per group (and per-sequence stores one row at a time)."""

    def __init__(self, cache: "StepCache", layer: int, parts: list, legacy: list, module=None):
        self.cache, self.layer, self.parts, self.legacy, self.module = cache, layer, parts, legacy, module

    def with_module(self, module) -> "PagedRead":
        """The same read with the model's attention module attached (native MLA's absorbed attention)."""
        return PagedRead(self.cache, self.layer, self.parts, self.legacy, module)

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """(B, num_attention_heads, n, head_dim) queries → (B, num_attention_heads, n, v_head_dim); in a ragged
        step (1, num_attention_heads, T, head_dim) → (1, num_attention_heads, T, v_head_dim)."""
        if len(self.parts) == 1 and not self.legacy and self.parts[0][0].whole:
            group, reads = self.parts[0]
            return group.backend.attend_paged(self.layer, query, reads, group.meta, scaling, self.module)
        out = None
        for group, reads in self.parts:
            o = group.backend.attend_paged(self.layer, group.take(query), reads, group.meta, scaling, self.module)
            if out is None:
                out = o.new_empty(*query.shape[:-1], o.shape[-1])
            group.put(out, o)
        for row, read in self.legacy:
            o = read.attend(self.cache.row(query, row), scaling)
            if out is None:
                out = o.new_empty(*query.shape[:-1], o.shape[-1])
            self.cache.put_row(out, row, o)
        return out


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
        """Write the batch's new K/V (B, num_key_value_heads, n, head_dim) — each group's rows into the pool in its
        stored form, each per-sequence row into its store — and return ``(PagedRead, None)``."""
        i, parts, legacy, cache = self.layer_idx, [], [], self.cache
        for group in cache.groups:
            k, v = group.take(key_states), group.take(value_states)
            parts.append((group, group.backend.paged_layer(group.views, i, group.meta, k, v)))
        for row, store in cache.legacy:
            k, v = store.layers[i].update(None if key_states is None else cache.row(key_states, row),
                                          None if value_states is None else cache.row(value_states, row), *args,
                                          **kwargs)
            legacy.append((row, as_read(k, v)))
        return PagedRead(cache, i, parts, legacy), None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.past_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.past_len

    def get_max_length(self) -> int:
        return -1


class StepCache(Cache):
    """One step's batch seen by the model as one ``transformers.Cache``: groups of rows whose KV lives in the pool,
    and rows with per-sequence stores (written and read one row at a time).

    Args:
        groups: the paged groups.
        legacy: ``(row, store)`` for each row with a per-sequence store.
        past_len: the longest cached length in the batch before this step (what the model's mask helpers ask).
        num_layers: decoder layers.
        spans: in a ragged step, each row's ``(first token, tokens)`` in the flat batch; ``None``: the batch's rows
            are its rows (every row writes the same number of tokens).
    """

    def __init__(self, groups: list[PagedGroup], legacy: list[tuple[int, KVStore]], past_len: int, num_layers: int,
                 spans: list[tuple[int, int]] | None = None):
        self.groups, self.legacy, self.past_len, self.spans = groups, legacy, past_len, spans
        super().__init__(layers=[_StepLayer(self, i) for i in range(num_layers)])

    def row(self, x: torch.Tensor, row: int) -> torch.Tensor:
        """Row ``row``'s part of a step tensor, (1, H, n, d): a batch row, or its span of the flat tokens."""
        if self.spans is None:
            return x[row : row + 1]
        start, n = self.spans[row]
        return x[:, :, start : start + n]

    def put_row(self, out: torch.Tensor, row: int, o: torch.Tensor) -> None:
        """Write row ``row``'s (1, H, n, dv) output into the step's output."""
        if self.spans is None:
            out[row] = o[0]
        else:
            start, n = self.spans[row]
            out[:, :, start : start + n] = o

    def skip_kv_projection(self, layer_idx: int) -> bool:
        """Only when every row is a per-sequence store that may skip (``dca``)."""
        return not self.groups and all(s.skip_kv_projection(layer_idx) for _, s in self.legacy)


class ModelRunner:
    """Runs the model's forward passes.

    Args:
        model: a loaded causal LM (``eval()`` mode).
        num_layers: decoder layers of ``model``.
    """

    def __init__(self, model, num_layers: int, pool: KVPool | None = None):
        self.model = model
        install_attention(model)  # kvserve's stores are read by kvserve's attention function
        self.num_layers = num_layers
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.pool = pool

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, backends: dict[str, KVBackend], stores: dict[int, KVStore],
                sampling: dict[int, RowRequest], eos_token_ids=()) -> RunnerOutput:
        """Run one scheduled step: its compressions, then each ``alone`` row in a forward of its own, then every
        other row in one forward (a mixed batch), then sample every row that has a token to emit in one sampler
        call.

        Args:
            out: the scheduler's decision (rows, new pages, compressions).
            backends: served backends by name.
            stores: the per-sequence stores of the rows that have one, by ``seq_id``.
            sampling: each sampled row's request (parameters, tokens so far, generator), by ``seq_id``.
            eos_token_ids: ids masked for rows under ``min_tokens``.

        Returns:
            the sampled tokens, the prompt log-probabilities of ``all_logits`` rows, and the rows whose forward
            failed (with why; the other rows are unaffected).
        """
        result = RunnerOutput()
        for c in out.compress:
            self.compress([(backends[c.backend], list(c.rows))], list(c.pages))
        if self.pool is not None and out.new_pages:
            self.pool.zero(out.new_pages)
        last: dict[int, torch.Tensor] = {}  # seq_id -> (vocab_size,) logits of the row's last token
        for row in out.rows:
            if row.alone:
                try:
                    logits = self._run_alone(row, backends, stores, result.feedback)
                    if row.sample and row.all_logits:
                        top_n = sampling[row.seq_id].params.top_n
                        result.prompt_logprobs[row.seq_id] = prompt_logprobs(logits, row.token_ids, top_n)
                except Exception as exc:  # noqa: BLE001 - this request only
                    log.exception("prefill failed")
                    result.failed[row.seq_id] = f"prefill failed: {exc}"
                    continue
                if row.sample:
                    last[row.seq_id] = logits[-1]
        shared = [r for r in out.rows if not r.alone]
        if shared:
            try:
                logits = self._run_rows(shared, backends, stores, result.feedback)
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

    def _run_alone(self, row: RowPlan, backends: dict[str, KVBackend], stores: dict[int, KVStore],
                   feedback: dict) -> torch.Tensor:
        """A prompt (or a per-sequence store's chunk) in a forward of its own: (n, vocab_size) logits of every
        position with ``all_logits``, else (1, vocab_size) of its last."""
        ids = list(row.token_ids)
        if row.blocks is None:
            return self.prefill(ids, stores[row.seq_id], all_logits=row.all_logits)
        measured: dict = {}
        logits = self.run_paged([ids], [(backends[row.backend], [0], [(row.blocks, row.plan)])], [], [],
                                all_logits=row.all_logits, feedback=measured)
        if 0 in measured:
            feedback[row.seq_id] = measured[0]
        return logits[0] if row.all_logits else logits

    def _run_rows(self, rows: list[RowPlan], backends: dict[str, KVBackend], stores: dict[int, KVStore],
                  feedback: dict) -> torch.Tensor:
        """(len(rows), vocab_size) logits of each row's last token: the paged rows and the rows of in-place
        per-sequence stores in one forward; decode rows of stores that return rebuilt K/V (``full`` on a
        native-MLA model) in a second, padded one."""
        groups: dict[str, tuple[list[int], list]] = {}
        legacy, padded = [], []
        for i, row in enumerate(rows):
            if row.blocks is not None:
                members, blocks = groups.setdefault(row.backend, ([], []))
                members.append(i)
                blocks.append((row.blocks, row.plan))
            elif stores[row.seq_id].in_place:
                legacy.append((i, stores[row.seq_id]))
            else:
                padded.append(i)
        apart = set(padded)
        shared = [i for i in range(len(rows)) if i not in apart]
        logits = None
        if shared:
            if padded:  # renumber the shared forward's rows
                where = {r: i for i, r in enumerate(shared)}
                groups = {name: ([where[r] for r in members], blocks) for name, (members, blocks) in groups.items()}
                legacy = [(where[r], store) for r, store in legacy]
            measured: dict = {}
            got = self.run_paged([list(rows[i].token_ids) for i in shared],
                                 [(backends[name], members, blocks) for name, (members, blocks) in groups.items()],
                                 legacy, [], feedback=measured)
            feedback.update({rows[shared[i]].seq_id: m for i, m in measured.items()})
            if not padded:
                return got
            logits = got.new_empty(len(rows), got.shape[-1])
            logits[shared] = got
        if padded:
            got = self.decode([rows[i].token_ids[0] for i in padded], [stores[rows[i].seq_id] for i in padded])
            if logits is None:
                return got
            logits[padded] = got
        return logits

    @torch.inference_mode()
    def run_paged(self, input_ids: list[list[int]], groups: list[tuple[KVBackend, list[int], list]],
                  legacy: list[tuple[int, KVStore]], new_pages: list[int], all_logits: bool = False,
                  feedback: dict | None = None) -> torch.Tensor:
        """One forward over a step's batch: row ``i`` writes its ``len(input_ids[i])`` new tokens and attends to its
        cache.

        Rows of one length run as a (B, n) batch. Rows of different lengths (a mixed step: prefill chunks beside
        one-token decode rows, as vLLM v1's unified batch) run as one flat row of all their tokens, so every
        weight is read once for the whole step; each backend's rows of each length attend as one group
        (:class:`PagedGroup` ``tokens``), per-sequence stores one span at a time.

        Args:
            input_ids: each row's new tokens (B rows).
            groups: ``(backend, rows, [(SeqBlocks, Plan), ...])`` per paged backend: the rows it serves and each
                row's blocks (this step's pages already added) and plan.
            legacy: ``(row, store)`` for rows with per-sequence stores (their position: the store's length).
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
            return self._run_ragged(input_ids, lengths, groups, legacy, new_pages, feedback)
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
        for row, store in legacy:
            n = store.num_tokens()
            positions[row] = torch.arange(n, n + ids.shape[1], device=self.device)
            past = max(past, n)
        if self.pool is not None:
            self.pool.zero(new_pages)
        cache = StepCache(paged, legacy, past, self.num_layers)
        out = self.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                         logits_to_keep=0 if all_logits else 1)
        _collect_feedback(paged, feedback)
        return out.logits if all_logits else out.logits[:, -1]

    def _run_ragged(self, input_ids: list[list[int]], lengths: list[int], groups: list[tuple[KVBackend, list[int], list]],
                    legacy: list[tuple[int, KVStore]], new_pages: list[int], feedback: dict | None = None
                    ) -> torch.Tensor:
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
        for row, store in legacy:
            n = store.num_tokens()
            positions[0, starts[row] : starts[row] + lengths[row]] = torch.arange(n, n + lengths[row],
                                                                                  device=self.device)
            past = max(past, n)
        if self.pool is not None:
            self.pool.zero(new_pages)
        cache = StepCache(paged, legacy, past, self.num_layers, spans=list(zip(starts, lengths)))
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

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], store: KVStore, all_logits: bool = False) -> torch.Tensor:
        """Run prompt tokens through the model into ``store``: the whole prompt, or the next chunk of it
        (positions continue from the tokens ``store`` already holds).

        Returns:
            (1, vocab_size) logits of the last prompt position, or (prompt_len, vocab_size) logits of
            every position when ``all_logits`` (for prompt log-probabilities).
        """
        ids = torch.tensor([prompt_ids], device=self.device)  # (1, prompt_len)
        out = self.model(input_ids=ids, cache=store, use_cache=True, logits_to_keep=0 if all_logits else 1)
        return out.logits[0]

    @torch.inference_mode()
    def decode(self, last_ids: list[int], stores: list[KVStore]) -> torch.Tensor:
        """One decode step for a batch of sequences.

        Args:
            last_ids: the newest token of each sequence (not yet in its store).
            stores: each sequence's KV store, in the same order.

        Returns:
            (batch, vocab_size) logits.
        """
        ids = torch.tensor(last_ids, device=self.device).unsqueeze(1)  # (batch, 1)
        if len(stores) == 1:
            out = self.model(input_ids=ids, cache=stores[0], use_cache=True, logits_to_keep=1)
            return out.logits[:, -1]
        if all(s.in_place for s in stores):
            ragged = RaggedView(stores, self.num_layers)
            positions = torch.tensor(ragged.lengths, device=self.device).unsqueeze(1)  # (batch, 1)
            out = self.model(input_ids=ids, position_ids=positions, cache=ragged, use_cache=True, logits_to_keep=1)
            return out.logits[:, -1]
        view = BatchedView(stores, self.num_layers)
        lengths = torch.tensor(view.lengths, device=self.device)  # (batch,)
        past = max(view.lengths)
        positions = lengths.unsqueeze(1)  # (batch, 1): each sequence's next position
        # (batch, 1, 1, past + 1) additive mask: 0 where a row has a real cached token, -inf on padding.
        columns = torch.arange(past + 1, device=self.device)
        visible = columns.unsqueeze(0) >= (past - lengths).unsqueeze(1)  # (batch, past + 1)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill(~visible, torch.finfo(self.dtype).min)[:, None, None, :]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=view,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]
