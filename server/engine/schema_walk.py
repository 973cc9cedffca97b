"""Walks over a JSON schema that the grammar check needs before llguidance sees it (:mod:`server.engine.grammar`):
local ``$ref`` lookups, the optional properties that may open at one position, whether a schema requires a value of
itself inside itself, whether it is a ``$ref`` loop and nothing more, and every string it holds. Each walk visits a
schema once (shared ``$ref`` targets included), so a hostile schema costs time in its size, not in its paths.
"""

from __future__ import annotations

from typing import Any

SUBSCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def resolve(root: Any, ref: Any) -> Any:
    """The local ``$ref`` (``#`` or ``#/a/b``) in ``root``, or ``None`` (a remote or unknown one)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def starting_optional(root: Any, schema: Any, memo: dict[int, int]) -> int:
    """Optional properties of the objects that may start where ``schema`` starts: its own, its ``anyOf``,
    ``oneOf`` and ``allOf`` parts' and its ``$ref``'s (counted whether or not a required property comes first: an
    upper bound). ``memo`` holds each schema's count by ``id``, so that parts shared through ``$ref`` are counted
    once each, not once per path to them (a chain of ``anyOf`` pairs of one ``$ref`` made the paths 2^n); a schema
    met again while it is counted (a cycle) counts 0 there."""
    if not isinstance(schema, dict):
        return 0
    if id(schema) in memo:
        return memo[id(schema)]
    memo[id(schema)] = 0  # a cycle back to it adds nothing
    count = 0
    props = schema.get("properties")
    if isinstance(props, dict):
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        count += len([name for name in props if name not in required])
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            count += sum(starting_optional(root, s, memo) for s in schema[key])
    if "$ref" in schema:
        count += starting_optional(root, resolve(root, schema["$ref"]), memo)
    memo[id(schema)] = count
    return count


def _mandatory_parts(root: Any, schema: dict):
    """The schemas a value of ``schema`` must hold a value of: its required properties', its ``allOf`` parts, its
    ``$ref``, and its ``items`` when ``minItems`` is at least 1 (``anyOf``/``oneOf`` offer a way out: not followed)."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    for name in schema.get("required") if isinstance(schema.get("required"), list) else []:
        if isinstance(name, str) and name in props:
            yield props[name]
    if isinstance(schema.get("allOf"), list):
        yield from schema["allOf"]
    if "$ref" in schema:
        yield resolve(root, schema["$ref"])
    min_items = schema.get("minItems")
    if isinstance(min_items, int) and not isinstance(min_items, bool) and min_items >= 1:
        yield schema.get("items")


def requires_itself(root: Any) -> bool:
    """Whether a value of ``root`` must hold, nested, a value of a schema that holds it in turn (a required property
    whose ``$ref`` leads back): no finite JSON value matches, and llguidance fails with "Too many items" at the
    check or runs to ``max_tokens``. Each schema visited once (three colours, by ``id``)."""
    state: dict[int, int] = {}  # 1: on the path, 2: done
    stack = [(root, iter(_mandatory_parts(root, root)))] if isinstance(root, dict) else []
    if stack:
        state[id(root)] = 1
    while stack:
        node, parts = stack[-1]
        part = next(parts, None)
        if part is None:
            state[id(node)] = 2
            stack.pop()
        elif isinstance(part, dict):
            seen = state.get(id(part))
            if seen == 1:
                return True
            if seen is None:
                state[id(part)] = 1
                stack.append((part, iter(_mandatory_parts(root, part))))
    return False


def subschemas(schema: Any):
    """``schema`` and every schema inside it."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        yield node
        stack.extend(node[k] for k in SUBSCHEMAS + SCHEMA_LISTS if isinstance(node.get(k), (dict, list)))
        stack.extend(v for k in SCHEMA_MAPS if isinstance(node.get(k), dict) for v in node[k].values())
        if isinstance(node.get("additionalProperties"), dict):
            stack.append(node["additionalProperties"])


def subtexts(value: Any):
    """Each string of a parsed JSON value, keys included, as one-item lists (iteratively: no recursion limit)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            yield [node]
        elif isinstance(node, dict):
            stack.extend(node.values())
            yield list(node.keys())
        elif isinstance(node, list):
            stack.extend(node)


REF_ONLY = {"$ref", "$defs", "definitions", "$schema", "$id", "title", "description"}
"""Keys of a schema that is its ``$ref`` and nothing more."""


def only_refers_to_itself(root: Any) -> bool:
    """Whether ``root`` is a ``$ref`` and nothing more whose chain of such ``$ref``s comes back to itself."""
    node, seen = root, []
    while isinstance(node, dict) and "$ref" in node and not set(node) - REF_ONLY:  # a $ref and nothing else
        if any(node is s for s in seen):
            return True
        seen.append(node)
        node = resolve(root, node["$ref"])
    return False
