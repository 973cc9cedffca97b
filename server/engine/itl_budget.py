"""How many prompt tokens a step may prefill while other sequences decode, from what the engine's steps cost
(``PREFILL_ITL_RATIO``).

A step that carries a prefill chunk beside the running sequences' decode tokens delays each of their next tokens
by the chunk's cost: with 256-token chunks on a small model on a CPU such a step cost about ten decode steps, so
the running streams' inter-token latency (ITL) jumped tenfold whenever a long prompt arrived. A fixed token budget
cannot fit every model and device (a GPU's step costs about the same for 8 tokens or 512), so
:class:`ChunkBudget` measures instead: a decode step's time, and what each prefilled token adds to a step, both
moving averages over the engine's own steps; it then sizes a step's prefill tokens so that the step costs at most
``ratio`` decode steps. A prompt then reaches its first token later (its chunks are smaller), and the running
streams keep their pace: the trade vLLM's chunked prefill makes by scheduling decode tokens first, made here
with a measured bound. A step that finishes a short prompt beside a long one is bounded the same way, the short one
counted as a decode row (its first token is then not held by a whole long chunk; the scheduler asks
:meth:`ChunkBudget.tokens` for it, :func:`server.engine.prefill_share.prefill_shares` applies it).

A prefilled token's cost is pooled over the steps with a chunk (the moving average of their time over a decode
step, over the moving average of their prefilled tokens), not averaged step by step: a decode step measured slower
than a later step with a chunk (a machine shared with other jobs) made that step's share 0, and pulled the average
towards it. The pool can still be 0 or less where chunks cost nothing measurable (a GPU), so the cost is floored at
a decode step's share of :data:`MAX_TOKENS_PER_DECODE_STEP` tokens: it stays positive, and the bound finite.

Plain Python (no torch).
"""

from __future__ import annotations

MIN_ITL_CHUNK = 16
"""The fewest prompt tokens a step with decode tokens prefills under the bound (while that many are left): one block."""
MAX_TOKENS_PER_DECODE_STEP = 4096
"""The most prompt tokens taken to cost one decode step: a prefilled token costs at least ``decode_s / 4096`` (a
bound of ``(ratio - 1) * 4096`` tokens, past any configured ``MAX_NUM_BATCHED_TOKENS`` but finite)."""


class ChunkBudget:
    """The prefill token budget of a step that also carries decode tokens.

    Args:
        ratio: the most a step with prefill chunks may cost, in decode steps (> 1); ``None``: no bound (the
            configured budget alone).
        weight: the weight of the newest step in the moving averages (0-1].

    Attributes:
        decode_s: the moving average of a decode-only step's seconds, or ``None`` before one ran.
        token_s: what one prefilled token adds to a step (seconds, > 0): the moving average of the steps with a
            prefill chunk's time over ``decode_s`` over the moving average of their prefilled tokens, at least
            ``decode_s /`` :data:`MAX_TOKENS_PER_DECODE_STEP`; ``None`` before a step with a prefill chunk ran after
            a decode-only one.
    """

    def __init__(self, ratio: float | None, weight: float = 0.2):
        if ratio is not None and ratio <= 1:
            raise ValueError(f"a step cannot cost less than one decode step: ratio must be > 1, got {ratio}")
        self.ratio, self.weight = ratio, weight
        self.decode_s: float | None = None
        self.token_s: float | None = None
        self._over_s: float | None = None  # moving average of a chunk's step time over decode_s (may be < 0)
        self._tokens: float | None = None  # moving average of a chunk's prefilled tokens

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        """Account a step that ran ``prefill_tokens`` prompt tokens beside ``decode_rows`` decode tokens in
        ``seconds`` (forward and sampling)."""
        if prefill_tokens == 0:
            if decode_rows:
                self.decode_s = self._mix(self.decode_s, seconds)
        elif decode_rows and self.decode_s is not None:
            self._over_s = self._mix(self._over_s, seconds - self.decode_s)  # not clamped: noise either way cancels
            self._tokens = self._mix(self._tokens, prefill_tokens)
            self.token_s = max(self._over_s / self._tokens, self.decode_s / MAX_TOKENS_PER_DECODE_STEP)

    def tokens(self, decoding: int, budget: int | None) -> int | None:
        """Prefill tokens for a step beside ``decoding`` decode tokens, within the configured ``budget`` (``None``:
        whole prompts): the tokens that cost ``ratio - 1`` decode steps, at least :data:`MIN_ITL_CHUNK` (and that many
        until both costs are measured: the first chunk beside decoding sequences is small, and measures); the
        configured budget when it is ``None`` (whole prompts), nothing decodes, or no ratio is set."""
        if budget is None or not (self.ratio and decoding):
            return budget
        if not (self.decode_s and self.token_s):  # not measured yet: a block, whose step measures a prefilled token
            return min(budget, MIN_ITL_CHUNK)
        return min(budget, max(MIN_ITL_CHUNK, round((self.ratio - 1) * self.decode_s / self.token_s)))

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.weight) * old + self.weight * new
