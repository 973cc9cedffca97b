"""TGI's ``truncate``: a long prompt's last tokens, from the tail of its text only.

Tokenizing a 1.9 MB prompt whole took a tokenizer thread 3.7-18.8 s before all but ``truncate`` of its tokens were
dropped. Every token stands for at most ``max_token_bytes`` bytes of text (:func:`server.service.max_bytes_per_token`),
so the last ``(truncate + TAIL_MARGIN_TOKENS) * max_token_bytes`` characters hold at least that many tokens; they are
tokenized alone, from a word boundary, and the margin absorbs the few tokens the cut can change at its start.
"""

from __future__ import annotations

TAIL_MARGIN_TOKENS = 16
"""Tokens tokenized before the kept ones, so that the cut through the text cannot change those."""


def _suffix_ids(tokenizer) -> list[int]:
    """The special tokens the tokenizer appends after a text (an EOS for some; none for most)."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[start + len(plain):]
    return []


def tail_ids(tokenizer, text: str, keep: int, add_special_tokens: bool, max_token_bytes: int | None) -> list[int]:
    """The last ``keep`` token ids of ``tokenizer.encode(text, add_special_tokens=...)``.

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the prompt.
        keep: tokens kept (``truncate``, >= 1).
        add_special_tokens: as for ``encode``.
        max_token_bytes: the most UTF-8 bytes one token stands for; ``None`` (unbounded) tokenizes ``text`` whole.

    Returns:
        At most ``keep`` ids. When ``text`` is longer than its tail, only the tail is tokenized (the special tokens
        the tokenizer puts first, such as BOS, are then among the dropped ones; those it puts last are kept).
    """
    chars = (keep + TAIL_MARGIN_TOKENS) * max_token_bytes if max_token_bytes else None
    if chars is None or len(text) <= chars:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)[-keep:]
    tail = text[-chars:]  # at least `chars` bytes: at least keep + margin tokens
    space = next((i for i, c in enumerate(tail[:max_token_bytes * TAIL_MARGIN_TOKENS // 2]) if c.isspace()), 0)
    ids = tokenizer.encode(tail[space:], add_special_tokens=False)
    return (ids + (_suffix_ids(tokenizer) if add_special_tokens else []))[-keep:]
