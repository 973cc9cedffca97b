"""``kvserve serve``'s flags: one per field of :class:`server.config.Settings`, generated from the model.

Each field ``name`` becomes ``--name`` in kebab case (``kv_cache_budget_bytes`` -> ``--kv-cache-budget-bytes``),
with the field's description as its help, and sets the same setting as the environment variable ``NAME``; a
flag given wins over the variable. ``--model`` is an alias of ``--model-id`` (vLLM's and TGI's spelling).
A flag's value is a string, validated by :class:`Settings` as the variable's would be: a bad one is the same
one-line :class:`~server.config.ConfigError`, naming the flag. A field added to ``Settings`` gets its flag with
no change here.
"""

from __future__ import annotations

import argparse
import types
import typing

from pydantic.fields import FieldInfo

from server.config import Settings

ALIASES = {"model_id": ["--model"]}
"""Extra spellings of a field's flag."""


def flag(field: str) -> str:
    """``kv_cache_budget_bytes`` -> ``--kv-cache-budget-bytes``."""
    return "--" + field.replace("_", "-")


def _metavar(annotation) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]  # Optional[X]: X (empty: unset, where the field takes it)
    if typing.get_origin(annotation) is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(annotation))) + "}"
    return {bool: "BOOL", int: "N", float: "X"}.get(annotation, "TEXT")


SHOWN_DEFAULTS = {"kv_quality_long_context": "auto"}
"""Defaults a help line states as the docs spell them, where the field holds ``None`` for them."""


def budget_chosen() -> dict[str, object]:
    """Settings field -> its static default, for each option the quality budget chooses when it is left unset
    (:attr:`cache_backends.declaration.BackendDecl.budget_axis`: ``KV_GQA_GROUPS``, ``KV_MLA_RANK``...)."""
    from cache_backends import catalog

    return {o.setting: o.default for d in catalog.declarations().values() if d.budget_axis
            for o in d.options if o.name == d.budget_axis and o.setting}


def _default(name: str, info: FieldInfo) -> str:
    """What a help line states as the default of field ``name``."""
    static = ("computed" if info.default_factory else "unset" if info.default is None else
              str(info.default).lower() if isinstance(info.default, bool) else repr(info.default))  # true: as typed
    if name in SHOWN_DEFAULTS:
        return SHOWN_DEFAULTS[name]
    chosen = budget_chosen()
    if name in chosen:  # a static value only without a budget
        without = "from the model" if chosen[name] is None else str(chosen[name]).lower()
        return f"chosen by the quality budget (KV_QUALITY_BUDGET=off: {without})"
    return static


def _help(name: str, info: FieldInfo) -> str:
    default = _default(name, info)
    text = f"{info.description} " if info.description else ""
    # a description that says what the default is ("Default: MODEL_ID as given") is not contradicted by the
    # field's placeholder value ('' or unset)
    said = "default:" in text.lower()
    # argparse %-formats help strings: a literal % (\"25% of the memory\") must be doubled
    return f"{text}[env {name.upper()}{'' if said else f'; default: {default}'}]".replace("%", "%%")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`Settings` field to ``parser`` (dest: the field's name, default ``None``)."""
    group = parser.add_argument_group("settings (each also an environment variable; a flag wins)")
    for name, info in Settings.model_fields.items():
        metavar = _metavar(info.annotation)
        boolean = {"nargs": "?", "const": "true"} if metavar == "BOOL" else {}  # bare `--kv-prefix-caching`: true
        group.add_argument(flag(name), *ALIASES.get(name, []), dest=name, default=None, metavar=metavar,
                           help=_help(name, info), **boolean)


def overrides(args: argparse.Namespace) -> dict[str, str]:
    """The settings the flags of ``args`` gave (field name -> value as typed); flags not given are left out."""
    return {name: value for name in Settings.model_fields if (value := getattr(args, name, None)) is not None}
