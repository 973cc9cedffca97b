"""Structured outputs at the API edge: a request's ``response_format`` (OpenAI; or vLLM's ``structured_outputs`` and
``guided_*`` extensions) or ``grammar`` (TGI) to the engine's
grammar fields (:attr:`server.engine.sampling.SamplingParams.grammar_kind` and ``grammar``), refusing a grammar that
cannot be followed before it reaches the engine.

The engine masks every step's logits with the grammar (:mod:`server.engine.grammar`); here the grammar is only
checked (compiled without a vocabulary: fast, and the same compiler as the engine's).
"""

from __future__ import annotations

import json
import re
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
        InvalidRequest: naming ``param``: longer than :data:`MAX_GRAMMAR_CHARS`, or not a grammar llguidance can
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


_METACHARACTERS = re.compile(r"([\\.^$|?*+()\[\]{}])")


def choice_regex(choices: list[str]) -> str:
    """A regular expression matching exactly one of ``choices`` (their metacharacters escaped; other characters,
    spaces included, stand for themselves, as llguidance reads them)."""
    escaped = [_METACHARACTERS.sub(r"\\\1", c) for c in choices]
    return "|".join(f"(?:{c})" for c in escaped)


def _schema_value(value: Any, param: str) -> Any:
    """A schema sent as an object or as its JSON text, as an object."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise InvalidRequest(f"`{param}` must be a JSON schema (an object, or its JSON text)", param) from None
        except RecursionError:
            raise InvalidRequest(f"`{param}` nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep",
                                 param) from None
    return value


def request_grammar(body) -> tuple[str, str]:
    """The grammar fields of an OpenAI request (:class:`server.api.openai_schemas._Sampling`): its
    ``response_format``, or vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``json_object``) or
    ``guided_json`` / ``guided_regex`` / ``guided_choice``; at most one of them constrains.

    Raises:
        InvalidRequest: two constraints at once (naming the second), or one that cannot be followed (naming it).
    """
    found: list[tuple[str, tuple[str, str]]] = []
    grammar = response_format_grammar(body.response_format)
    if grammar != NO_GRAMMAR:
        found.append(("response_format", grammar))
    so = body.structured_outputs
    candidates = [("guided_json", body.guided_json, "json"), ("guided_regex", body.guided_regex, "regex"),
                  ("guided_choice", body.guided_choice, "choice")]
    if so is not None:
        candidates += [("structured_outputs.json", so.json_, "json"), ("structured_outputs.regex", so.regex, "regex"),
                       ("structured_outputs.choice", so.choice, "choice")]
        if so.json_object:
            found.append(("structured_outputs.json_object", ("json_object", "")))
    for param, value, kind in candidates:
        if value is None:
            continue
        if kind == "json":
            found.append((param, json_schema_grammar(_schema_value(value, param), param)))
        elif kind == "regex":
            found.append((param, checked("regex", value, param)))
        else:
            found.append((param, checked("regex", choice_regex(value), param)))
    if len(found) > 1:
        raise InvalidRequest(f"`{found[1][0]}` and `{found[0][0]}` both constrain the output; send one",
                             found[1][0])
    return found[0][1] if found else NO_GRAMMAR


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
    return json_schema_grammar(_schema_value(grammar.value, param), param)
