"""What a backend declares about itself, in one place: :class:`BackendDecl` and its :class:`Option` rows.

Each backend is a package ``cache_backends/<name>/`` whose torch-free ``spec.py`` holds ``DECLARATIONS``, a tuple
of :class:`BackendDecl`; :mod:`cache_backends.catalog` collects them. Everything else reads a backend through its
declaration: the spec parser (:mod:`cache_backends.spec`: option types and bounds, compositions), the registry
(:mod:`cache_backends.registry`: the class, how it composes), the settings and ``kvserve serve``'s flags
(:mod:`server.config`: one ``KV_*`` variable per :attr:`Option.setting`), the estimator
(:mod:`cache_backends.estimate`: streams, quantized tier, bytes), ``kvserve advise`` (:attr:`BackendDecl.summary`),
the built-in page's sums (:attr:`BackendDecl.order`, :attr:`BackendDecl.extra_rows`), the quality budget
(:attr:`BackendDecl.budget_axis`) and its own Prometheus metrics (:attr:`BackendDecl.metrics`, :mod:`server.metrics`). Adding a backend is adding its package.

This module imports nothing from kvserve but :mod:`cache_backends.kv_spec` (no torch).
"""

from __future__ import annotations

import re

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cache_backends.kv_spec import KVSpec, Quantization, StreamSpec


INT64_MAX = (1 << 63) - 1
"""The largest integer any setting or spec option takes: the engine core's messages (msgspec) carry no larger, and
a larger value passed validation only to end the core at start-up."""

MAX_TOKENS = 1 << 24
"""The largest token count an option takes (a window, sinks, a residual): 16,777,216, more than any model's context
(Llama 4 Scout's is 10M), so that a typo's 20 digits are refused at once, naming the option."""


MAX_GROUP = 1024
"""The largest quantization group (tokens): a KV block is rounded up to whole groups, and holds at most 1024 tokens
(``KV_BLOCK_SIZE``'s bound); a larger group made each page too large for any budget."""


@dataclass(frozen=True)
class Option:
    """One option of a backend spec (``int8:group_size=64``) and, where it has one, its setting.

    Attributes:
        name: the option's key in a spec and the backend constructor's keyword.
        kind: ``int``, ``float``, ``str`` or ``bool``.
        default: the value served when neither spec nor setting gives one; ``None``: chosen from the model (or
            by the quality budget) at start-up.
        low: the smallest value allowed (numbers), else ``None``.
        high: the largest value allowed (numbers), else ``None``: an ``int`` option is then still at most
            :data:`INT64_MAX` (what the engine core's messages carry); a token count is at most :data:`MAX_TOKENS`.
        choices: the allowed values (a ``str`` option's words, or a closed set of integers such as bit widths).
        setting: the :class:`server.config.Settings` field that gives it (``kv_int8_group_size``: variable
            ``KV_INT8_GROUP_SIZE``, flag ``--kv-int8-group-size``); ``None``: a spec-only option (the estimator's
            ``reuse_fraction``). Two backends may read one setting (``elastic`` reads int8's group size).
        help: the setting's description (its ``--help`` line).
        estimate_only: an option only ``kvserve estimate`` takes (it sizes what the server measures), which the
            backend's constructor does not.
    """

    name: str
    kind: type
    default: Any = None
    low: float | None = None
    high: float | None = None
    choices: tuple = ()
    setting: str | None = None
    help: str = ""
    estimate_only: bool = False

    def highest(self) -> float | None:
        """The largest value it takes: :attr:`high`, else :data:`INT64_MAX` for an ``int`` option, else ``None``."""
        if self.kind not in (int, float):
            return None
        return self.high if self.high is not None else INT64_MAX if self.kind is int else None


@dataclass(frozen=True)
class Metric:
    """One Prometheus metric of a backend's own (labels ``model`` and ``backend``), exported for it and for every
    composition it is a part of.

    Attributes:
        name: the metric's name (``kvserve_dca_reuse_layers``; a counter's samples add ``_total``).
        kind: ``gauge``: the figure ``key`` of each live sequence's store stats (``KVStore.stats``), summed after
            every step; ``counter``: adds the figure ``key`` of each finished request's store stats and each count
            of that name the engine reports (``compressed_blocks``, ``preemptions_avoided``: an on-demand tier).
        help: its ``# HELP`` line.
        key: the figure it reads.
        title: its Grafana panel's title (``scripts/make_dashboard.py`` draws a panel per metric of kvserve's own
            backends: a gauge summed by backend, a counter's rate per second); empty: the help line's first clause.
    """

    name: str
    kind: str
    help: str
    key: str
    title: str = ""

    @property
    def panel_title(self) -> str:
        """The dashboard panel's title: :attr:`title`, else :attr:`help` up to its first comma or full stop."""
        return self.title or re.split(r"[,.]", self.help, maxsplit=1)[0]


@dataclass(frozen=True)
class BackendDecl:
    """Everything kvserve reads about one backend, torch-free.

    Attributes:
        name: the backend's name (``KV_BACKEND``, a spec's part).
        backend: ``"module:Class"`` of its :class:`~cache_backends.base.KVBackend`, imported on first use.
        summary: one line on when it suits a workload (``kvserve advise``); ``summary_long``: the same at long
            context (defaults to ``summary``); ``summary_busy``: at short context and 8 or more streams.
        options: its :class:`Option` rows.
        inners: the backends it composes over as the outer part (``gqa``: ``("int8", "int4")`` serves
            ``gqa+int8`` and ``gqa+int4``); the outer class builds the composition with its ``compose``
            classmethod.
        refusals: other backend -> why this one does not compose with it (said when a user asks).
        sliding_refusal: why it cannot serve a model with sliding-window layers (``None``: it can; the windowed
            layers then attend under :meth:`cache_backends.step_meta.StepMeta.windowed`); the registry refuses it
            with this reason.
        rope_refusal: why it cannot serve a model whose layer types rotate with different RoPE parameters
            (:attr:`cache_backends.geometry.ModelGeometry.rope_per_layer_type`), or ``None``.
        native_mla: serves a natively-MLA model (DeepSeek-V2/V3), which hands its cache a latent.
        calibrates: needs calibration text at start-up.
        budget_axis: the option the quality budget chooses when the settings leave it unset, else ``None``.
        size_is_range: its bytes are a range, not a setting's (``elastic``: full's without pressure), so "saves
            nothing" never applies.
        windowed_pool: on a model with sliding-window layers, its pages keep only each sliding layer's window.
        order: its place in the page's sums and ``kvserve estimate``'s default rows (lower first); ``None``:
            not among the default rows.
        extra_rows: specs listed beside it in those rows (``int8:value_bits=4``, vLLM's k8v4).
        default_compositions: compositions with this outer part listed in ``kvserve estimate``'s default rows.
        estimate_defaults: ``shape -> options`` the estimator uses where a spec leaves them out (``shape``: a
            :class:`cache_backends.sizes.Shape`); ``None``: the options' defaults.
        streams: ``(shape, params) -> streams`` of per-token storage it defines (``gqa``: shared heads; ``mla``:
            a latent), else ``None`` (full's per-head K and V).
        quantization: ``params -> Quantization`` of the quantized tier it stores, else ``None``.
        bytes_per_token: ``(shape, params, inner, dtype_bytes, seq_len) -> bytes`` per token per layer for a
            backend wrapping another's storage (``dca``, ``window``; ``inner``: the KV spec of what it wraps),
            else ``None``.
        min_bytes_per_token: ``(shape, params, dtype_bytes, seq_len) -> bytes``, the least of a backend whose
            size is a range, else ``None``.
        check: ``(name, params) -> None`` raising :class:`ValueError` for values the backend refuses beyond
            each option's own bounds (``window``: ``sinks <= window``), so ``kvserve estimate`` refuses what
            serving refuses.
        uncompressed: ``(params, tokens) -> sentence``: why a request of ``tokens`` tokens held ``full``'s bytes
            under it (the built-in page says it), or ``None`` where that is not its reason.
        metrics: its own Prometheus metrics (:class:`Metric`), besides those every backend has.
    """

    name: str
    backend: str
    summary: str = ""
    summary_long: str | None = None
    summary_busy: str | None = None
    options: tuple[Option, ...] = ()
    inners: tuple[str, ...] = ()
    refusals: Mapping[str, str] = field(default_factory=dict)
    sliding_refusal: str | None = None
    rope_refusal: str | None = None
    native_mla: bool = False
    calibrates: bool = False
    budget_axis: str | None = None
    size_is_range: bool = False
    windowed_pool: bool = False
    order: int | None = None
    extra_rows: tuple[str, ...] = ()
    default_compositions: tuple[str, ...] = ()
    estimate_defaults: Callable[[Any], dict] | None = None
    streams: Callable[[Any, dict], tuple[StreamSpec, ...]] | None = None
    quantization: Callable[[dict], Quantization] | None = None
    bytes_per_token: Callable[[Any, dict, KVSpec, int, int], float] | None = None
    min_bytes_per_token: Callable[[Any, dict, int, int], float] | None = None
    check: Callable[[str, dict], None] | None = None
    uncompressed: Callable[[dict, int], str | None] | None = None
    metrics: tuple[Metric, ...] = ()

    def option(self, name: str) -> Option | None:
        """Its option called ``name``, else ``None``."""
        return next((o for o in self.options if o.name == name), None)

    def option_names(self) -> set[str]:
        """The keys a spec of it may carry."""
        return {o.name for o in self.options}

    def defaults(self, shape=None) -> dict:
        """The estimator's options where a spec leaves them out: :attr:`estimate_defaults` of ``shape``, else the
        options' defaults that are not ``None``."""
        if self.estimate_defaults is not None and shape is not None:
            return self.estimate_defaults(shape)
        return {o.name: o.default for o in self.options if o.default is not None}
