"""Structured outputs in the engine: one grammar matcher per sequence, built with llguidance (the engine vLLM and
SGLang offer beside xgrammar; a 3 MB wheel with no dependencies, where xgrammar pulls in triton, about 1 GB, on every
Linux install).

A request asks for a grammar through two plain fields of its :class:`~server.engine.sampling.SamplingParams`:
``grammar_kind`` (one of :data:`KINDS`) and ``grammar`` (the JSON schema as JSON text, or the regular expression).
The engine compiles each request's grammar (:class:`Grammars`, in a thread beside the steps,
:meth:`server.engine.engine.Engine.submit`) and gives each sequence its own :class:`GrammarState` (``n`` > 1: one per
choice). Each step the state's ``mask`` — the next token's allowed ids as an int32 bitmask, (ceil(vocab / 32),), the
layout llguidance and xgrammar share — goes to the sampler with the row
(:func:`server.engine.sampling.apply_allowed`); the accepted token advances it (:meth:`GrammarState.accept`). The
state depends only on the sequence's output tokens, which preemption and the prefix cache leave as they are (a
recomputed context is prefilled, never sampled again), so it lives on the sequence across both.

When the grammar can only end (a JSON value closed, nothing but end-of-text allowed), :attr:`GrammarState.done` is
set and the engine ends the sequence at once, as end-of-text would (``finish_reason`` ``stop``), without a step to
sample the end-of-text token.

llguidance is imported on the first grammar only: a server that never gets one never loads it.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import torch

from server.engine import schema_walk

log = logging.getLogger(__name__)

KINDS = ("json_object", "json_schema", "regex")
"""``grammar_kind`` values: any JSON object; a JSON schema (``grammar`` is its JSON text); a regular expression."""
JSON_OBJECT = '{"type": "object"}'
"""The schema of ``json_object``: any JSON object (not any JSON value)."""


GRAMMAR_FAILED = "the request's grammar cannot go on"
"""How the engine's error for a grammar that fails mid-output begins (the HTTP side answers it as the client's)."""

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""No free whitespace between tokens (vLLM's disable_any_whitespace): a small model given the choice writes newlines
until its budget ends; the JSON keeps the usual ", " and ": " separators."""


class GrammarError(ValueError):
    """A grammar that cannot be compiled (the message says why, as llguidance reports it)."""


def _llguidance():
    import llguidance  # noqa: PLC0415 - lazy: only grammar requests need it
    import llguidance.hf  # noqa: PLC0415
    import llguidance.torch  # noqa: PLC0415

    return llguidance


def strict_schema(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that does not say otherwise, as
    OpenAI's strict structured outputs and xgrammar's strict mode read a schema: an object holds the properties its
    schema names and no others (a small model otherwise keeps adding keys instead of closing the object)."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in schema_walk.SUBSCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = strict_schema(out[key])
    for key in schema_walk.SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s) for s in out[key]]
    for key in schema_walk.SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(s) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict_schema(out["additionalProperties"])
    typ = out.get("type")
    is_object = typ == "object" or (isinstance(typ, list) and "object" in typ) or "properties" in out
    if is_object and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _grammar_text(kind: str, grammar: str) -> str:
    """llguidance's grammar for ``kind`` and ``grammar`` (unchecked: a matcher or :func:`_validate` says what is
    wrong).
    A ``json_schema`` is read strictly (:func:`strict_schema`); ``json_object`` is any object."""
    matcher = _llguidance().LLMatcher
    if kind in ("json_object", "json_schema"):
        schema = json.loads(grammar) if kind == "json_schema" else json.loads(JSON_OBJECT)  # not JSON: ValueError
        if kind == "json_schema":
            schema = strict_schema(schema)
        return matcher.grammar_from_json_schema(schema_text(schema), defaults=JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(grammar)
    raise GrammarError(f"unknown grammar kind {kind!r}; one of {', '.join(KINDS)}")


_ITEMS_PER_OPTIONAL = 4
"""Earley items one optional property adds to the row the matcher predicts where its object may start (measured on
llguidance 1.9: an object of ``n`` optional properties makes a row of ``4 n - 1`` items, alternatives of an
``anyOf`` at one position add up)."""


def _max_optional() -> int:
    """The most optional properties the objects that may start at one position can hold together."""
    return (_llguidance().LLParserLimits().max_items_in_row + 1) // _ITEMS_PER_OPTIONAL


def _check_optional(grammar: str) -> None:
    """Refuse a schema whose objects hold more optional properties at one position than the matcher's row holds:
    it compiles and starts, then fails where the object opens ("Current row has N items; max is 2000"), mid-output.

    Raises:
        GrammarError: such a schema (a schema that is not JSON is left to the compiler to say so).
    """
    try:
        schema = json.loads(grammar)
    except ValueError:
        return
    # a $ref loop and nothing more: llguidance refuses it, and _matches_nothing says why
    if schema_walk.requires_itself(schema) and not schema_walk.only_refers_to_itself(schema):
        raise GrammarError("the schema requires a value of itself inside itself (a required property, `allOf`, "
                           "`$ref` or `minItems` leads back to it): no finite JSON value matches it")
    bound, memo = _max_optional(), {}
    for node in schema_walk.subschemas(schema):
        count = schema_walk.starting_optional(schema, node, memo)
        if count > bound:
            raise GrammarError(f"an object of {count} optional properties (with its alternatives): the matcher "
                               f"holds at most {bound} where an object opens")


def _validate(text: str) -> None:
    """Check ``text`` alone, without a vocabulary (what :func:`check` does before :func:`use_vocabulary`)."""
    error = _llguidance().LLMatcher.validate_grammar(text, None)
    if error:
        raise GrammarError(_reason(error))


FORCED_STEPS = 64
"""Tokens :meth:`Grammars.check` follows where the grammar allows only one (a JSON schema's opening ``{"key": ``)."""
_CHECKER: list["Grammars"] = []
"""The served model's :class:`Grammars` that :func:`check` runs each grammar on (:func:`use_vocabulary`)."""


def use_vocabulary(tokenizer, vocab_size: int, stop_ids) -> None:
    """Let :func:`check` run each grammar on the served model's vocabulary (built on the first check), so a grammar
    that compiles but cannot be followed (a recursive ``$ref``, an object of thousands of optional properties past
    the matcher's limits, a regular expression past its lexer's) is refused before it reaches the engine."""
    _CHECKER[:] = [Grammars(tokenizer, vocab_size, stop_ids)]


def check(kind: str, grammar: str) -> None:
    """Compile ``grammar`` to refuse a bad one before it reaches the engine: on the served model's vocabulary once
    :func:`use_vocabulary` set it (:meth:`Grammars.check`), else alone.

    Args:
        kind: one of :data:`KINDS`.
        grammar: the JSON schema as JSON text (``json_schema``), the regular expression (``regex``), or ``""``.

    Raises:
        GrammarError: an unknown kind, a schema that is not JSON or not a schema llguidance can follow (an unknown
            ``type``, ``properties`` that is not an object, a ``$ref`` that only refers to itself, more optional
            properties than the matcher holds, ...), or a regular expression that does not parse (one ending in a
            lone backslash too) or is past the matcher's lexer.
    """
    if kind == "json_object":
        return
    _check_unicode(kind, grammar)
    if kind == "regex" and (len(grammar) - len(grammar.rstrip("\\"))) % 2:
        raise GrammarError("the regular expression ends in a lone backslash")
    checker = _CHECKER[0] if _CHECKER else None
    if checker is not None and checker.vocab is None:  # a tokenizer llguidance cannot read: checked alone
        checker = None
    try:
        if kind == "json_schema":
            _check_optional(grammar)
        if checker is not None:
            checker.check(kind, grammar)
        else:
            _validate(_grammar_text(kind, grammar))
    except GrammarError as exc:
        if str(exc) == NO_EXTENSION:
            raise GrammarError(_matches_nothing(kind, grammar)) from None
        raise
    except RecursionError:
        raise GrammarError("nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - llguidance and json raise ValueError/RuntimeError with the reason
        raise GrammarError(_reason(str(exc) or type(exc).__name__)) from None


def _check_unicode(kind: str, grammar: str) -> None:
    """Refuse a grammar holding text that is not valid Unicode (a lone surrogate, which JSON's ``\\u`` escapes
    carry): llguidance's own message for it ("unexpected end of hex escape") names neither the text nor the cause."""
    texts = [grammar]
    if kind == "json_schema":
        try:
            texts = [t for node in schema_walk.subtexts(json.loads(grammar)) for t in node]
        except ValueError:
            return  # not JSON: the compiler says so
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise GrammarError(f"it holds text that is not valid Unicode: {exc.reason} in "
                               f"`{text[:40].encode('utf-8', 'backslashreplace').decode()}`") from None


NO_EXTENSION = "NoExtensionBias"
"""llguidance's whole message where no token can start the grammar: nothing matches it."""


def _matches_nothing(kind: str, grammar: str) -> str:
    """Why a grammar no token can start (llguidance's :data:`NO_EXTENSION`) cannot be followed, in words."""
    if kind == "regex":
        return "no string matches the regular expression"
    try:
        root = json.loads(grammar)
    except ValueError:
        root = None
    if schema_walk.only_refers_to_itself(root):
        return "the schema only refers to itself: no value matches it"
    return "no JSON value matches the schema"


def _reason(text: str) -> str:
    """llguidance's message in one line: its first, without the position prefix (``at 1(8): ``), and the
    ``error: ...`` line a regular expression's parse error carries further down."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    first = lines[0] if lines else "invalid grammar"
    if "regex for integer range" in first:  # its bound clamped to 64 bits: a value the client never sent
        return "an integer's `minimum` or `maximum` is beyond the 64-bit integers the matcher bounds"
    if first.startswith("at ") and "): " in first:
        first = first.split("): ", 1)[1]
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return f"{first} {detail}" if detail and detail not in first else first


class Grammars:
    """Grammar matchers on one model's vocabulary: the engine's (one :class:`GrammarState` per sequence) and the HTTP
    side's check (:func:`use_vocabulary`). The vocabulary's llguidance tables are built on first use.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: width of the model's logits (may exceed the tokenizer's length: padding ids are never allowed).
        stop_ids: the ids that end a sequence (the engine's end-of-text ids); allowed where the grammar may end.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self._vocab: list = []  # [llguidance's tokenizer], or [None] when it cannot read this one
        self._stop_words: torch.Tensor | None = None
        self._lock = threading.Lock()

    @property
    def vocab(self):
        """llguidance's tables of the vocabulary (built once), or ``None`` when llguidance cannot read the
        tokenizer (logged)."""
        with self._lock:
            if not self._vocab:
                try:
                    self._vocab.append(_llguidance().hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                                       eos_token=self.stop_ids or None))
                except Exception as exc:  # noqa: BLE001 - the reason goes to the log; state() then fails with it
                    log.warning("llguidance cannot read the tokenizer: %s", exc)
                    self._vocab.append(None)
                stop = torch.zeros(_words(self.vocab_size), dtype=torch.int32)
                for t in self.stop_ids:
                    if t < self.vocab_size:
                        stop[t // 32] |= _bit(t % 32)
                self._stop_words = stop
        return self._vocab[0]

    def state(self, kind: str, grammar: str) -> "GrammarState":
        """A new matcher at the grammar's start, its first mask filled.

        Raises:
            GrammarError: the grammar does not compile, or no token can start it.
        """
        vocab = self.vocab
        if vocab is None:
            raise GrammarError("llguidance cannot read this model's tokenizer")
        try:
            matcher = _llguidance().LLMatcher(vocab, _grammar_text(kind, grammar))
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise GrammarError(_reason(str(exc) or type(exc).__name__)) from None
        if matcher.is_error():
            raise GrammarError(_reason(matcher.get_error()))
        state = GrammarState(matcher, self.vocab_size, self._stop_words)
        if state.error is not None:
            raise GrammarError(state.error)
        return state

    def check(self, kind: str, grammar: str) -> None:
        """Start the grammar and follow its forced tokens (at most :data:`FORCED_STEPS`): a grammar that fails
        there (past one of the matcher's limits, or with no token to go on) raises :class:`GrammarError`."""
        state = self.state(kind, grammar)
        for _ in range(FORCED_STEPS):
            forced = [] if state.done else state.matcher.compute_ff_tokens()
            if not forced:
                break
            for token in forced:
                if not state.accept(token):
                    raise GrammarError(state.error or "a forced token does not follow the grammar")
                if state.done:
                    break
        if state.error is not None:
            raise GrammarError(state.error)


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
        _llguidance().torch.fill_next_token_bitmask(self.matcher, self.mask, 0)
        # Done when the grammar is complete and allows nothing but the stop ids: one AND over the words.
        self.done = self.matcher.is_stopped() or (
            self.matcher.is_accepting() and not bool((self.mask[0] & ~self.stop_words).any()))

    @property
    def error(self) -> str | None:
        """Why the matcher cannot go on (past one of its limits, or no token can continue), or ``None``."""
        if self.matcher.is_error():
            return _reason(self.matcher.get_error())
        if not self.done and not bool(self.mask.any()):
            return "no token can continue the output"
        return None

    @property
    def words(self) -> torch.Tensor:
        """The next step's mask as one (words,) row."""
        return self.mask[0]

    def accept(self, token: int) -> bool:
        """Advance over ``token`` and fill the next mask; False when the grammar does not allow it."""
        if not self.matcher.consume_token(int(token)) or self.matcher.is_error():
            return False
        if self.matcher.is_stopped():
            self.done = True
        else:
            self._fill()
        return True


def schema_text(schema: Any) -> str:
    """``schema`` as the compact JSON text that :class:`Grammars` and :func:`check` take."""
    return json.dumps(schema, separators=(",", ":"))
