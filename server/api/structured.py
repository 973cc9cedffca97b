"""Structured outputs at the API edge: a request's ``response_format`` (OpenAI) or ``grammar`` (TGI) to the engine's
grammar fields (:attr:`server.engine.sampling.SamplingParams.grammar_kind` and ``grammar``), refusing a grammar that
cannot be followed before it reaches the engine.

The engine masks every step's logits with the grammar (:mod:`server.engine.grammar`); here the grammar is only
checked (compiled without a vocabulary: fast, and the same compiler as the engine's).
"""

from __future__ import annotations

import json
from typing import Any

from server.engine.grammar import GrammarError, check, schema_text
from server.service import InvalidRequest

MAX_GRAMMAR_CHARS = 65_536
"""Longest schema (as compact JSON text) or regular expression a request may send: compiling it runs on the
engine's loop."""

MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of objects and arrays in a schema: turning a schema into a grammar grows with the cube of its
depth (a 400-deep one took 7 s here, on the event loop), and real schemas nest a few levels."""

NO_GRAMMAR = ("", "")


def _depth(value: Any) -> int:
    """Nesting depth of objects and arrays in ``value`` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def checked(kind: str, grammar: str, param: str) -> tuple[str, str]:
    """``(kind, grammar)`` once it compiles.

    Raises:
        InvalidRequest: naming ``param``: longer than :data:`MAX_GRAMMAR_CHARS`, or not a grammar xgrammar can
            follow (with its reason).
    """
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"`{param}` is {len(grammar)} characters as JSON; at most {MAX_GRAMMAR_CHARS}", param)
    try:
        check(kind, grammar)
    except GrammarError as exc:
        raise InvalidRequest(f"`{param}` cannot be followed: {exc}", param) from None
    return kind, grammar


def json_schema_grammar(schema: Any, param: str) -> tuple[str, str]:
    """The grammar fields of a JSON schema (a dict) sent in ``param``.

    Raises:
        InvalidRequest: naming ``param``, for a schema that is not an object, nests deeper than
            :data:`MAX_SCHEMA_DEPTH`, or cannot be followed.
    """
    if not isinstance(schema, dict):
        raise InvalidRequest(f"`{param}` must be a JSON schema (an object)", param)
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidRequest(f"`{param}` nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep", param)
    return checked("json_schema", schema_text(schema), param)


def response_format_grammar(response_format) -> tuple[str, str]:
    """The grammar fields of OpenAI's ``response_format`` (a parsed
    :class:`server.api.openai_schemas.ResponseFormat`, or ``None``): ``("", "")`` for none or ``text``.

    Raises:
        InvalidRequest: ``json_schema`` without its ``json_schema`` object, a ``json_schema`` object with another
            type, or a schema that cannot be followed (naming ``response_format.json_schema.schema``).
    """
    if response_format is None or response_format.type == "text":
        if response_format is not None and response_format.json_schema is not None:
            raise InvalidRequest("`response_format.json_schema` goes with `type: json_schema` only",
                                 "response_format.json_schema")
        return NO_GRAMMAR
    if response_format.type == "json_object":
        if response_format.json_schema is not None:
            raise InvalidRequest("`response_format.json_schema` goes with `type: json_schema` only",
                                 "response_format.json_schema")
        return "json_object", ""
    if response_format.json_schema is None:
        raise InvalidRequest("`response_format.json_schema` is required with `type: json_schema`",
                             "response_format.json_schema")
    return json_schema_grammar(response_format.json_schema.schema_, "response_format.json_schema.schema")


def tgi_grammar(grammar) -> tuple[str, str]:
    """The grammar fields of TGI's ``parameters.grammar`` (a parsed :class:`server.api.tgi_schemas.TGIGrammar`, or
    ``None``): ``json`` takes a JSON schema (an object, or its JSON text), ``regex`` a regular expression.

    Raises:
        InvalidRequest: naming ``parameters.grammar.value``.
    """
    if grammar is None:
        return NO_GRAMMAR
    param = "parameters.grammar.value"
    if grammar.type == "regex":
        if not isinstance(grammar.value, str) or not grammar.value:
            raise InvalidRequest(f"`{param}` must be a regular expression (a non-empty string)", param)
        return checked("regex", grammar.value, param)
    value = grammar.value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidRequest(f"`{param}` must be a JSON schema (an object, or its JSON text)", param) from None
    return json_schema_grammar(value, param)
