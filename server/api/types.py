"""Field types shared by the wire schemas."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator


def _integral_float_to_int(v):
    # JSON Schema's "integer" includes 3.0; strict pydantic would refuse it, so integral floats pass as ints.
    # Strings, booleans and fractional numbers are still refused.
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


Int = Annotated[int, BeforeValidator(_integral_float_to_int)]
"""An integer field in strict schemas that also accepts integral JSON numbers such as ``3.0``."""


KV_COMPRESSED_FRACTION = ("kvserve extension, `elastic` only: the share of the request's cached tokens held as int8 "
                          "codes when it finished (0: all exact); omitted for other backends.")


def drop_unset_extensions(data: dict, names: tuple[str, ...]) -> dict:
    """``data`` without the extension fields ``names`` that are ``None`` (a client of the plain API sees none)."""
    return {k: v for k, v in data.items() if not (k in names and v is None)}


def inline_schema(*models) -> dict:
    """A self-contained JSON schema (no ``$ref``) for one model, or ``anyOf`` several — for documenting
    Server-Sent Event payloads, which FastAPI does not register as components.

    Args:
        models: pydantic model classes, or plain JSON-schema dicts.
    """
    def resolve(node, defs):
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
            return {k: resolve(v, defs) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [resolve(v, defs) for v in node]
        return node

    schemas = []
    for m in models:
        raw = m if isinstance(m, dict) else m.model_json_schema(mode="serialization")
        schemas.append(resolve(raw, raw.get("$defs", {})))
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def sse_schema(*models, all_json: bool = True) -> dict:
    """Schema of one Server-Sent Event whose ``data`` field carries JSON of one of ``models``.

    With ``all_json=False`` (OpenAI streams, which end with the non-JSON ``data: [DONE]``) the payload
    schema is given as documentation only, without declaring the data as JSON.
    """
    data = {"type": "string", "contentSchema": inline_schema(*models)}
    if all_json:
        data["contentMediaType"] = "application/json"
    else:
        data["description"] = "a JSON chunk, or the final `[DONE]`"
    return {"type": "object", "required": ["data"],
            "properties": {"data": data, "event": {"type": "string"}, "id": {"type": "string"},
                           "retry": {"type": "integer"}}}
