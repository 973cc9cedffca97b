"""The quality budget (``KV_QUALITY_BUDGET``): each served backend's measured price, and the calibrating backends'
most compressive setting within it (:func:`choose`, its outcome a :class:`Choice`).

The price, the agreement and the long price are measured by :mod:`server.quality_price` (its ``Scorer``): the KL
divergence from ``full`` on short windows of the calibration text, as a perplexity increase; the share of positions
whose top-1 token is ``full``'s; and, for a backend that drops far tokens, the same on one long input. This module
chooses within them, and says what it chose.

**The search.** With a budget set (default 1%: int8 costs about 0.01% and 4-bit about 0.5-1% on real models,
while every post-hoc setting that changed greedy text measurably cost more), a backend whose compressive
parameter the settings leave unset gets the most compressive value within the budget:

* ``mla`` (post-hoc; and ``mla+int8``/``mla+int4``): the smallest rank of a ladder of 16 (``2 H d k / 16``),
  by bisection (the price falls with the rank);
* ``gqa`` (and ``gqa+int8``/``gqa+int4``): the fewest shared K/V heads among the divisors of
  ``num_key_value_heads``, by bisection;
* ``dca`` (and its compositions): the lowest similarity threshold (the most reuse layers), among the layers'
  calibrated similarities, by bisection;
* ``int4``: with or without the Hadamard rotation, whichever costs less.

When no setting is within both bounds, the one served is, of the settings the search priced, the one closest to
the agreement bound (the highest agreement; of equals, the cheaper: int4's, or the later one the bisection priced;
dca's no reuse layer first), and the warning, ``/info``'s message and its ``agreement_shortfall`` say by how much its
agreement is under the bound. Without an agreement bound, the least compressive setting (int4: the cheaper one).

The search keeps the chosen setting's calibration price within :data:`SEARCH_HEADROOM` (70%) of the budget: a
price measured on a few hundred calibration tokens moves on other text (on SmolLM2-135M, an ``mla`` rank priced at
+1.0% on calibration text cost +1.2% on held-out text), and the budget is a promise about the text served.

One rank (or group count) serves every layer: the paged pool lays out one latent width per block, and per-layer
ranks of the same total width, measured on SmolLM2-135M (``python -m bench.mla_layer_ranks``), were not cheaper on
both calibration and held-out text at any width.

A setting that saves less than :data:`MIN_SAVING` of ``full``'s bytes within the budget is reported as saving
nothing (logged as a warning, in ``/info``'s ``kv_quality`` and on the page); a setting given explicitly is kept
and priced, and served with a warning naming its price and agreement when it misses a bound. Prices are kept in
the calibration cache (kind ``price``, with their agreement and the dtype the model computed in, which is part of
the entry's key: a price measured in one dtype is never reused in another), so a second start in the same dtype
measures nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

from cache_backends.base import KVBackend
from cache_backends.geometry import ModelGeometry
from cache_backends.registry import create
from cache_backends import catalog
from cache_backends.quant_formats import width_multiple
from cache_backends.spec import format_spec
from server.quality_price import LongPrice, Price, Scorer

log = logging.getLogger("kvserve.budget")

SEARCH_HEADROOM = 0.7  # the search keeps a chosen setting's calibration price within this share of the budget
MIN_SAVING = 0.05  # a setting that saves less than this share of full's bytes "saves nothing"
RANK_LADDER = 16  # mla's candidate ranks: 2 H d k / 16, k = 1 .. 16


@dataclass
class Choice:
    """One backend's outcome: the setting served, its price, and what was tried (``/info``'s ``kv_quality``)."""

    backend: str
    spec: str
    budget_pct: float | None
    price: Price | None
    bytes_per_token: float
    full_bytes_per_token: float
    min_agreement: float | None = None  # the bound on the price's agreement (KV_QUALITY_MIN_AGREEMENT), or None
    searched: str | None = None  # the option the search chose ("rank", "groups", "threshold", "rotate")
    explicit: bool = False  # the searched option was set explicitly (kept as given)
    tried: list[dict] = field(default_factory=list)
    message: str = ""
    long_price: LongPrice | None = None  # on the long input, for a backend that can lose far tokens; else None

    @property
    def compression(self) -> float:
        return self.full_bytes_per_token / self.bytes_per_token if self.bytes_per_token else float("inf")

    @property
    def within_budget(self) -> bool:
        """Both bounds hold: the price within ``budget_pct`` and the agreement at least ``min_agreement`` (no
        budget: nothing is bounded)."""
        return self.price is None or self.budget_pct is None or self.price.within(self.budget_pct, self.min_agreement)

    @property
    def agreement_shortfall(self) -> float | None:
        """How far the price's agreement is under ``min_agreement`` when it is, else ``None``."""
        if self.price is None or self.budget_pct is None or not self.price.shortfall(self.min_agreement):
            return None
        return self.price.shortfall(self.min_agreement)

    @property
    def saves_nothing(self) -> bool:
        """Holds at least (1 - MIN_SAVING) of full's bytes; never for ``elastic``, whose size is a range (full's
        without pressure, compressed under it) rather than a setting's."""
        if catalog.get(self.backend.split("+")[0]).size_is_range:
            return False
        return self.bytes_per_token > (1 - MIN_SAVING) * self.full_bytes_per_token

    @property
    def long_context_warning(self) -> str | None:
        """What to say of a setting that loses on the long input what the short price cannot see: its retrieval
        under ``full``'s by more than :data:`server.quality_price.RETRIEVAL_MARGIN`, or its long price over the
        budget; else ``None``. It says what the short price shows: nothing of it within the budget; over it, that the
        setting is over the budget already."""
        long = self.long_price
        if long is None:
            return None
        over = self.budget_pct is not None and long.ppl_increase_pct > self.budget_pct
        if not long.loses_retrieval() and not over:
            return None
        missed = [f"{d:g}" for d, f in zip(long.depths, long.found) if not f]
        said = []
        if long.loses_retrieval():
            said.append(f"finds {long.retrieval:.0%} of the needles where full finds {long.reference_retrieval:.0%}"
                        f" (missed at depth {', '.join(missed)})")
        if over:
            said.append(f"costs +{long.ppl_increase_pct:.2f}% perplexity on its last {long.tokens} tokens, over the "
                        f"quality budget of +{self.budget_pct:g}%")
        short = f"+{self.price.ppl_increase_pct:.2f}%" if self.price else "not priced"
        over_short = self.price is not None and not self.price.within(self.budget_pct)
        shows = "is over the budget already" if over_short else "does not show it"
        return (f"{self.backend}: on a {long.context}-token input it {' and '.join(said)}; its price on the "
                f"quality budget's short windows ({short}) {shows} (docs/backends.md, 'window')")

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("price", "long_price")}
        out["price"] = asdict(self.price) if self.price else None
        out["long_price"] = asdict(self.long_price) if self.long_price else None
        short = self.agreement_shortfall
        out.update(compression=round(self.compression, 3), within_budget=self.within_budget,
                   saves_nothing=self.saves_nothing, agreement_shortfall=None if short is None else round(short, 4),
                   long_context_warning=self.long_context_warning)
        return out


def bytes_per_token(backend: KVBackend, seq_len: int = 1024) -> float:
    """All layers' bytes per token at ``seq_len`` tokens (the sums ``/info`` reports)."""
    return backend.bytes_per_token_per_layer(seq_len) * backend.geometry.num_layers


def search_axis(name: str, geometry: ModelGeometry) -> str | None:
    """The option the budget chooses for backend ``name`` (a composition: its outer part's), or ``None``."""
    axis = catalog.get(name.split("+")[0]).budget_axis
    return None if axis == "rank" and geometry.kv_lora_rank else axis  # a native latent's width is the model's


def rank_multiple(name: str, options: dict) -> int:
    """What a latent rank must be a multiple of for backend ``name``'s quantized tier to store it: its code formats'
    width rule (:func:`cache_backends.quant_formats.width_multiple`; int4: 2), the tier read from the first part
    that declares one, at ``options`` over its defaults; 1 without a quantized part."""
    for part in name.split("+"):
        decl = catalog.get(part)
        if decl.quantization is not None:
            tier = decl.quantization({**decl.defaults(), **{k: v for k, v in options.items() if decl.option(k)}})
            return width_multiple(tier.key_bits, tier.value_bits)
    return 1


def candidates(name: str, axis: str, geometry: ModelGeometry, options: dict) -> list:
    """The values of ``axis`` to try, most compressive first."""
    if axis == "rank":
        width = 2 * geometry.num_key_value_heads * geometry.head_dim
        m = rank_multiple(name, options)  # a quantized latent packs whole bytes of codes (int4: an even rank)
        ranks = sorted({max(1, width * k // RANK_LADDER) for k in range(1, RANK_LADDER + 1)})
        return [r + -r % m for r in ranks if r + -r % m <= width]
    if axis == "groups":
        h = geometry.num_key_value_heads
        return [g for g in range(1, h + 1) if h % g == 0]
    if axis == "rotate":
        return [False, True]
    raise ValueError(f"no candidates for {axis}")


def choose(name: str, geometry: ModelGeometry, options: dict, explicit: set[str], model, calibration_ids,
           cache, scorer: Scorer | None, budget_pct: float | None,
           min_agreement: float | None = None) -> tuple[KVBackend, Choice]:
    """Build and prepare backend ``name``: the setting the budget chooses, or the one ``options`` gives.

    Args:
        options: the backend's options from the settings (defaults included).
        explicit: the options the user set explicitly (kept, never searched).
        scorer: prices settings; ``None`` (no budget): nothing is priced.
        budget_pct: the bound on the price, percent perplexity increase; ``None``: no search.
        min_agreement: the bound on the agreement with ``full`` (0-1]; ``None``: none. Bounds only with a budget.

    Returns:
        The prepared backend and its :class:`Choice`.

    Raises:
        ValueError: a backend or option the model cannot take (as :func:`cache_backends.registry.create`).
    """
    full_bytes = bytes_per_token(create("full", geometry))
    axis = search_axis(name, geometry)
    search = budget_pct is not None and scorer is not None and axis is not None and axis not in explicit

    def build(**override) -> KVBackend:
        backend = create(name, geometry, **{**options, **override})
        backend.prepare(model, calibration_ids, cache)
        return backend

    def record(backend: KVBackend, price: Price | None, tried: list) -> None:
        tried.append({"spec": format_spec(backend.name, backend.params()), "bytes_per_token": bytes_per_token(backend),
                      **({"ppl_increase_pct": round(price.ppl_increase_pct, 4), "kl": price.kl,
                          "agreement": price.agreement} if price else {})})

    def fits(price: Price) -> bool:  # what the search keeps: the price within its headroom, the agreement bound
        return price.within(SEARCH_HEADROOM * budget_pct, min_agreement)

    def short(price: Price) -> float:  # with none that fits: the setting closest to the agreement bound is served
        return price.shortfall(min_agreement)

    tried: list[dict] = []
    began = time.perf_counter()
    if not search:
        backend = build()
        price = scorer.price(backend) if scorer is not None and name != "full" else None
    elif axis == "threshold":
        backend, price = _search_dca(build, scorer, fits, short, tried, record)
    elif axis == "rotate":
        priced = []
        for value in candidates(name, axis, geometry, options):
            b = build(rotate=value)
            p = scorer.price(b)
            record(b, p, tried)
            priced.append((not fits(p), short(p), p.kl, value, b, p))
        *_, backend, price = min(priced, key=lambda x: x[:3])
    else:
        values = candidates(name, axis, geometry, options)
        backend, price = _bisect(values, lambda v: build(**{axis: v}), scorer, fits, short, tried, record)
    probe = getattr(scorer, "long_probe", None)
    long = scorer.long_price(backend) if probe is not None and backend.drops_tokens(len(probe.ids)) else None
    choice = Choice(backend=name, spec=format_spec(backend.name, backend.params()), budget_pct=budget_pct,
                    price=price, bytes_per_token=bytes_per_token(backend), full_bytes_per_token=full_bytes,
                    min_agreement=min_agreement if budget_pct is not None else None,
                    searched=axis if search else None, explicit=axis in explicit if axis else False, tried=tried,
                    long_price=long)
    choice.message = _message(choice, axis)
    level = logging.WARNING if (not choice.within_budget or (choice.saves_nothing and name != "full")) else logging.INFO
    log.log(level, "%s (%.1f s)", choice.message, time.perf_counter() - began)
    if long is not None:
        log.log(logging.WARNING if choice.long_context_warning else logging.INFO,
                "%s", choice.long_context_warning or long_summary(choice))
    return backend, choice


def _bisect(values: list, build, scorer: Scorer, fits, short, tried: list, record):
    """The first of ``values`` (most compressive first, price falling and agreement rising along them) whose price
    ``fits`` (a predicate on :class:`Price`), by bisection. When none does: of the values priced, the one whose
    agreement is the least ``short`` of its bound (a function of :class:`Price`), the later priced of equals; with
    no agreement bound, the last value (the bisection's last step prices it: every step before it moved up)."""
    lo, hi = 0, len(values) - 1
    found, closest = None, None
    while lo <= hi:
        mid = (lo + hi) // 2
        backend = build(values[mid])
        last = (backend, scorer.price(backend))
        record(*last, tried)
        if fits(last[1]):
            found, hi = last, mid - 1
        else:
            lo = mid + 1
        if closest is None or short(last[1]) <= short(closest[1]):
            closest = last
    return found or closest


def _search_dca(build, scorer: Scorer, fits, short, tried: list, record):
    """dca: the lowest threshold among the layers' calibrated similarities whose reuse ``fits`` (a predicate on
    :class:`Price`: within the budget). When none does, no layer reused, unless a threshold priced is less
    ``short`` of the agreement bound (a function of :class:`Price`)."""
    backend = build(threshold=1.01)  # prepared once: the similarities; no layer reused at this threshold
    levels = sorted(set(backend.served_similarity.values()), reverse=True)  # each admits one more layer or more
    best: tuple[float, Price] | None = None
    priced: list[tuple[float, Price]] = []
    lo, hi = 0, len(levels) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        backend.set_threshold(levels[mid])
        price = scorer.price(backend)
        record(backend, price, tried)
        priced.append((levels[mid], price))
        if fits(price):
            best, lo = (levels[mid], price), mid + 1
        else:
            hi = mid - 1
    if best is None:  # no reuse layer within the budget: none reused (the inner backend's own price), or the
        backend.set_threshold(1.01)  # threshold closest to the agreement bound when that is closer
        price = scorer.price(backend)
        record(backend, price, tried)
        best = min([(1.01, price)] + priced, key=lambda p: short(p[1]))  # the first of equals: none reused
    backend.set_threshold(best[0])
    return backend, best[1]


def _message(choice: Choice, axis: str | None) -> str:
    head = f"{choice.backend}: {choice.spec}"
    if choice.backend == "full":
        return "full: exact K/V, the reference every price is measured against"
    if choice.price is None:
        return f"{head}: {choice.compression:.2f}x smaller than full (not priced: no quality budget)"
    price = choice.price
    cost = (f"{choice.compression:.2f}x smaller than full for +{price.ppl_increase_pct:.2f}% perplexity, top-1 "
            f"agreement {price.agreement:.3f} (KL {price.kl:.4f} nats/token on {price.tokens} calibration tokens)")
    if choice.budget_pct is None:
        return f"{head}: {cost}"
    bounds = f"the quality budget of +{choice.budget_pct:g}%" + (
        f" and top-1 agreement {choice.min_agreement:g}" if choice.min_agreement is not None else "")
    if not choice.within_budget:
        why = "explicit setting" if choice.explicit or not choice.searched else "no setting within it" + (
            f"; the highest agreement of those tried: {_tried(choice)}" if choice.agreement_shortfall else "")
        return f"{head}: {_missed(choice)} ({why}): {cost}"
    if choice.searched and choice.saves_nothing:
        return (f"{head}: saves nothing within {bounds} "
                f"(every more compressive {axis} costs more: {_tried(choice)}); {cost}")
    if choice.saves_nothing and choice.backend != "full":
        return f"{head}: saves nothing (under {100 * MIN_SAVING:.0f}% of full's bytes): {cost}"
    chosen = f"chosen by {bounds}" if choice.searched else "within the budget"
    return f"{head}: {chosen}: {cost}"


def long_summary(choice: Choice) -> str:
    """``choice``'s long price (not ``None``) in words, as the start-up log says it when it warns of nothing."""
    long = choice.long_price
    return (f"{choice.backend}: on a {long.context}-token input +{long.ppl_increase_pct:.2f}% perplexity on its last "
            f"{long.tokens} tokens, top-1 agreement {long.agreement:.3f}, {long.retrieval:.0%} of the needles found "
            f"(full: {long.reference_retrieval:.0%})")


def _missed(choice: Choice) -> str:
    """The bounds ``choice``'s price misses, in words."""
    over = f"over the quality budget of +{choice.budget_pct:g}%"
    if choice.price.within(None, choice.min_agreement):
        return over
    under = f"top-1 agreement of {choice.min_agreement:g} (short by {choice.agreement_shortfall:.4f})"
    if choice.price.within(choice.budget_pct):
        return f"under the quality budget's {under}"
    return f"{over} and under its {under}"


def _tried(choice: Choice) -> str:
    bounded = choice.min_agreement is not None
    return ", ".join(f"{t['spec']} +{t['ppl_increase_pct']:.1f}%" + (f" (agreement {t['agreement']:.3f})" if bounded
                                                                     else "")
                     for t in choice.tried if "ppl_increase_pct" in t)
