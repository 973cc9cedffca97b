"""How one step's prefill token budget is shared between the sequences still prefilling (fair share of prefills).

A step prefills at most a budget of prompt tokens (``MAX_NUM_BATCHED_TOKENS`` less the decode tokens, and while
sequences decode at most what :class:`server.engine.itl_budget.ChunkBudget` allows). Given to the sequences in
admission order, the whole budget went to the oldest prefill until its prompt was written: a short request
admitted behind a 5,900-token prompt waited for all of its chunks (23 steps of 256 tokens, 35 s on a CPU, for a
request that takes 0.16 s alone), though it was in the batch.

:func:`prefill_shares` splits the budget instead, as vLLM's scheduler caps each request's tokens a step
(``long_prefill_token_threshold``) so that several prompts prefill at once (``max_num_partial_prefills``), here
with a cap that follows the prefills present: each served prefill gets an equal share, and one that needs less
takes only what it needs and leaves the rest to the others (max-min fairness). A short prompt is then written in
its first step beside the long one's chunk and decodes from the next, while the long one still gets most of the
budget.

A step that finishes a prompt (its share is all it has left: it samples its first token in this step) beside one it
does not finish bounds the unfinished ones' tokens together (``bound``: what
:meth:`~server.engine.itl_budget.ChunkBudget.tokens` allows a step with decode tokens), and the finishing ones keep
their whole need: their first token is then bounded as a decoding stream's next token is. Short requests
(32-token prompts, 4 tokens each) finish in a few steps, so most steps had no decode row and no bound: a short
prompt's step also carried the long one's 224-token rest of the 256-token budget, and its first token cost a whole
long chunk's step (1-2.6 s at a 5,900-token prompt's context on a CPU, against 0.22 s alone). With no prompt
finishing (nothing short waiting) the long ones get the whole budget as before, and beside short ones the bound
between them (one block at least), so none starves.

Which prefills are served: the oldest, so that every prompt progresses (none starves), then those with the fewest
tokens left, so that a short prompt does not wait for a long one's chunks; as many as the budget gives
:data:`MIN_SHARE` tokens each (or what each needs, if less), two at least; and of the prompts the step cannot
finish, :data:`MAX_LONG` at most (as vLLM's ``max_long_partial_prefills``): equal long prompts then finish two by
two, the first ones early, rather than all together at the end (sharing among all of them would give every one
the last one's time to its first token).

Plain Python (no torch).
"""

from __future__ import annotations

MIN_SHARE = 16
"""Tokens (one block) each served prefill gets at least (or what it needs, if less): a step serves no more prefills
than the budget gives that many, but always two."""
MAX_LONG = 2
"""Prompts with more tokens left than the step's budget (it cannot finish them) served in one step at most."""


def prefill_shares(left: list[int], budget: int, bound: int | None = None) -> list[int]:
    """Prompt tokens each prefilling sequence may write this step.

    Args:
        left: each sequence's prompt tokens still to write (> 0), in admission order (the oldest first).
        budget: the step's prefill tokens (>= 0).
        bound: the most tokens (>= 0) the served sequences the step does not finish may write together when it
            finishes another (the tokens a step with decode tokens may prefill); ``None``: no bound (the budget).

    Returns:
        one share per entry of ``left`` (0: not served this step), their sum at most ``budget``: the oldest and
        then the sequences with the fewest tokens left (ties: the older) are served, as many as the budget gives
        ``min(tokens left,`` :data:`MIN_SHARE` ``)`` each, two at least, of which :data:`MAX_LONG` at most with more
        than ``budget`` tokens left; each served one gets ``min(its tokens left, an equal share of what the served
        ones that need less leave)``, the remainder of the division going to those with the most left; when a
        share is all its sequence has left and another is not, the ones not finished share ``min(bound, what they
        got)`` the same way instead.

    Raises:
        ValueError: a negative budget or bound, or a count of tokens left that is not positive.
    """
    if budget < 0 or (bound is not None and bound < 0) or any(n <= 0 for n in left):
        raise ValueError(f"a budget >= 0 and positive tokens left, got budget {budget}, bound {bound} and left {left}")
    shares = [0] * len(left)
    if not left or budget == 0:
        return shares
    served, blocks, long = [], 0, 0
    for i in [0] + sorted(range(1, len(left)), key=lambda i: (left[i], i)):
        want = min(left[i], MIN_SHARE)
        if len(served) >= 2 and blocks + want > budget:
            break
        if left[i] > budget:
            if long == MAX_LONG:
                continue
            long += 1
        served.append(i)
        blocks += want
    _split(shares, served, left, budget)
    unfinished = [i for i in served if shares[i] < left[i]]
    if bound is not None and len(unfinished) < len(served) and sum(shares[i] for i in unfinished) > bound:
        _split(shares, unfinished, left, bound)  # a prompt's first token beside them: a decode step's bound
    return shares


def _split(shares: list[int], served: list[int], left: list[int], budget: int) -> None:
    """Set ``shares`` of the ``served`` indices: max-min fair shares of ``budget`` (each its need or an equal share
    of what those that need less leave, the remainder to those with the most left)."""
    served = sorted(served, key=lambda i: (left[i], i))  # the fewest left first: each takes its need or an equal share
    for k, i in enumerate(served):
        shares[i] = min(left[i], budget // (len(served) - k))
        budget -= shares[i]
