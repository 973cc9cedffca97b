"""Backend specs on the command line: ``name`` or ``name:key=value,key=value`` (e.g. ``gqa:groups=2,method=mean``).

Every option a backend or the estimator knows has the type, lower bound or allowed values its backend declares
(:class:`cache_backends.declaration.Option`), checked here, so that a bad value is refused with one line naming the
spec and the option, never replaced by a default.
"""

from __future__ import annotations

import math
import re

from cache_backends import catalog
from cache_backends.declaration import Option

def _option(key: str, spec: str) -> Option | None:
    """The declared option ``key`` of the backend ``spec`` names (of the first part declaring it), else of any
    backend declaring one of that name (a spec with an unknown name still gets its values typed)."""
    parts = spec.partition(":")[0].strip().split("+")
    decls = [catalog.get(p) for p in parts if catalog.get(p)] + list(catalog.declarations().values())
    return next((d.option(key) for d in decls if d.option(key)), None)


TRUE = frozenset({"true", "t", "1", "yes", "y", "on"})
FALSE = frozenset({"false", "f", "0", "no", "n", "off"})
"""A boolean option's spellings in a spec, case aside: those pydantic reads for a ``KV_*`` boolean setting."""


def _value(key: str, text: str, spec: str):
    option = _option(key, spec)
    kind = option.kind if option else None
    low = (option.choices or option.low) if option else None
    if kind is bool:  # the spellings the KV_* settings take (pydantic's booleans), so a spec reads as they do
        if text.lower() not in TRUE | FALSE:
            raise ValueError(f"{spec}: {key} must be true or false (or 1/0, yes/no, on/off), got {text!r}")
        return text.lower() in TRUE
    if isinstance(low, tuple) and kind is int:  # a closed set of integers (bit widths)
        if text not in {str(v) for v in low}:
            raise ValueError(f"{spec}: {key} must be one of {', '.join(map(str, low))}, got {text!r}")
        return int(text)
    if kind is str:
        if text not in low:
            raise ValueError(f"{spec}: {key} must be one of {', '.join(low)}, got {text!r}")
        return text
    try:
        value = int(text) if kind is int else float(text)
    except ValueError:
        if kind is None:  # an option no backend knows: keep it for the backend to name in its refusal
            return text
        raise ValueError(f"{spec}: {key} must be {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    if not math.isfinite(value):  # nan, inf, 1e400
        if kind is None:
            return text
        raise ValueError(f"{spec}: {key} must be a finite number, got {text!r}")
    if kind is None and value == int(value) and "." not in text:
        value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{spec}: {key} must be >= {low}, got {text}")
    if (high := option.highest() if option else None) is not None and value > high:
        raise ValueError(f"{spec}: {key} must be <= {high}, got {text}")
    return value


def parse_spec(spec: str) -> tuple[str, dict]:
    """Split a spec into ``(name, options)``, each known option converted to its type and bound-checked.

    Raises:
        ValueError: on an option without ``=``, one given twice (``rank=8,rank=16``: the last silently won), a
            value of the wrong type (``rank=abc``, ``groups=1.5``) or below its bound (``groups=0``,
            ``residual=-1``) or above it (``window=99999999999999999999``), naming the spec.
    """
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad option {item!r} in {spec!r}: expected key=value")
        if key.strip() in options:
            raise ValueError(f"{spec}: {key.strip()} is given twice")
        options[key.strip()] = _value(key.strip(), value.strip(), spec)
    return name.strip(), options


def check_composition(name: str) -> None:
    """Refuse a ``+`` name that is not a supported composition (``int8+mla``), listing those that are; a ``window``
    composition that a backend declares a refusal for names why (:attr:`~cache_backends.declaration.BackendDecl.refusals`).

    Raises:
        ValueError: naming it.
    """
    parts = name.split("+")
    if "+" not in name or name in catalog.compositions():
        return
    for part in parts:  # a backend that says why it does not compose with the other part
        decl = catalog.get(part)
        if decl is None or not decl.refusals:
            continue
        other = next((p for p in parts if p != part), part)
        why = decl.refusals.get(other)
        ways = " or ".join(f"{part}+{inner}" for inner in decl.inners)
        raise ValueError(f"unsupported combination {name!r}: " + (f"{why}; " if why else "")
                         + f"{part} composes only as {ways}")
    raise ValueError(f"unsupported combination {name!r}; supported: {', '.join(catalog.compositions())}")


def budget_hint(name: str, served: bool = True) -> str:
    """What to say beside "unknown backend" for a name carrying ``kvserve bench``'s ``@budget`` (``mla@budget``,
    ``mla@budget:rank=3``), which only bench takes; ``""`` for any other name. ``served``: the name is a backend to
    serve or calibrate (the budget chooses its setting at start-up), else a spec to size (``estimate``, ``advise``)."""
    if "@" not in name:
        return ""
    base = name.split("@", 1)[0] or "mla"
    then = (f"give the backend, {base!r}, whose setting the budget chooses at start-up when its options are left "
            "unset" if served else f"give a setting to size, {base!r} (the estimator's default) or {base}:key=value")
    return f" ('@budget' is kvserve bench's alone: it measures the setting the quality budget chooses; here {then})"


def served_spec_hint(name: str) -> str:
    """What to say beside "unknown backend" for a ``KV_BACKEND``/``KV_BACKENDS`` entry written as a spec
    (``snapkv:capacity=64``): a served backend takes its options from settings, which it names; ``""`` for a name
    without options or whose base is not a backend."""
    base, _, rest = name.partition(":")
    if not rest or base.strip() not in catalog.available():
        return ""
    settings = []
    for pair in filter(None, (p.strip() for p in rest.split(","))):
        key, _, value = pair.partition("=")
        option = _option(key.strip(), name)
        if option is not None and option.setting:
            settings.append(f"{option.setting.upper()}={value.strip()}")
    said = " ".join(settings) or f"the {base.strip().upper().replace('+', '_')} settings (kvserve serve --help)"
    return (f" (a served backend is named alone and takes its options from settings: {base.strip()} with {said}; "
            "name:key=value specs are for kvserve estimate, advise and bench)")


def check_options(name: str, options: dict) -> None:
    """Refuse a name that is neither a backend nor a supported composition, and options that backend ``name`` (or
    each part of a composition like ``mla+int8``) does not take.

    Raises:
        ValueError: naming the unknown backend, combination or options, a value below its part's bound (``window``'s
            ``window`` below 1, where ``dca``'s may be 0), or one the part's :attr:`BackendDecl.check` refuses.
    """
    parts = name.split("+")
    unknown_parts = [p for p in parts if catalog.get(p) is None]
    if unknown_parts:
        raise ValueError(f"unknown backend {unknown_parts[0]!r}; allowed: {', '.join(catalog.names())}"
                         + budget_hint(name, served=False))
    check_composition(name)
    unknown = set(options) - set().union(*(catalog.get(p).option_names() for p in parts))
    if unknown:
        raise ValueError(f"{name} takes no option {', '.join(sorted(unknown))}")
    for part in parts:
        decl = catalog.get(part)
        for key, value in options.items():
            option = decl.option(key)
            if option and option.low is not None and isinstance(value, (int, float)) and value < option.low:
                raise ValueError(f"{format_spec(name, options)}: {key} must be >= {option.low}, got {value}")
            high = option.highest() if option else None
            if high is not None and isinstance(value, (int, float)) and value > high:
                raise ValueError(f"{format_spec(name, options)}: {key} must be <= {high}, got {value}")
        if decl.check is not None:
            decl.check(format_spec(name, options), options)


def format_options(options: dict, sep: str = ",") -> str:
    """``options`` as ``key=value`` pairs joined by ``sep``, a boolean written ``true``/``false`` as specs and
    ``KV_*`` settings take it (``rotate=true``, whichever of ``TRUE``, ``True``, ``true`` was given)."""
    def text(value) -> str:
        return ("true" if value else "false") if isinstance(value, bool) else str(value)
    return sep.join(f"{k}={text(v)}" for k, v in options.items())


_PYTHON_BOOLEAN = re.compile(r"(?<==)(True|False)\b")


def echo_recorded(spec: str) -> str:
    """A spec recorded as text (a ``spec`` field of a benchmark's JSON, written before specs echoed their booleans
    ``true``/``false``) in the spelling :func:`format_spec` echoes: ``rotate=True`` as ``rotate=true``; the rest as
    it is (a note such as `` (every token kept)``, options in the order recorded)."""
    return _PYTHON_BOOLEAN.sub(lambda m: m.group(1).lower(), spec)


def format_spec(name: str, options: dict) -> str:
    """The spec ``name:key=value,...`` that :func:`parse_spec` reads back into ``(name, options)``, in one
    canonical spelling (booleans ``true``/``false``, :func:`format_options`): the form every echo of a spec uses
    (``/info``, ``kvserve estimate``/``advise``/``bench``) and the key of a price in the calibration cache, so that
    ``int8:rotate=TRUE`` and ``int8:rotate=true`` are one setting and one cache entry."""
    return name + (":" + format_options(options) if options else "")
