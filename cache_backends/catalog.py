"""The backends kvserve knows: every :class:`~cache_backends.declaration.BackendDecl` its packages declare.

A backend is a package ``cache_backends/<name>/`` with a torch-free ``spec.py`` holding ``DECLARATIONS``; this
module finds them by listing the packages (nothing names them here). A distribution outside kvserve adds its own
through an entry point in the group :data:`ENTRY_POINT_GROUP` whose value is a module holding ``DECLARATIONS``
(``[project.entry-points."kvserve.backends"]`` ``lastn = "my_package.spec"``), the way vLLM and pytest find
plug-ins; they are read once, when the catalog is first used, and one whose name is taken is refused.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import pkgutil
from pathlib import Path

from cache_backends.declaration import BackendDecl

ENTRY_POINT_GROUP = "kvserve.backends"
"""Entry-point group of backends declared outside kvserve (each value: a module holding ``DECLARATIONS``)."""


def _spec_modules() -> list[tuple[str, str]]:
    """``(where, module)``: kvserve's own backend packages' ``spec`` modules, then the plug-ins'."""
    here = Path(__file__).resolve().parent
    own = sorted((f"cache_backends/{m.name}", f"cache_backends.{m.name}.spec") for m in pkgutil.iter_modules([str(here)])
                 if m.ispkg and (here / m.name / "spec.py").exists())
    plugins = [(f"entry point {ep.name!r}", ep.value) for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]
    return own + plugins


class PluginError(Exception):
    """A backend's declaration points to a class that cannot be loaded (a plug-in's missing module or class): one
    line naming the backend and where it was declared. Not a :class:`ValueError`, which callers read as a value a
    backend refuses (``kvserve estimate`` leaves such a row out): ``kvserve`` ends with it, exit 2."""


def declarations() -> dict[str, BackendDecl]:
    """Backend name -> its declaration, kvserve's own first (sorted by :attr:`BackendDecl.order`), then plug-ins'.

    Raises:
        ValueError: a plug-in's module cannot be imported or has no ``DECLARATIONS``, two declarations share a
            name, or an option's setting is another package's (naming where each came from).
    """
    return _read()[0]


def origin(name: str) -> str:
    """Where backend ``name`` was declared (``cache_backends/window``, ``entry point 'lastn'``)."""
    return _read()[2][name]


def setting_origins() -> dict[str, str]:
    """Settings field (:attr:`~cache_backends.declaration.Option.setting`) -> where the first backend declaring it
    came from (``cache_backends/window``, ``entry point 'lastn'``), lower-cased as the variables are read: what a
    clash with kvserve's own settings names."""
    return _read()[1]


def _package(module: str) -> str:
    """The top-level package of ``module``: the unit that may share a setting among its backends (``elastic`` reads
    int8's ``kv_int8_group_size``; a plug-in's backends may share theirs, never another package's)."""
    return module.partition(".")[0]


@functools.cache
def _read() -> tuple[dict[str, BackendDecl], dict[str, str], dict[str, str]]:
    found: dict[str, BackendDecl] = {}
    where: dict[str, str] = {}
    settings: dict[str, tuple[str, str]] = {}  # setting -> (package, origin) of its first declaration
    for origin, name in _spec_modules():
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # a plug-in's import error, syntax error or its own exception: one line
            raise ValueError(f"backend plug-in {origin}: cannot import {name} ({type(exc).__name__}: {exc})") from None
        decls = getattr(module, "DECLARATIONS", None)
        if not decls or not all(isinstance(d, BackendDecl) for d in decls):
            raise ValueError(f"{name} ({origin}) declares no backend (DECLARATIONS: a tuple of BackendDecl)")
        for decl in decls:
            if decl.name in found:
                raise ValueError(f"backend {decl.name!r} is declared twice ({where[decl.name]} and {origin})")
            found[decl.name], where[decl.name] = decl, origin
            for option in decl.options:
                if not option.setting:
                    continue
                package, first = settings.setdefault(option.setting.lower(), (_package(name), origin))
                if package != _package(name):  # a plug-in taking over another package's variable
                    raise ValueError(f"setting {option.setting.upper()} is declared twice ({first} and {origin}, "
                                     f"option {decl.name}:{option.name})")
    big = 1 << 30
    ordered = dict(sorted(found.items(), key=lambda kv: (kv[1].order if kv[1].order is not None else big, kv[0])))
    return ordered, {setting: origin for setting, (_, origin) in settings.items()}, where


def get(name: str) -> BackendDecl | None:
    """The declaration of backend ``name`` (a single backend), else ``None``."""
    return declarations().get(name)


def names() -> list[str]:
    """Every single backend's name."""
    return list(declarations())


def compositions() -> tuple[str, ...]:
    """Every ``outer+inner`` composition some outer backend declares (:attr:`BackendDecl.inners`)."""
    return tuple(f"{d.name}+{inner}" for d in declarations().values() for inner in d.inners)


def native_mla_backends() -> tuple[str, ...]:
    """What a natively-MLA model can be served with: the backends declaring it, and the compositions they are the
    outer part of (``mla+int8``: the model's latent quantized)."""
    ok = tuple(d.name for d in declarations().values() if d.native_mla)
    return ok + tuple(c for c in compositions() if c.split("+")[0] in ok)


def available() -> list[str]:
    """Every backend name (sorted) and every composition: what ``KV_BACKEND`` may name."""
    return sorted(names()) + list(compositions())


def load_class(name: str) -> type:
    """The :class:`~cache_backends.base.KVBackend` class of backend ``name`` (imports torch).

    Raises:
        KeyError: no backend has that name.
        PluginError: its declared ``module:Class`` cannot be imported or has no such class.
    """
    decl = declarations()[name]
    module, _, attr = decl.backend.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as exc:  # a missing module or class, or the module's own error: one line naming the plug-in
        raise PluginError(f"backend {name!r} ({origin(name)}): cannot load its class {decl.backend} "
                          f"({type(exc).__name__}: {exc})") from None
