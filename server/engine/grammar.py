"""Structured outputs in the engine: one grammar matcher per sequence, built with xgrammar (vLLM's default).

A request asks for a grammar through two plain fields of its :class:`~server.engine.sampling.SamplingParams`:
``grammar_kind`` (one of :data:`KINDS`) and ``grammar`` (the JSON schema as JSON text, or the regular expression).
The engine compiles it once per distinct grammar (:class:`Grammars`, which caches; in a thread beside the steps,
:meth:`server.engine.engine.Engine.submit`) and gives each sequence its own :class:`GrammarState` (``n`` > 1: one per
choice). Each step the state's ``mask`` — the next token's allowed ids as
xgrammar's int32 bitmask, (ceil(vocab / 32),) — goes to the sampler with the row
(:func:`server.engine.sampling.apply_allowed`); the accepted token advances it (:meth:`GrammarState.accept`). The
state depends only on the sequence's output tokens, which preemption and the prefix cache leave as they are (a
recomputed context is prefilled, never sampled again), so it lives on the sequence across both.

When the grammar can only end (a JSON value closed, nothing but end-of-text allowed), :attr:`GrammarState.done` is
set and the engine ends the sequence at once, as end-of-text would (``finish_reason`` ``stop``), without a step to
sample the end-of-text token.

xgrammar is imported on the first grammar only: a server that never gets one never loads it.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch

KINDS = ("json_object", "json_schema", "regex")
"""``grammar_kind`` values: any JSON object; a JSON schema (``grammar`` is its JSON text); a regular expression."""
JSON_OBJECT = '{"type": "object"}'
"""The schema of ``json_object``: any JSON object (not any JSON value)."""


class GrammarError(ValueError):
    """A grammar that cannot be compiled (the message says why, as xgrammar reports it)."""


def _xgrammar():
    import xgrammar  # noqa: PLC0415 - lazy: seconds to import, and only grammar requests need it

    return xgrammar


def check(kind: str, grammar: str) -> None:
    """Compile ``grammar`` without a vocabulary, to refuse a bad one before it reaches the engine.

    Args:
        kind: one of :data:`KINDS`.
        grammar: the JSON schema as JSON text (``json_schema``), the regular expression (``regex``), or ``""``.

    Raises:
        GrammarError: an unknown kind, a schema that is not JSON or not a schema xgrammar can follow (an unknown
            ``type``, ``properties`` that is not an object, ...), or a regular expression that does not parse.
    """
    xgr = _xgrammar()
    try:
        if kind == "json_object":
            return
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(grammar, strict_mode=True, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(grammar)
        else:
            raise GrammarError(f"unknown grammar kind {kind!r}; one of {', '.join(KINDS)}")
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with its reason
        raise GrammarError(_reason(exc)) from None


def _reason(exc: Exception) -> str:
    """xgrammar's message without its source location prefix (``[hh:mm:ss] /project/cpp/x.cc:123: ``)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text


class Grammars:
    """The engine's grammar compiler: the tokenizer's vocabulary for xgrammar, built on first use, and compiled
    grammars (xgrammar caches each distinct one).

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: width of the model's logits (may exceed the tokenizer's length: padding ids are never allowed).
        stop_ids: the ids that end a sequence (the engine's end-of-text ids); allowed where the grammar may end.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self._compiler = None
        self._stop_words: torch.Tensor | None = None
        self._lock = threading.Lock()

    def _compile(self, kind: str, grammar: str):
        xgr = _xgrammar()
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
                stop = torch.zeros(_words(self.vocab_size), dtype=torch.int32)
                for t in self.stop_ids:
                    if t < self.vocab_size:
                        stop[t // 32] |= _bit(t % 32)
                self._stop_words = stop
        if kind in ("json_object", "json_schema"):
            # No free whitespace between tokens (vLLM's disable_any_whitespace): a small model given the choice
            # writes newlines until its budget ends; the JSON keeps the usual ", " and ": " separators.
            schema = grammar if kind == "json_schema" else JSON_OBJECT
            return self._compiler.compile_json_schema(schema, strict_mode=True, any_whitespace=False)
        if kind == "regex":
            return self._compiler.compile_regex(grammar)
        raise GrammarError(f"unknown grammar kind {kind!r}; one of {', '.join(KINDS)}")

    def state(self, kind: str, grammar: str) -> "GrammarState":
        """A new matcher at the grammar's start, its first mask filled.

        Raises:
            GrammarError: the grammar does not compile.
        """
        try:
            compiled = self._compile(kind, grammar)
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise GrammarError(_reason(exc)) from None
        return GrammarState(_xgrammar().GrammarMatcher(compiled), self.vocab_size, self._stop_words)


def _words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _bit(j: int) -> int:
    """Bit ``j`` of an int32 word, as a signed int32 value (bit 31 is the sign)."""
    return (1 << j) - (1 << 32) if j == 31 else 1 << j


class GrammarState:
    """One sequence's position in its grammar.

    Attributes:
        mask: (ceil(vocab / 32),) int32: bit ``j`` of word ``i`` allows token ``32 * i + j`` at the next step.
        done: the grammar can only end now (the engine ends the sequence).
    """

    def __init__(self, matcher: Any, vocab_size: int, stop_words: torch.Tensor):
        self.matcher = matcher
        self.stop_words = stop_words
        self.mask = torch.zeros(1, _words(vocab_size), dtype=torch.int32)
        self.done = False
        self._fill()

    def _fill(self) -> None:
        self.matcher.fill_next_token_bitmask(self.mask)
        # Done when the grammar is complete and allows nothing but the stop ids: one AND over the words.
        self.done = self.matcher.is_terminated() or (
            self.matcher.is_completed() and not bool((self.mask[0] & ~self.stop_words).any()))

    @property
    def words(self) -> torch.Tensor:
        """The next step's mask as one (words,) row."""
        return self.mask[0]

    def accept(self, token: int) -> bool:
        """Advance over ``token`` and fill the next mask; False when the grammar does not allow it."""
        if not self.matcher.accept_token(int(token)):
            return False
        if not self.matcher.is_terminated():
            self._fill()
        else:
            self.done = True
        return True


def schema_text(schema: Any) -> str:
    """``schema`` as the compact JSON text that :class:`Grammars` and :func:`check` take."""
    return json.dumps(schema, separators=(",", ":"))
