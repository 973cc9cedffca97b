"""Backend specs on the command line: ``name`` or ``name:key=value,key=value`` (e.g. ``gqa:groups=2,method=mean``).

Every option a backend or the estimator knows has one type and one lower bound, checked here, so that a
bad value is refused with one line naming the spec and the option, never replaced by a default.
"""

from __future__ import annotations

import math

# option -> (type, smallest allowed value, or the allowed words of a str option / values of an int one)
OPTIONS: dict[str, tuple[type, float | tuple[str, ...] | None]] = {
    "groups": (int, 1),  # gqa: shared K/V heads per layer
    "method": (str, ("pca", "mean")),  # gqa: calibrated shared head or plain mean pooling
    "rank": (int, 1),  # mla: latent width per token per layer
    "rope_dim": (int, 0),  # mla (estimate): width of a native-MLA model's shared rope key
    "group_size": (int, 1),  # int8/int4: tokens (keys) / channels (values) per quantization group
    "residual": (int, 0),  # int8/int4: full-precision recent window, tokens
    "bits": (int, (4, 8)),  # elastic: code width of its compressed tier
    "key_bits": (int, (4, 8)),  # int8/int4: bits per key code (k8v4: int8:value_bits=4)
    "value_bits": (int, (4, 8)),  # int8/int4: bits per value code
    "rotate": (bool, None),  # int8/int4: Hadamard-rotate K/V before quantizing (QuaRot)
    "threshold": (float, None),  # dca: similarity at or above which a layer reuses its source
    "probe_interval": (int, 1),  # dca: decode steps between similarity probes
    "align": (str, ("linear", "none")),  # dca: fitted map between layers, or none
    "reuse_fraction": (float, 0),  # dca (estimate): fraction of layers reused
    "window": (int, 0),  # dca: a reuse layer's residual window of its own K/V; window: recent tokens seen (>= 1)
    "sinks": (int, 0),  # window: attention-sink tokens every query keeps seeing (StreamingLLM)
}


def default_gqa_groups(num_key_value_heads: int) -> int:
    """gqa's default shared K/V heads per layer: the largest divisor of ``num_key_value_heads`` that is at most a
    quarter of it (at least 1), e.g. 2 of 8, 1 of 3, 1 of 9 (a plain ``heads // 4`` would not divide 9)."""
    quarter = max(1, num_key_value_heads // 4)
    return max(g for g in range(1, quarter + 1) if num_key_value_heads % g == 0)


def _value(key: str, text: str, spec: str):
    kind, low = OPTIONS.get(key, (None, None))
    if kind is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{spec}: {key} must be true or false, got {text!r}")
        return text.lower() == "true"
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
    return value


def parse_spec(spec: str) -> tuple[str, dict]:
    """Split a spec into ``(name, options)``, each known option converted to its type and bound-checked.

    Raises:
        ValueError: on an option without ``=``, one given twice (``rank=8,rank=16``: the last silently won), a
            value of the wrong type (``rank=abc``, ``groups=1.5``) or below its bound (``groups=0``,
            ``residual=-1``), naming the spec.
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


# backend -> the options it takes (a composition takes the union of its parts')
BACKEND_OPTIONS: dict[str, set[str]] = {
    "full": set(),
    "gqa": {"groups", "method"},
    "mla": {"rank", "rope_dim"},
    "int8": {"group_size", "residual", "key_bits", "value_bits", "rotate"},
    "int4": {"group_size", "residual", "key_bits", "value_bits", "rotate"},
    "dca": {"threshold", "probe_interval", "align", "window", "reuse_fraction"},
    "elastic": {"group_size", "window", "bits"},
    "window": {"sinks", "window"},
}


COMPOSITIONS = ("gqa+int8", "mla+int8", "dca+int8", "dca+mla", "gqa+int4", "mla+int4", "dca+int4", "window+int8",
                "window+int4")
"""The compositions kvserve serves (an outer backend over a quantized or latent inner one)."""

NATIVE_MLA_BACKENDS = ("full", "mla", "mla+int8", "mla+int4")
"""What a natively-MLA model (DeepSeek-V2/V3) can be served with: it hands its cache a latent, not per-head K/V."""


WINDOW_REFUSALS = {
    "gqa": "gqa's pages keep every token of every layer (its layout has no window groups to drop pages from)",
    "mla": "mla's latent pages keep every token of every layer (its layout has no window groups to drop pages from)",
    "dca": "dca lets a layer read another layer's cache by position, which a window that drops tokens breaks",
    "elastic": "elastic's on-demand tier keeps every token in every layer, so no page could be dropped",
}
"""Why ``window`` does not compose with a backend (``window+int8`` and ``window+int4`` are the compositions)."""


def check_composition(name: str) -> None:
    """Refuse a ``+`` name that is not a supported composition (``int8+mla``), listing those that are; a ``window``
    composition with a backend it cannot drop pages of names why (:data:`WINDOW_REFUSALS`).

    Raises:
        ValueError: naming it.
    """
    parts = name.split("+")
    if "+" in name and name not in COMPOSITIONS and "window" in parts:
        other = next((p for p in parts if p != "window"), "window")
        why = WINDOW_REFUSALS.get(other)
        raise ValueError(f"unsupported combination {name!r}: " + (f"{why}; " if why else "")
                         + "window composes only as window+int8 or window+int4")
    if "+" in name and name not in COMPOSITIONS:
        raise ValueError(f"unsupported combination {name!r}; supported: {', '.join(COMPOSITIONS)}")


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


def check_options(name: str, options: dict) -> None:
    """Refuse a name that is neither a backend nor a supported composition, and options that backend ``name`` (or
    each part of a composition like ``mla+int8``) does not take.

    Raises:
        ValueError: naming the unknown backend, combination or options (and ``window``'s ``window`` below 1).
    """
    parts = name.split("+")
    unknown_parts = [p for p in parts if p not in BACKEND_OPTIONS]
    if unknown_parts:
        raise ValueError(f"unknown backend {unknown_parts[0]!r}; allowed: {', '.join(BACKEND_OPTIONS)}"
                         + budget_hint(name, served=False))
    check_composition(name)
    unknown = set(options) - set().union(*(BACKEND_OPTIONS[p] for p in parts))
    if unknown:
        raise ValueError(f"{name} takes no option {', '.join(sorted(unknown))}")
    if "window" in parts and isinstance(options.get("window"), int) and options["window"] < 1:
        raise ValueError(f"{format_spec(name, options)}: window must be >= 1 (the tokens a query sees, itself "
                         f"included), got {options['window']}")


def format_spec(name: str, options: dict) -> str:
    return name + (":" + ",".join(f"{k}={v}" for k, v in options.items()) if options else "")
