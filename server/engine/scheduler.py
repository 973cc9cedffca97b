"""Admission: which waiting sequences may join the running batch (no tensors here).

A sequence is admitted when the batch has room (``max_batch_size``) and, if a KV budget is set, the
bytes it may grow to (``bytes_per_token * (prompt + max_new_tokens)``, the backend's closed formula)
fit beside what the running sequences may grow to. Sequences are admitted first come, first served;
a sequence that does not fit waits, and so do those behind it (no overtaking, so nothing starves).
"""

from __future__ import annotations

from collections import deque

from server.engine.sequence import Sequence


class Scheduler:
    """FIFO admission against batch size and an optional KV budget.

    Args:
        max_batch_size: most sequences decoding at once.
        kv_budget_bytes: cap on the KV bytes the running sequences may reach; ``None`` for no cap.
        bytes_per_token: closed-form KV bytes per token (all layers) for each backend name.
    """

    def __init__(self, max_batch_size: int, kv_budget_bytes: int | None, bytes_per_token: dict[str, float]):
        self.max_batch_size = max_batch_size
        self.kv_budget_bytes = kv_budget_bytes
        self.bytes_per_token = bytes_per_token

    def reserved_bytes(self, seq: Sequence) -> float:
        """The most KV bytes ``seq`` can reach (its whole token budget at the closed formula)."""
        return self.bytes_per_token[seq.backend_name] * (len(seq.prompt_ids) + seq.max_new_tokens)

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
