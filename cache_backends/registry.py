"""Backend names -> classes, and compositions joined with ``+``, from the backends' declarations
(:mod:`cache_backends.catalog`). ``KV_BACKEND`` must be one of :func:`available`.

A composition ``outer+inner`` is one the outer backend declares (:attr:`~cache_backends.declaration.BackendDecl.
inners`): the inner backend is built with its options, and the outer class's ``compose`` classmethod builds the
composition over it:

* ``gqa+int8``, ``gqa+int4`` — the shared K/V heads are quantized as the inner tier quantizes;
* ``mla+int8``, ``mla+int4`` — the latent is quantized (per channel over token groups, with a residual window);
* ``dca+int8``, ``dca+int4``, ``dca+mla`` — kept layers store what the inner backend stores; reuse layers predict
  from it, and every similarity (prefill decision, probes) is measured on the inner backend's rebuilt K/V;
* ``window+int8``, ``window+int4`` — StreamingLLM's sinks and window over the quantized tiers (the codes of tokens the
  window left are freed); ``window`` says why it composes with nothing else
  (:attr:`~cache_backends.declaration.BackendDecl.refusals`).
"""

from __future__ import annotations

from cache_backends import catalog
from cache_backends.base import KVBackend
from cache_backends.geometry import ModelGeometry
from cache_backends.spec import check_composition


def available() -> list[str]:
    """Registered backend names and supported compositions."""
    return catalog.available()


def get_backend_class(name: str) -> type[KVBackend]:
    """The class registered as ``name`` (a single backend, not a composition).

    Raises:
        KeyError: if no backend has that name.
    """
    if catalog.get(name) is None:
        raise KeyError(f"unknown KV backend {name!r}; allowed: {', '.join(available())}")
    return catalog.load_class(name)


def _own(name: str, options: dict) -> dict:
    """The options of ``options`` that backend ``name``'s constructor takes (its declared, served options)."""
    decl = catalog.get(name)
    return {k: v for k, v in options.items() if (o := decl.option(k)) is not None and not o.estimate_only}


def serves_layer_kinds(name: str, windowed: bool, rope_per_layer_type: bool) -> bool:
    """Whether backend ``name`` (single or composition) serves a model with sliding-window layers (``windowed``) or
    with RoPE parameters per layer type: none of its parts has the matching refusal (``kvserve estimate`` leaves
    the others out of its default rows, as :func:`create` refuses them)."""
    for part in name.split("+"):
        decl = catalog.get(part)
        if decl is not None and ((windowed and decl.sliding_refusal) or (rope_per_layer_type and decl.rope_refusal)):
            return False
    return True


def _check_windows(name: str, part: str, geometry: ModelGeometry) -> None:
    """Refuse backend ``part`` (of ``name``) on a model with sliding-window layers, or with RoPE parameters per
    layer type, when it cannot serve them.

    Raises:
        ValueError: one line naming the backend, what the model has and the reason.
    """
    decl = catalog.get(part)
    if geometry.sliding_layers and decl.sliding_refusal:
        windows = sorted({w for w in geometry.layer_windows if w is not None})
        raise ValueError(f"{name} cannot serve this model: {geometry.sliding_layers} of its {geometry.num_layers} "
                         f"layers attend through a sliding window ({', '.join(map(str, windows))} tokens), and "
                         f"{decl.sliding_refusal}")
    if geometry.rope_per_layer_type and decl.rope_refusal:
        raise ValueError(f"{name} cannot serve this model: its layer types rotate with different RoPE parameters "
                         f"(sliding-window and global layers), and {decl.rope_refusal}")


def create(name: str, geometry: ModelGeometry, **options) -> KVBackend:
    """Build backend ``name`` (single or composition) with its options.

    A composition's options are routed by name to the component that takes them (e.g. ``rank`` to
    ``mla``, ``group_size`` and ``residual`` to ``int8``); options no component takes are refused.

    Raises:
        ValueError: for an unsupported name or combination (listing the supported ones), an unknown
            option, an option value a backend refuses, or a backend that cannot serve the model's
            sliding-window layers (``dca``: its declaration's ``sliding_refusal``) or its RoPE per layer type
            (``mla``, ``gqa``: ``rope_refusal``).
    """
    if geometry.kv_lora_rank and name not in catalog.native_mla_backends():
        ok = catalog.native_mla_backends()
        raise ValueError(f"{name} needs per-head K/V, but this model is natively MLA (kv_lora_rank="
                         f"{geometry.kv_lora_rank}) and hands its cache a latent: use {', '.join(ok[:-1])} or {ok[-1]}")
    if "+" not in name:
        if catalog.get(name) is None:
            raise ValueError(f"unknown KV backend {name!r}; allowed: {', '.join(available())}")
        cls = get_backend_class(name)
        _check_windows(name, name, geometry)
        unknown = set(options) - set(_own(name, options))
        if unknown:
            raise ValueError(f"{name} takes no option {', '.join(sorted(unknown))}")
        return cls(geometry, **options)
    check_composition(name)
    outer, inner = name.split("+")
    for part in (outer, inner):
        _check_windows(name, part, geometry)
    own = _own(outer, options)  # an option both parts declare goes to the outer one
    picked = {k: v for k, v in _own(inner, options).items() if k not in own}
    unknown = set(options) - set(own) - set(picked)
    if unknown:
        raise ValueError(f"{name} takes no option {', '.join(sorted(unknown))}")
    inner_backend = get_backend_class(inner)(geometry, **picked)  # validates the values, fills in the defaults
    backend = get_backend_class(outer).compose(geometry, inner_backend, **own)
    backend.name = name
    return backend
