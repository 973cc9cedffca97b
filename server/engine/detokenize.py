"""Incremental detokenization with stop sequences, O(1) work per generated token.

Text is released token by token such that (1) the concatenation of all released pieces equals the
final ``generated_text`` exactly, (2) a UTF-8 character split across byte-level tokens is released
only once complete, and (3) no text that is, or could still become, part of a stop sequence is ever
released: text that could be the start of a stop sequence is held back until it cannot be.

Stop semantics: generation stops at the first token after which the text contains any stop sequence,
and the result is the text before the *earliest* occurrence of any of them (not the first in list
order). With stops ``["abcd", "c"]`` and text ``"abc"``, the result is ``"ab"``: the text never reached
``"abcd"``.

Decoding uses the prefix/read-offset method of TGI and vLLM: each step decodes only the tokens since
the last release (plus the chunk before them, for tokenizers whose decoding of a token depends on its
left neighbour) and releases the difference, so the cost per token does not grow with the output.
Stop matching runs one Knuth-Morris-Pratt automaton per stop sequence over the new characters only.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class StopMatcher:
    """Finds one stop string in a text that arrives in pieces (Knuth-Morris-Pratt).

    Attributes:
        state: length of the longest suffix of the text fed so far that is a prefix of the stop string
            (equal to ``len(stop)`` right after a match).
    """

    def __init__(self, stop: str):
        self.stop = stop
        # fail[i]: length of the longest proper border (prefix that is also a suffix) of stop[:i + 1]
        self.fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k
        self.state = 0

    def feed(self, piece: str) -> int | None:
        """Advance over ``piece``; return the index in ``piece`` just past the first full match, or None."""
        stop, fail, k = self.stop, self.fail, self.state
        for i, ch in enumerate(piece):
            if k == len(stop):
                k = fail[k - 1]
            while k and ch != stop[k]:
                k = fail[k - 1]
            if ch == stop[k]:
                k += 1
            if k == len(stop):
                self.state = k
                return i + 1
        self.state = k
        return None


class IncrementalDetokenizer:
    """Turns generated token ids into released text pieces.

    Args:
        tokenizer: a Hugging Face tokenizer (anything with ``decode(ids, skip_special_tokens=...,
            clean_up_tokenization_spaces=...)``).
        stop: stop sequences (empty strings are ignored).
        special_ids: token ids whose text is never released (end-of-text and other special tokens).

    Attributes:
        stopped: True once a stop sequence occurred; the text before its earliest occurrence has then
            been released and nothing more will be.
    """

    def __init__(self, tokenizer, stop: list[str], special_ids: set[int]):
        self.tokenizer = tokenizer
        self.matchers = [StopMatcher(s) for s in stop if s]
        self.special_ids = special_ids
        self.stopped = False
        self._window: list[int] = []  # ids from the prefix offset on (the last released chunk + new ids)
        self._read = 0  # ids in the window that were already released
        self._pending = ""  # decoded text not yet released (a possible start of a stop sequence)
        self._released: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _new_text(self, final: bool) -> str:
        """Text the ids after the read offset add, or '' while it may end inside a UTF-8 character.

        With ``final``, an unfinished UTF-8 tail is returned as U+FFFD, as ``decode()`` shows it."""
        prefix_text = self._decode(self._window[: self._read])
        text = self._decode(self._window)
        if len(text) <= len(prefix_text) or (text.endswith(REPLACEMENT) and not final):
            return ""
        self._window = self._window[self._read:]  # the new prefix: the chunk released now
        self._read = len(self._window)
        return text[len(prefix_text):]

    def add(self, token_id: int) -> str:
        """Add one generated token; return the text it releases ('' if held back).

        After a stop sequence is found, :attr:`stopped` is True, the text up to (not including) its
        earliest occurrence has been released, and further calls release nothing.
        """
        if self.stopped or token_id in self.special_ids:
            return ""
        self._window.append(token_id)
        return self._scan(self._new_text(final=False), final=False)

    def flush(self) -> str:
        """Release everything still held back (called when generation ends without a stop match)."""
        if self.stopped:
            return ""
        return self._scan(self._new_text(final=True), final=True)

    def _scan(self, piece: str, final: bool) -> str:
        """Append ``piece`` to the pending text; release what cannot be part of a stop sequence."""
        if not piece and not final:
            return ""
        self._pending += piece
        base = len(self._pending) - len(piece)  # where ``piece`` starts in the pending text
        earliest = None
        for m in self.matchers:
            end = m.feed(piece)
            if end is not None:
                start = base + end - len(m.stop)
                earliest = start if earliest is None else min(earliest, start)
        if earliest is not None:
            # Held-back text guarantees every occurrence starts inside the pending text (start >= 0).
            self.stopped = True
            return self._release(max(earliest, 0))
        held = 0 if final else max((m.state for m in self.matchers), default=0)
        return self._release(len(self._pending) - held)

    def _release(self, upto: int) -> str:
        out, self._pending = self._pending[:upto], ("" if self.stopped else self._pending[upto:])
        if out:
            self._released.append(out)
        return out

    def generated_text(self) -> str:
        """All released text (equal to the concatenation of every piece returned)."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""
