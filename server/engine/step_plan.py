"""One engine step as plain data: what the scheduler decided (:class:`SchedulerOutput`) and what the model runner
returns (:class:`RunnerOutput`). No tensors (no torch import: ``tests/test_import_graph.py``).

The scheduler (:class:`server.engine.scheduler.Scheduler`) owns the queues, the pages and every decision of a step:
admission, fair share, preemption, compression of ``elastic`` sequences, the prefill token budget and each chunk's
length. It hands the runner a :class:`SchedulerOutput`: the rows of the step's forward, each with the tokens it
writes, its block tables (pages for the step already added) and its :class:`~cache_backends.page_plan.Plan`; the
pages handed out for the step (zeroed before it runs); the compressions to run first. The runner
(:meth:`server.engine.runner.ModelRunner.execute`) runs them and returns a :class:`RunnerOutput`: each sampled row's
token, log-probability and top alternatives, and the rows that failed. The scheduler then commits the rows that ran
(:meth:`~server.engine.scheduler.Scheduler.commit`). As vLLM v1's ``SchedulerOutput`` / ``ModelRunnerOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cache_backends.page_plan import Plan, SeqBlocks

MIN_PREFILL_CHUNK = 64  # prompt tokens a chunked prefill step writes at least (while that many are left)


def snapshot(blocks: SeqBlocks) -> SeqBlocks:
    """A copy of ``blocks`` whose lists the caller may keep while the original changes."""
    return SeqBlocks(list(blocks.exact), blocks.start, blocks.exact_len, list(blocks.q), blocks.q_len)


@dataclass(frozen=True)
class RowPlan:
    """One row of a step: a sequence writing ``len(token_ids)`` tokens into its cache.

    Attributes:
        seq_id: the sequence (:attr:`server.engine.sequence.Sequence.seq_id`).
        backend: its KV backend's name.
        token_ids: the tokens it writes: a prefill chunk, or its newest token (decode).
        blocks: its block tables for the step (this step's pages added; read only: the scheduler changes them only
            when it commits the row): :class:`~cache_backends.page_plan.SeqBlocks`, or ``dca``'s
            :class:`~cache_backends.dca.plan.DCABlocks`.
        plan: what writing the tokens does to ``blocks`` (committed after the step).
        decode: a decode row (one generated token), not a prefill chunk.
        sample: its last token's logits are sampled (a decode row, or a prompt's last chunk).
        alone: runs in a forward of its own (a prompt that wants every position's log-probability), not in the
            step's mixed batch.
        all_logits: every position's logits are kept (prompt log-probabilities).
    """

    seq_id: int
    backend: str
    token_ids: tuple[int, ...]
    blocks: SeqBlocks
    plan: Plan
    decode: bool
    sample: bool
    alone: bool = False
    all_logits: bool = False


@dataclass(frozen=True)
class CompressPlan:
    """Re-encoding the oldest exact groups of some ``elastic`` sequences of one backend (run before the forward).

    Attributes:
        backend: the backend's name.
        rows: each sequence's block tables (a copy taken when the compression was planned, its quantized pages
            added) and its :meth:`~cache_backends.page_plan.TierPlan.plan_compress` plan.
        pages: the quantized pages the plans take (exact pages their own drained tokens leave).
        seq_ids: the sequences of ``rows``, in their order (failed together when the re-encoding raises: their tables
            already name the codes).
    """

    backend: str
    rows: tuple[tuple[SeqBlocks, Plan], ...]
    pages: tuple[int, ...]
    seq_ids: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    """What the runner executes for one step, in order: :attr:`compress`, then the rows that run ``alone`` (one
    forward each), then every other row in one forward (a mixed batch).

    Attributes:
        rows: the step's rows (prefill chunks first, in admission order, then decode rows).
        new_pages: pages handed out for the rows (zeroed before the forward).
        compress: compressions, in the order they were planned (a later one may read the tables an earlier one
            left).
    """

    rows: list[RowPlan] = field(default_factory=list)
    new_pages: list[int] = field(default_factory=list)
    compress: list[CompressPlan] = field(default_factory=list)

    @property
    def seq_ids(self) -> list[int]:
        """Every sequence the step touches: its rows' and its compressions' (each once, rows first)."""
        ids = [r.seq_id for r in self.rows] + [i for c in self.compress for i in c.seq_ids]
        return list(dict.fromkeys(ids))

    @property
    def decode_only(self) -> bool:
        """Every row is a decode row (no prefill chunk)."""
        return all(r.decode for r in self.rows)


@dataclass
class RunnerOutput:
    """What one step's forwards gave.

    Attributes:
        sampled: ``seq_id`` → the row's :class:`server.engine.sampling.Sampled` (token, logprob, top), or the
            exception its sampling raised (that row only).
        prompt_logprobs: ``seq_id`` → ``(logprobs, tops)`` of every prompt position (rows with ``all_logits`` whose
            prompt is complete).
        failed: ``seq_id`` → why its forward or its compression failed (its pages are not committed; a failed
            compression's sequences are not run).
        feedback: ``seq_id`` → what the forward measured for the row's commit (plain data: ``dca``'s similarities,
            :class:`cache_backends.dca.plan.Feedback`).
    """

    sampled: dict = field(default_factory=dict)
    prompt_logprobs: dict = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    feedback: dict = field(default_factory=dict)
