"""The quality budget's prices, read back from the calibration cache for ``kvserve estimate`` and ``kvserve advise``.

A server prices each backend it serves (and each setting its search tries) on its calibration text
(:mod:`server.quality_budget`) and keeps the price in the calibration cache (``KV_CALIBRATION_CACHE_DIR``, entries
of kind ``price``). For a model folder, the CLIs read the entries of that model (the same fingerprint,
:func:`cache_backends.calibration_cache.model_fingerprint`, from its config and weight files: no weights are
loaded) and give a sums row the price of its own setting: its perplexity increase, percent, and that entry's top-1
agreement with ``full`` (0-1; ``None`` for an entry written before the agreement was measured). A setting is its
size (the sums spec) and the options that cost no byte but change what the cache computes (:data:`UNSIZED`:
int8/int4's rotation, gqa's method, dca's alignment and probe interval), each at the backend's default where a
spec leaves it out: ``int4`` is the unrotated setting and ``int4:rotate=true`` the rotated one, though both size
alike. An entry's spec names the rotation only when it is on (as a server writes it, in every version), so an
entry without the ``rotate`` key is the unrotated setting's. Of several entries of one setting (other calibration
texts), the one measured in the dtype asked for comes first, then the lowest price.

Each entry records the dtype its model computed in (``figures.dtype``: ``float32``, ``bfloat16``...); a price is
shown with that dtype when it is not the one the CLI sizes (``+0.52% (measured in fp32)`` beside ``--dtype fp16``),
and an entry written before the dtype was recorded says so (``dtype not recorded``). ``full`` costs
nothing (+0%, agreement 1, the reference, in any dtype); any other row no entry prices, and every other row of a
preset, a config.json alone or a model with no entries, is not priced.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from cache_backends.geometry import ModelGeometry
    from cache_backends.estimate import Shape

NOT_PRICED = "not priced"


def cache_dir() -> str | None:
    """The calibration cache the server uses: ``KV_CALIBRATION_CACHE_DIR`` (empty: none), else its default."""
    from server.config import default_calibration_cache_dir

    value = os.environ.get("KV_CALIBRATION_CACHE_DIR")
    return (value or None) if value is not None else default_calibration_cache_dir()


def price_text(pct: float | None) -> str:
    """A price as the CLIs print it: ``+0.52%`` (perplexity), or ``not priced``."""
    return NOT_PRICED if pct is None else f"+{pct:.2f}%"


UNSIZED = ("rotate", "method", "align", "probe_interval")
"""Options that cost no byte (the sums spec leaves them out) but are part of a setting, and of its price."""

DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def dtype_name(dtype: str | None) -> str | None:
    """A dtype as ``kvserve estimate --dtype`` names it (``float32`` and ``torch.float32``: ``fp32``), or ``None``."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return DTYPE_NAMES.get(name, name)


def dtype_note(measured: str | None, asked: str | None) -> str:
    """What to say beside a price measured in ``measured`` when the CLI sizes ``asked``: ``""`` when they are one
    dtype, else `` (measured in fp32)`` or `` (dtype not recorded)``."""
    if dtype_name(measured) == dtype_name(asked):
        return ""
    return f" (measured in {dtype_name(measured)})" if measured else " (dtype not recorded)"


class Priced(NamedTuple):
    """A sums row's price: percent perplexity increase, top-1 agreement with ``full`` (0-1) and the dtype it was
    measured in, each ``None`` when no entry gives it."""

    pct: float | None = None
    agreement: float | None = None
    dtype: str | None = None


class Entry(NamedTuple):
    """One price entry, as the sums size its setting."""

    name: str  # the sums name
    sized: dict  # the sums params, the estimator's defaults filled in
    setting: dict  # its UNSIZED options, as the backend holds them
    pct: float
    agreement: float | None
    dtype: str | None  # as dtype_name gives it; None: not recorded


@dataclass
class PriceBook:
    """The prices the calibration cache holds for one model, by the setting each prices."""

    shape: Shape | None = None  # the model's, for the estimator's defaults
    geometry: ModelGeometry | None = None  # the model's, to size a spec as the sums do
    prices: list[Entry] = field(default_factory=list)

    def priced(self, backend: str, params: dict, dtype: str | None = None) -> Priced:
        """The price of the setting of the sums row ``backend`` with ``params`` (the estimator's options, defaults
        included, and any :data:`UNSIZED` option the spec gave): of its entries, one measured in ``dtype`` first,
        then the lowest price, then one that measured the agreement; ``full``'s ``(0, 1)`` in any dtype, the
        reference."""
        from cache_backends.registry import create

        if backend == "full":
            return Priced(0.0, 1.0, dtype_name(dtype))
        if not self.prices:
            return Priced()
        try:
            setting = self._setting(create(backend, self.geometry, **{k: v for k, v in params.items()
                                                                       if k in UNSIZED}))
        except ValueError:  # a backend this model cannot take: no server priced it
            return Priced()
        sized = {k: v for k, v in params.items() if k not in UNSIZED}
        found = [e for e in self.prices if e.name == backend and e.sized == sized and e.setting == setting]
        if not found:
            return Priced()
        want = dtype_name(dtype)
        best = min(found, key=lambda e: (want is not None and e.dtype != want, e.pct, e.agreement is None))
        return Priced(best.pct, best.agreement, best.dtype)

    def _sized(self, name: str, options: dict) -> tuple[str, dict, dict]:
        """A setting as the sums size it: its sums name, its sums options with the estimator's defaults filled in,
        and its :data:`UNSIZED` options.

        Raises:
            ValueError: a setting the model cannot take.
        """
        from cache_backends.estimate import default_params
        from cache_backends.registry import create

        backend = create(name, self.geometry, **options)
        sums_name, sums_params = backend.sums_spec()
        return sums_name, {**default_params(self.shape, sums_name), **sums_params}, self._setting(backend)

    @staticmethod
    def _setting(backend) -> dict:
        return {k: v for k, v in backend.params().items() if k in UNSIZED}


def load_prices(model: str | None, directory: str | None = None) -> PriceBook:
    """The prices ``directory`` (default :func:`cache_dir`) holds for the model folder ``model``; an empty book
    for anything else (a preset, a config.json alone, no cache, no entry of this model)."""
    from cache_backends.calibration_cache import entries

    directory = cache_dir() if directory is None else directory
    folder = Path(model) if model else None
    if folder is None or not (folder / "config.json").is_file() or not directory or not Path(directory).is_dir():
        return PriceBook()
    found = entries(directory, "price")
    if not found:
        return PriceBook()
    import torch
    from transformers import AutoConfig

    from cache_backends.geometry import ModelGeometry
    from cache_backends.calibration_cache import model_fingerprint
    from cache_backends.estimate import Shape
    from cache_backends.spec import parse_spec

    config = AutoConfig.from_pretrained(str(folder))
    fingerprint = model_fingerprint(SimpleNamespace(name_or_path=str(folder), config=config))
    book = PriceBook(Shape.from_config(json.loads((folder / "config.json").read_text())),
                     ModelGeometry.from_config(config, torch.float32))
    for meta in found:
        if fingerprint is None or meta.get("model_fingerprint") != fingerprint:
            continue
        try:
            figures = meta["figures"]
            price = figures["price"]
            agreement = price.get("agreement")  # an entry of PRICE_VERSION 4 or before has none
            name, sized, setting = book._sized(*parse_spec(meta["params"]["spec"]))
            book.prices.append(Entry(name, sized, setting, float(price["ppl_increase_pct"]),
                                     None if agreement is None else float(agreement),
                                     dtype_name(figures.get("dtype"))))  # none before it was recorded
        except (KeyError, TypeError, ValueError, AttributeError):  # another version's, or a spec this build refuses
            continue
    return book
