"""The base of every request body: ``null`` means unset, and the JSON schema says what is accepted."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, model_validator

UNSET_VALUE = {"anyOf": [{"type": "null"}, {"const": False}, {"type": "array", "maxItems": 0},
                         {"type": "object", "maxProperties": 0}]}
"""JSON schema of an unset value (``null``, ``false``, ``[]``, ``{}``): all that a key the schema does not define
may carry (:func:`server.api.validation.refuse_unimplemented` refuses the rest)."""

CONSTRAINTS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}
"""pydantic's names of the bounds it leaves in a schema (on ``Int | None`` fields), and JSON Schema's."""


def _nullable(schema: dict) -> bool:
    return schema.get("type") == "null" or any(s.get("type") == "null" for s in schema.get("anyOf", ()))


class RequestModel(BaseModel):
    """A request body (or a part of one). ``null`` for an optional field means unset: the field takes its
    default, as vLLM and TGI read it (clients such as text-generation's ``chat()`` send every field, ``null``
    when unset). Its JSON schema says so: every optional field also takes ``null``, and when the model allows
    keys it does not define (``extra="allow"``), their values must be unset (:data:`UNSET_VALUE`)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = {name for name, f in cls.model_fields.items() if not f.is_required()}
        return {k: v for k, v in data.items() if not (v is None and k in optional)}

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        schema = handler.resolve_ref_schema(handler(core_schema))
        properties = schema.get("properties", {})
        for name, f in cls.model_fields.items():
            prop = properties.get(name)
            if prop is None or f.is_required() or _nullable(prop):
                continue
            meta = {k: prop.pop(k) for k in ("title", "description", "default", "examples") if k in prop}
            properties[name] = {"anyOf": [prop, {"type": "null"}], **meta}
        if schema.get("additionalProperties") is True:
            schema["additionalProperties"] = UNSET_VALUE
        return schema


def json_schema_keywords(node: Any) -> Any:
    """``node`` (an OpenAPI document or a part of it) with pydantic's leftover bound names (``ge``, ``gt``,
    ``le``, ``lt``) in each schema replaced by JSON Schema's (``minimum``, ...), in place."""
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            for ours, theirs in CONSTRAINTS.items():
                if ours in node and not isinstance(node[ours], dict):
                    node[theirs] = node.pop(ours)
        for value in node.values():
            json_schema_keywords(value)
    elif isinstance(node, list):
        for value in node:
            json_schema_keywords(value)
    return node
