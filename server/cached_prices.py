"""The quality budget's prices, read back from the calibration cache for ``kvserve estimate`` and ``kvserve advise``.

A server prices each backend it serves (and each setting its search tries) on its calibration text
(:mod:`server.quality_budget`) and keeps the price in the calibration cache (``KV_CALIBRATION_CACHE_DIR``, entries
of kind ``price``). For a model folder, the CLIs read the entries of that model (the same fingerprint,
:func:`cache_backends.calibration_cache.model_fingerprint`, from its config and weight files: no weights are
loaded) and give a sums row the price of a setting of the same size: its perplexity increase, percent. Settings
that size alike (int4 with and without its rotation) give their lowest price, the one the budget's search would
serve, and that entry's top-1 agreement with ``full`` (0-1; ``None`` for an entry written before the agreement was
measured). ``full`` costs nothing (+0%, agreement 1, the reference); any other row no entry prices, and every other
row of a preset, a config.json alone or a model with no entries, is not priced.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cache_backends.base import ModelGeometry
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


@dataclass
class PriceBook:
    """The prices the calibration cache holds for one model, by the sums spec each setting sizes as."""

    shape: Shape | None = None  # the model's, for the estimator's defaults
    geometry: ModelGeometry | None = None  # the model's, to size a spec as the sums do
    # (sums name, sums params, percent, agreement or None)
    prices: list[tuple[str, dict, float, float | None]] = field(default_factory=list)

    def row(self, backend: str, params: dict) -> float | None:
        """The lowest price of a setting that sizes as the sums row ``backend`` with ``params`` (the estimator's
        options, defaults included), or ``None``; ``full``'s is 0, the reference every price is measured against."""
        return self.priced(backend, params)[0]

    def priced(self, backend: str, params: dict) -> tuple[float | None, float | None]:
        """``(price, agreement)`` of the lowest-priced setting that sizes as the sums row ``backend`` with
        ``params`` (as :meth:`row`): percent perplexity increase and top-1 agreement with ``full`` (0-1), each
        ``None`` when no entry gives it; ``full``'s ``(0, 1)``."""
        if backend == "full":
            return 0.0, 1.0
        found = [(pct, agreement is None, agreement) for name, sized, pct, agreement in self.prices
                 if name == backend and sized == params]
        if not found:
            return None, None
        pct, _, agreement = min(found)  # the lowest price; of equal ones, an entry that measured the agreement
        return pct, agreement

    def spec(self, spec: str) -> float | None:
        """The price of a backend spec (``mla:rank=96``), or ``None`` (also for one the model cannot take)."""
        try:
            return self.row(*self._sized(spec)) if self.prices else None
        except ValueError:
            return None

    def _sized(self, spec: str) -> tuple[str, dict]:
        """``spec`` as the sums size it: its sums name and options with the estimator's defaults filled in.

        Raises:
            ValueError: a spec that does not parse, or that the model cannot take.
        """
        from cache_backends.estimate import default_params
        from cache_backends.registry import create
        from cache_backends.spec import parse_spec

        name, options = parse_spec(spec)
        sums_name, sums_params = create(name, self.geometry, **options).sums_spec()
        return sums_name, {**default_params(self.shape, sums_name), **sums_params}


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

    from cache_backends.base import ModelGeometry
    from cache_backends.calibration_cache import model_fingerprint
    from cache_backends.estimate import Shape

    config = AutoConfig.from_pretrained(str(folder))
    fingerprint = model_fingerprint(SimpleNamespace(name_or_path=str(folder), config=config))
    book = PriceBook(Shape.from_config(json.loads((folder / "config.json").read_text())),
                     ModelGeometry.from_config(config, torch.float32))
    for meta in found:
        if fingerprint is None or meta.get("model_fingerprint") != fingerprint:
            continue
        try:
            price = meta["figures"]["price"]
            agreement = price.get("agreement")  # an entry of PRICE_VERSION 4 or before has none
            book.prices.append((*book._sized(meta["params"]["spec"]), float(price["ppl_increase_pct"]),
                                None if agreement is None else float(agreement)))
        except (KeyError, TypeError, ValueError):  # an entry of another version, or a spec this build refuses
            continue
    return book
