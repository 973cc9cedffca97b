"""One generated token turned into its request's output: the part the engine and the HTTP side share.

Both sides keep a request's tokens: the engine (:meth:`server.engine.engine.Engine._accept`, in the engine core)
on its :class:`~server.engine.sequence.Sequence` as it samples them, the HTTP side
(:meth:`server.engine.core_client.CoreClient._token`) on its :class:`~server.engine.request_state.RequestState` as
the core's :class:`~server.engine.messages.NewToken` arrive; either is a
:class:`~server.engine.request_state.TokenRecord`. Each token is appended and stamped (:func:`add_token`, which also
detokenizes it), then its caller decides what the token itself ends (the engine: end-of-text, a grammar that can
only end, ``max_new_tokens``; the HTTP side: the core's ``Finished``), and :func:`token_event` settles the finish
reason with the stop strings, releases the held-back text of a last token and makes its
:class:`~server.engine.sequence.TokenEvent`. :func:`close_event` completes a request's last event;
:func:`end_event` is the last event of a request that ends without a new token (cancelled, failed).

The detokenizer is an :class:`~server.engine.detokenize.IncrementalDetokenizer` (the core's own sequences carry a
``NullDetokenizer``: no text, never a stop string).
"""

from __future__ import annotations

import time

from typing import TYPE_CHECKING

from server.engine.sequence import FinishReason, TokenEvent

if TYPE_CHECKING:
    from server.engine.request_state import TokenRecord


def add_token(seq: TokenRecord, detok, token_id: int) -> str:
    """Append ``token_id`` to ``seq``'s output, stamp its time and detokenize it.

    Returns:
        the text the token releases ('' while held back).
    """
    now = time.perf_counter()
    seq.output_ids.append(token_id)
    seq.times.token_times.append(now)
    seq.times.first_token = seq.times.first_token or now
    seq.times.last_token = now
    return detok.add(token_id)


def finish_reason(ending: FinishReason | None, stopped: bool) -> FinishReason | None:
    """Why a sequence ends with its newest token, or ``None``: ``ending`` (what the token itself ended, as its
    caller sees it) comes before a stop string found in its text (``stopped``), and a stop string before
    ``length``."""
    if stopped and (ending is None or ending == FinishReason.LENGTH):
        return FinishReason.STOP
    return ending


def token_event(seq: TokenRecord, detok, token_id: int, text: str, logprob: float, top, special_ids: set[int],
                ending: FinishReason | None = None) -> tuple[TokenEvent, FinishReason | None]:
    """The event of ``seq``'s newest token (:func:`add_token` released ``text``) and the reason the sequence ends
    with it (:func:`finish_reason`), or ``None``. When it ends, the text still held back is released into the
    event; its finish reason is left for :func:`close_event`."""
    reason = finish_reason(ending, detok.stopped)
    if reason is not None:
        text += detok.flush()
    event = TokenEvent(index=len(seq.output_ids) - 1, token_id=token_id, text=text, logprob=logprob,
                       special=token_id in special_ids, top=top)
    return event, reason


def end_event(seq: TokenRecord, error: str | None = None) -> TokenEvent:
    """The last event of a sequence that ends without a new token (cancelled, failed)."""
    return TokenEvent(index=len(seq.output_ids), token_id=-1, text="", logprob=0.0, special=True, error=error)


def close_event(last: TokenEvent, reason: FinishReason, detok) -> TokenEvent:
    """Make ``last`` the closing event: its finish reason and the whole text (``''`` with no detokenizer: a sequence
    that ended before it was admitted)."""
    last.finish_reason = reason
    last.generated_text = detok.generated_text() if detok is not None else ""
    return last
