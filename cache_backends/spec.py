"""Backend specs on the command line: ``name`` or ``name:key=value,key=value`` (e.g. ``gqa:groups=2,method=mean``)."""

from __future__ import annotations


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> tuple[str, dict]:
    """Split a spec into ``(name, options)``; numeric values become int or float.

    Raises:
        ValueError: on an option without ``=``.
    """
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"bad option {item!r} in {spec!r}: expected key=value")
        options[key.strip()] = _value(value.strip())
    return name.strip(), options


def format_spec(name: str, options: dict) -> str:
    return name + (":" + ",".join(f"{k}={v}" for k, v in options.items()) if options else "")
