"""Admission: which waiting sequences may join the running batch (no tensors here).

A sequence is admitted when the batch has room (``max_batch_size``) and, if a KV budget is set, the
bytes its store can ever allocate — its backend's :meth:`KVBackend.reserved_bytes` for its whole
token budget (prompt + max_new_tokens), the exact capacity its buffers are capped at — fit beside the
reservations of the running sequences. The budget is therefore a hard cap on the KV memory held, for
every backend (windowed int8 stores and dca sequences that reuse few layers included). Sequences are
admitted first come, first served; a sequence that does not fit waits, and so do those behind it (no
overtaking, so nothing starves).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from server.engine.sequence import Sequence


class Scheduler:
    """FIFO admission against batch size and an optional KV budget.

    Args:
        max_batch_size: most sequences decoding at once.
        kv_budget_bytes: cap on the KV bytes the running sequences may hold; ``None`` for no cap.
        reserved_bytes: for each backend name, bytes a store reserved for ``n`` tokens can allocate
            (``KVBackend.reserved_bytes``).
        prefill_chunk_tokens: most prompt tokens prefilled per engine step (chunked prefill, as vLLM's
            scheduler budgets tokens per step); ``None`` prefills each prompt whole.
    """

    def __init__(self, max_batch_size: int, kv_budget_bytes: int | None,
                 reserved_bytes: dict[str, Callable[[int], int]], prefill_chunk_tokens: int | None = 256):
        self.max_batch_size = max_batch_size
        self.kv_budget_bytes = kv_budget_bytes
        self.reserved = reserved_bytes
        self.prefill_chunk_tokens = prefill_chunk_tokens

    @staticmethod
    def token_budget(seq: Sequence) -> int:
        """Tokens ``seq`` may hold: prompt plus max_new_tokens."""
        return len(seq.prompt_ids) + seq.max_new_tokens

    def reserved_bytes(self, seq: Sequence) -> int:
        """The most KV bytes ``seq``'s store can allocate (bytes)."""
        return self.reserved[seq.backend_name](self.token_budget(seq))

    def fits_alone(self, seq: Sequence) -> bool:
        """Whether ``seq`` could ever be admitted (it fits the budget on its own)."""
        return self.kv_budget_bytes is None or self.reserved_bytes(seq) <= self.kv_budget_bytes

    def admit(self, waiting: deque[Sequence], running: list[Sequence]) -> list[Sequence]:
        """Pop and return the waiting sequences that may start now (in arrival order)."""
        admitted: list[Sequence] = []
        used = sum(self.reserved_bytes(s) for s in running)
        while waiting and len(running) + len(admitted) < self.max_batch_size:
            need = self.reserved_bytes(waiting[0])
            if self.kv_budget_bytes is not None and used + need > self.kv_budget_bytes:
                break
            used += need
            admitted.append(waiting.popleft())
        return admitted
