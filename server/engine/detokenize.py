"""Incremental detokenization with stop sequences.

Text is released token by token such that (1) the concatenation of all released pieces equals the
final ``generated_text`` exactly, (2) a UTF-8 character split across byte-level tokens is released
only once complete, and (3) no stop sequence, nor any prefix of one that might still complete, is
ever released: text that could be the start of a stop sequence is held back until it cannot be.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns generated token ids into released text pieces.

    Args:
        tokenizer: a Hugging Face tokenizer.
        stop: stop sequences (non-empty strings).
        special_ids: token ids whose text is never released (end-of-text and other special tokens).
    """

    REPLACEMENT = "\ufffd"

    def __init__(self, tokenizer, stop: list[str], special_ids: set[int]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.special_ids = special_ids
        self.ids: list[int] = []
        self.text = ""  # decoded text of all complete characters so far
        self.released = 0  # characters of self.text already released
        self.stopped = False

    def _decode(self) -> str:
        return self.tokenizer.decode([i for i in self.ids if i not in self.special_ids],
                                     skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Add one generated token; return the text it releases ('' if held back).

        After a stop sequence is found, :attr:`stopped` is True and the text up to (not including)
        the stop sequence has been released.
        """
        self.ids.append(token_id)
        if token_id in self.special_ids:
            return ""
        decoded = self._decode()
        if decoded.endswith(self.REPLACEMENT):
            return ""  # an incomplete UTF-8 character: wait for the next byte token
        self.text = decoded
        for s in self.stop:
            at = self.text.find(s, self.released)  # held-back text guarantees no match starts earlier
            if at != -1:
                self.stopped = True
                self.text = self.text[:at]
                return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def _held_back(self) -> int:
        """Length of the longest tail of the unreleased text that is a proper prefix of a stop sequence."""
        pending = self.text[self.released:]
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(pending)), longest, -1):
                if pending.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _release(self, upto: int) -> str:
        piece = self.text[self.released:upto] if upto > self.released else ""
        self.released = max(self.released, upto)
        return piece

    def flush(self) -> str:
        """Release everything still held back (called when generation ends without a stop match)."""
        if self.stopped:
            return ""
        decoded = self._decode()
        self.text = decoded  # an unfinished UTF-8 tail is released as U+FFFD, as decode() shows it
        return self._release(len(self.text))

    def generated_text(self) -> str:
        """All released text (equal to the concatenation of every piece returned)."""
        return self.text[: self.released]
