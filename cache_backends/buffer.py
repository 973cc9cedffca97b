"""In-place per-sequence token storage: a preallocated buffer that appends by writing a slice.

Every backend's per-token stream (K/V heads, shared heads, a latent, int8 codes, per-token scales)
lives in a :class:`TokenBuffer` of shape ``(batch, heads, capacity, width)``. Appending ``n`` tokens
writes ``n`` slices (O(n)); reading returns a view of the first ``length`` tokens (no copy).

Why not a block pool (vLLM's PagedAttention, arXiv 2309.06180)? kvserve's scheduler reserves each
request's whole token budget (prompt + max_new_tokens) at admission, so a sequence can never run out
of room mid-decode and nothing is ever preempted. A buffer reserved to that budget is then the
exact equivalent of a block table whose blocks happen to be contiguous: no fragmentation inside a
request, no gather at attention time (the attention reads a view), and the bytes a store *holds*
(its capacity) never exceed the bytes the scheduler reserved for it. Capacity grows geometrically
(x2, from :data:`MIN_CAPACITY` tokens) up to the reservation, so short requests with a large
``max_new_tokens`` do not hold their whole reservation from the first token; the rare regrowth copies
(O(T), at most log2(T / MIN_CAPACITY) times) keep appends amortised O(1) per token. What this gives
up against paging: prefix sharing between requests and reclaiming the unused tail of a request that
stops early before it finishes.
"""

from __future__ import annotations

import torch

MIN_CAPACITY = 64  # tokens allocated on the first write when no reservation says otherwise


class TokenBuffer:
    """A growable ``(batch, heads, capacity, width)`` tensor whose first ``length`` tokens are in use.

    Args:
        max_tokens: the most tokens this buffer may ever hold (the request's reservation), or ``None``
            for no limit (capacity then doubles without a cap).

    Attributes:
        length: tokens in use (int).
    """

    def __init__(self, max_tokens: int | None = None):
        self.max_tokens = max_tokens
        self.data: torch.Tensor | None = None
        self.length = 0

    @staticmethod
    def capacity_for(n_tokens: int, max_tokens: int | None) -> int:
        """Capacity (tokens) allocated to hold ``n_tokens`` under a cap of ``max_tokens``."""
        cap = MIN_CAPACITY
        while cap < n_tokens:
            cap *= 2
        return cap if max_tokens is None else max(n_tokens, min(cap, max_tokens))

    def _reserve(self, like: torch.Tensor, n_tokens: int) -> None:
        cap = self.capacity_for(n_tokens, self.max_tokens)
        b, h, _, w = like.shape
        fresh = like.new_empty(b, h, cap, w)
        if self.data is not None and self.length:
            fresh[..., : self.length, :] = self.data[..., : self.length, :]
        self.data = fresh

    def append(self, x: torch.Tensor) -> None:
        """Write ``x`` (batch, heads, n, width) after the tokens in use (grows the capacity if needed)."""
        n = x.shape[-2]
        if self.data is None or self.length + n > self.data.shape[-2]:
            self._reserve(x, self.length + n)
        self.data[..., self.length : self.length + n, :] = x
        self.length += n

    def view(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tokens ``start .. stop`` (default: all in use) as a view, (batch, heads, n, width)."""
        stop = self.length if stop is None else stop
        return self.data[..., start:stop, :]

    def truncate(self, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` (the rest becomes free capacity; nothing is copied)."""
        self.length = min(self.length, n_tokens)

    def used_bytes(self) -> int:
        """Bytes of the tokens in use."""
        if self.data is None:
            return 0
        b, h, _, w = self.data.shape
        return b * h * self.length * w * self.data.element_size()

    def allocated_bytes(self) -> int:
        """Bytes allocated (capacity), >= :meth:`used_bytes`."""
        return 0 if self.data is None else self.data.nelement() * self.data.element_size()

    def release(self) -> None:
        self.data = None
        self.length = 0
