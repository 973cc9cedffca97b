"""Checks shared by the route modules: refuse what this server does not implement, naming the field."""

from __future__ import annotations

from pydantic import BaseModel

from server.service import InvalidRequest


def _is_set(value) -> bool:
    """Clients send many unset fields as ``null``, ``false``, ``[]`` or ``{}``: those ask for nothing."""
    return not (value is None or value is False or value == [] or value == {})


def refuse_unimplemented(model: BaseModel, path: str = "") -> None:
    """Raise for the first key of ``model`` (or of a model nested in it) that its schema does not define
    and that is set to something.

    Args:
        model: a parsed request body (its models must allow extra keys).
        path: prefix for the field name in the message (e.g. ``parameters.``).

    Raises:
        InvalidRequest: naming the field, with ``param`` set to it.
    """
    for key, value in (model.model_extra or {}).items():
        if _is_set(value):
            raise InvalidRequest(f"`{path}{key}` is not supported by this server", f"{path}{key}")
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            refuse_unimplemented(value, f"{path}{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    refuse_unimplemented(item, f"{path}{name}[{i}].")
