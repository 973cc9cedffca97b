"""Backend names → classes, and compositions joined with ``+``. ``KV_BACKEND`` must be one of :func:`available`.

Compositions (``outer+inner``):

* ``gqa+int8`` — the shared K/V heads are quantized as in ``int8``;
* ``mla+int8`` — the latent is quantized (per channel over token groups, with a residual window);
* ``dca+int8``, ``dca+mla`` — kept layers store what the inner backend stores; reuse layers predict from
  it, and every similarity (prefill decision, probes) is measured on the inner backend's rebuilt K/V;
* ``gqa+int4``, ``mla+int4``, ``dca+int4`` — the same with ``int4`` (every composition that takes ``int8``
  takes ``int4``; either takes the quantization options ``key_bits``, ``value_bits`` and ``rotate``);
* ``window+int8``, ``window+int4`` — StreamingLLM's sinks and window over the quantized tiers (the codes of tokens the
  window left are freed). ``window`` composes with nothing else (:data:`cache_backends.spec.WINDOW_REFUSALS`).
"""

from __future__ import annotations

import inspect

from cache_backends.base import KVBackend, ModelGeometry
from cache_backends.dca.backend import DCABackend
from cache_backends.elastic import ElasticBackend
from cache_backends.full import FullBackend
from cache_backends.gqa import GQABackend
from cache_backends.int8 import Int4Backend, Int8Backend
from cache_backends.mla import MLABackend
from cache_backends.spec import COMPOSITIONS, NATIVE_MLA_BACKENDS, check_composition
from cache_backends.window import WindowBackend

_BACKENDS: dict[str, type[KVBackend]] = {cls.name: cls for cls in (FullBackend, GQABackend, MLABackend, Int8Backend,
                                                                    Int4Backend, DCABackend, ElasticBackend,
                                                                    WindowBackend)}
INT8_OPTIONS = ("group_size", "residual", "key_bits", "value_bits", "rotate")
QUANTIZED = ("int8", "int4")


def available() -> list[str]:
    """Registered backend names and supported compositions."""
    return sorted(_BACKENDS) + list(COMPOSITIONS)


def get_backend_class(name: str) -> type[KVBackend]:
    """The class registered as ``name`` (a single backend, not a composition).

    Raises:
        KeyError: if no backend has that name.
    """
    try:
        return _BACKENDS[name]
    except KeyError:
        raise KeyError(f"unknown KV backend {name!r}; allowed: {', '.join(available())}") from None


def _accepts(cls: type, options: dict) -> dict:
    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in options.items() if k in params}


def serves_layer_kinds(name: str, windowed: bool, rope_per_layer_type: bool) -> bool:
    """Whether backend ``name`` (single or composition) serves a model with sliding-window layers (``windowed``) or
    with RoPE parameters per layer type: none of its parts has the matching refusal (``kvserve estimate`` leaves
    the others out of its default rows, as :func:`create` refuses them)."""
    for part in name.split("+"):
        cls = _BACKENDS.get(part)
        if cls is not None and ((windowed and cls.window_refusal) or (rope_per_layer_type and cls.rope_refusal)):
            return False
    return True


def _check_windows(name: str, cls: type[KVBackend], geometry: ModelGeometry) -> None:
    """Refuse ``cls`` (part of backend ``name``) on a model with sliding-window layers, or with RoPE parameters per
    layer type, when it cannot serve them.

    Raises:
        ValueError: one line naming the backend, what the model has and the reason.
    """
    if geometry.sliding_layers and cls.window_refusal:
        windows = sorted({w for w in geometry.layer_windows if w is not None})
        raise ValueError(f"{name} cannot serve this model: {geometry.sliding_layers} of its {geometry.num_layers} "
                         f"layers attend through a sliding window ({', '.join(map(str, windows))} tokens), and "
                         f"{cls.window_refusal}")
    if geometry.rope_per_layer_type and cls.rope_refusal:
        raise ValueError(f"{name} cannot serve this model: its layer types rotate with different RoPE parameters "
                         f"(sliding-window and global layers), and {cls.rope_refusal}")


def create(name: str, geometry: ModelGeometry, **options) -> KVBackend:
    """Build backend ``name`` (single or composition) with its options.

    A composition's options are routed by name to the component that takes them (e.g. ``rank`` to
    ``mla``, ``group_size`` and ``residual`` to ``int8``); options no component takes are refused.

    Raises:
        ValueError: for an unsupported name or combination (listing the supported ones), an unknown
            option, an option value a backend refuses, or a backend that cannot serve the model's
            sliding-window layers (``dca``: :attr:`KVBackend.window_refusal`) or its RoPE per layer type
            (``mla``, ``gqa``: :attr:`KVBackend.rope_refusal`).
    """
    if geometry.kv_lora_rank and name not in NATIVE_MLA_BACKENDS:
        raise ValueError(f"{name} needs per-head K/V, but this model is natively MLA (kv_lora_rank="
                         f"{geometry.kv_lora_rank}) and hands its cache a latent: use full, mla, mla+int8 or mla+int4")
    if "+" not in name:
        if name not in _BACKENDS:
            raise ValueError(f"unknown KV backend {name!r}; allowed: {', '.join(available())}")
        cls = _BACKENDS[name]
        _check_windows(name, cls, geometry)
        unknown = set(options) - set(_accepts(cls, options))
        if unknown:
            raise ValueError(f"{name} takes no option {', '.join(sorted(unknown))}")
        return cls(geometry, **options)
    check_composition(name)
    outer, inner = name.split("+")
    for part in (outer, inner):
        _check_windows(name, _BACKENDS[part], geometry)
    used = set()
    if inner in QUANTIZED:
        picked = {k: options[k] for k in INT8_OPTIONS if k in options}
        used |= set(picked)
        quantizer = _BACKENDS[inner](geometry, **picked)  # validates the values, fills in the defaults
        tier = quantizer.quantization
        if outer == "window":
            own = {k: options[k] for k in ("sinks", "window") if k in options}
            used |= set(own)
            backend = WindowBackend(geometry, inner=quantizer, **own)
        elif outer in ("gqa", "mla"):
            own = _accepts(_BACKENDS[outer], options)
            own.pop("quantization", None)
            used |= set(own)
            backend = _BACKENDS[outer](geometry, quantization=tier, **own)
            if outer == "mla" and 4 in (tier.key_bits, tier.value_bits) and backend.rank % 2:
                raise ValueError(f"{name}: 4-bit codes pack two channels per byte: rank={backend.rank} must be even")
        else:  # dca+int8, dca+int4
            own = _accepts(DCABackend, options)
            used |= set(own)
            backend = DCABackend(geometry, inner=quantizer, **own)
    else:  # dca+mla
        mla_opts = _accepts(MLABackend, options)
        dca_opts = _accepts(DCABackend, options)
        used |= set(mla_opts) | set(dca_opts)
        backend = DCABackend(geometry, inner=MLABackend(geometry, **mla_opts), **dca_opts)
    unknown = set(options) - used
    if unknown:
        raise ValueError(f"{name} takes no option {', '.join(sorted(unknown))}")
    backend.name = name
    return backend
