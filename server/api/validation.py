"""Checks shared by the route modules: refuse what this server does not implement, naming the field."""

from __future__ import annotations

from pydantic import BaseModel

from server.service import InvalidRequest


def _is_set(value) -> bool:
    """Clients send many unset fields as ``null``, ``false``, ``[]`` or ``{}``: those ask for nothing."""
    return not (value is None or value is False or value == [] or value == {})


def refuse_unimplemented(model: BaseModel, path: str = "") -> None:
    """Raise for the first key of ``model`` (or of a model nested in it) that its schema does not define
    and that is set to something; a key that a nested model defines (TGI's ``kv_backend`` or ``max_new_tokens``
    beside ``inputs`` instead of in ``parameters``) is refused naming where it goes (``parameters.kv_backend``).

    Args:
        model: a parsed request body (its models must allow extra keys).
        path: prefix for the field name in the message (e.g. ``parameters.``).

    Raises:
        InvalidRequest: naming the field, with ``param`` set to it.
    """
    nested = {name: f.annotation for name, f in type(model).model_fields.items()
              if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}
    for key, value in (model.model_extra or {}).items():
        if not _is_set(value):
            continue
        home = next((name for name, cls in nested.items() if key in cls.model_fields), None)
        if home is not None:  # TGI's {"inputs": ..., "kv_backend": ...}: a field of `parameters`, one level up
            raise InvalidRequest(f"`{path}{key}` goes in `{path}{home}`, as `{path}{home}.{key}`: "
                                 f"{{..., \"{home}\": {{\"{key}\": ...}}}}", f"{path}{key}")
        raise InvalidRequest(f"`{path}{key}` is not supported by this server", f"{path}{key}")
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            refuse_unimplemented(value, f"{path}{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    refuse_unimplemented(item, f"{path}{name}[{i}].")
