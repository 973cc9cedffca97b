"""The quality budget (``KV_QUALITY_BUDGET``): each served backend's measured price, and the calibrating backends'
most compressive setting within it.

**The price** of a backend is measured on the calibration text, through the backend's own cache path, against
``full``: :data:`PRICE_WINDOWS` windows of :data:`PRICE_WINDOW` tokens from the end of the text; the first
:data:`PRICE_PREFIX` tokens of each are prefilled into the backend's store, and the later ones are fed in chunks
of :data:`SCORE_CHUNK` tokens whose queries attend to what the store holds, its compressed form (teacher
forcing; a store that decides once per prompt, dca's, takes the prefix as its prompt and is scored one decode
step per token, since a prompt's own prefill attends to its exact K/V and would price any reuse at nothing). At every scored position the price counts the KL divergence KL(p_full || p_backend) of the
next-token distributions, in nats; its mean over the scored tokens, ``kl``, is the price, expressed as the
perplexity increase it implies, ``100 * (exp(kl) - 1)`` percent (the expected increase of the cross-entropy
under ``full``'s own distribution is the KL divergence). The realized perplexity change of the scored tokens is
reported beside it; the KL form is the one the budget is checked on because it is paired per position and never
negative, so it separates a 1% price from noise on a few hundred tokens where the realized change does not.

**The agreement** is measured in the same pass: the share of scored positions (0 to 1) where the backend's most
likely next token is ``full``'s (teacher-forced top-1 agreement: both read the same text, so one difference does
not move every later position). Perplexity is an average over the whole distribution; the agreement says how
often greedy decoding would pick another token, so a setting within the price that flips greedy answers says
so. ``KV_QUALITY_MIN_AGREEMENT`` (unset by default) bounds it: with it set, a setting is within the budget only
when both hold, and the search applies it as given (no headroom: it is a share of tokens, not an average over
them).

**The long price.** The windows are short, so a backend that drops tokens older than a window (``window`` and its
compositions: :meth:`cache_backends.base.KVBackend.drops_tokens`) costs nothing there and fails at long context. Such a backend is also priced
on one long input (:mod:`server.long_context`, ``KV_QUALITY_LONG_CONTEXT``): the KL, perplexity change and agreement
on its last :data:`server.long_context.LONG_SCORED` tokens, and the needles it finds, against ``full`` on the same
input (:class:`LongPrice`). It bounds nothing: a backend that finds more than :data:`RETRIEVAL_MARGIN` fewer needles
than ``full``, or whose long price is over the budget, is served with a warning
(:attr:`Choice.long_context_warning`). Long prices are cached as the others, keyed by the long input's tokens and
layout.

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
import math
import time
from dataclasses import asdict, dataclass, field

import torch

from cache_backends.base import KVBackend, ModelGeometry
from cache_backends.registry import create
from cache_backends import catalog
from cache_backends.spec import format_spec
from cache_backends.store_path import StorePath
from server.long_context import DEPTHS, LongProbe

log = logging.getLogger("kvserve.budget")

PRICE_WINDOWS = 3  # windows of the calibration text scored per price
PRICE_WINDOW = 512  # tokens per window
PRICE_PREFIX = 256  # of which prefilled (not scored): the rest are scored in chunks
SCORE_CHUNK = 16  # tokens per scoring chunk (each chunk's queries read the stored, compressed form)
SEARCH_HEADROOM = 0.7  # the search keeps a chosen setting's calibration price within this share of the budget
MIN_SAVING = 0.05  # a setting that saves less than this share of full's bytes "saves nothing"
PRICE_VERSION = 6  # of the cached price entries (6: the dtype in the key; 5's, which may be another dtype's, and
# 4's, without the agreement, are not read back)
RANK_LADDER = 16  # mla's candidate ranks: 2 H d k / 16, k = 1 .. 16
LONG_CHUNK = 512  # prefill tokens per step of the long input, up to its scored tail
RETRIEVAL_MARGIN = 0.05  # a backend whose long-input retrieval is under full's by more than this is warned about


def ppl_increase(kl: float) -> float:
    """The perplexity increase (percent) a mean KL divergence of ``kl`` nats per token implies."""
    return 100.0 * math.expm1(kl)


def mean_kl(reference: torch.Tensor, logp: torch.Tensor) -> float:
    """Mean over positions of KL(p_reference || p), nats: both log-probabilities of shape (..., vocab_size)."""
    return (reference.exp() * (reference - logp)).sum(-1).clamp_min(0).mean().item()


def token_nll(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The negative log-likelihood of each target token: ``logp`` (..., vocab_size), ``targets`` (...) ids."""
    return -logp.gather(-1, targets.unsqueeze(-1).to(logp.device)).squeeze(-1)


def top1_agreement(reference: torch.Tensor, scores: torch.Tensor) -> float:
    """The share (0 to 1) of positions where ``scores``' most likely token is ``reference``'s: both of shape
    (..., vocab_size), logits or log-probabilities alike (the argmax is the same)."""
    same = reference.argmax(-1) == scores.argmax(-1)
    return same.sum().item() / same.numel()


@dataclass
class Price:
    """What a backend setting costs on the calibration text (see the module docstring)."""

    kl: float  # mean KL(p_full || p_backend), nats per scored token
    ppl_increase_pct: float  # 100 * (exp(kl) - 1)
    ppl_change_pct: float  # realized perplexity change of the scored tokens vs full
    tokens: int  # scored tokens
    agreement: float  # share (0-1) of the scored positions where the top-1 token is full's (teacher forcing)

    def within(self, budget_pct: float | None, min_agreement: float | None = None) -> bool:
        """Whether the price is at most ``budget_pct`` (percent) and the agreement at least ``min_agreement``
        (each ``None``: no bound)."""
        return ((budget_pct is None or self.ppl_increase_pct <= budget_pct)
                and (min_agreement is None or self.agreement >= min_agreement))

    def shortfall(self, min_agreement: float | None) -> float:
        """How far the agreement is under ``min_agreement`` (0 when it is not, or with no bound)."""
        return 0.0 if min_agreement is None else max(0.0, min_agreement - self.agreement)


@dataclass
class LongPrice:
    """What a backend costs on the long input (:mod:`server.long_context`), against ``full`` on the same input."""

    context: int  # tokens of the long input
    kl: float  # mean KL(p_full || p_backend) on its scored tail, nats per token
    ppl_increase_pct: float  # 100 * (exp(kl) - 1)
    ppl_change_pct: float  # realized perplexity change of the scored tail vs full
    tokens: int  # scored tokens
    agreement: float  # share (0-1) of the scored tail's positions where the top-1 token is full's
    depths: list[float]  # each needle's depth (0: the filler's start)
    found: list[bool]  # each needle's value reproduced by the backend's top-1 tokens (teacher forcing)
    retrieval: float  # share (0-1) of the needles found
    reference_retrieval: float  # full's share on the same input

    def loses_retrieval(self) -> bool:
        """The retrieval is under ``full``'s by more than :data:`RETRIEVAL_MARGIN`."""
        return self.retrieval < self.reference_retrieval - RETRIEVAL_MARGIN - 1e-9


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
        under ``full``'s by more than :data:`RETRIEVAL_MARGIN`, or its long price over the budget; else ``None``."""
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
        return (f"{self.backend}: on a {long.context}-token input it {' and '.join(said)}; its price on the "
                f"quality budget's short windows ({short}) does not show it (docs/backends.md, 'window')")

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("price", "long_price")}
        out["price"] = asdict(self.price) if self.price else None
        out["long_price"] = asdict(self.long_price) if self.long_price else None
        short = self.agreement_shortfall
        out.update(compression=round(self.compression, 3), within_budget=self.within_budget,
                   saves_nothing=self.saves_nothing, agreement_shortfall=None if short is None else round(short, 4),
                   long_context_warning=self.long_context_warning)
        return out


class Scorer:
    """Scores backends on fixed windows of the calibration text against ``full`` (computed once).

    Args:
        model: the loaded model.
        geometry: its attention shape.
        calibration_ids: the calibration token ids; windows are taken from their end.
        cache: a :class:`cache_backends.calibration_cache.CalibrationCache` that keeps prices, or ``None``.
        windows, window, prefix: how many windows of how many tokens, and the tokens of each prefilled before
            scoring (defaults: :data:`PRICE_WINDOWS`, :data:`PRICE_WINDOW`, :data:`PRICE_PREFIX`).
        long_probe: the long input (:func:`server.long_context.build_long_probe`) that :meth:`long_price` prices
            on, or ``None`` (no long price).

    Raises:
        ValueError: the calibration text is shorter than one window.
    """

    def __init__(self, model, geometry: ModelGeometry, calibration_ids: list[int], cache=None,
                 windows: int = PRICE_WINDOWS, window: int = PRICE_WINDOW, prefix: int = PRICE_PREFIX,
                 long_probe: LongProbe | None = None):
        self.model, self.geometry, self.cache = model, geometry, cache
        self.long_probe = long_probe
        self._long_reference: tuple[torch.Tensor, torch.Tensor, list[bool]] | None = None
        window = min(window, model.config.max_position_embeddings)
        self.prefix = min(prefix, window * 3 // 4)
        n = min(windows, len(calibration_ids) // window)
        if n < 1:
            raise ValueError(f"the calibration text has {len(calibration_ids)} tokens; the quality budget needs "
                             f"at least {window}")
        start = len(calibration_ids) - n * window
        self.windows = [calibration_ids[start + i * window : start + (i + 1) * window] for i in range(n)]
        self.ids = [t for w in self.windows for t in w]
        self._reference: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.inference_mode()
    def _logprobs(self, backend: KVBackend) -> torch.Tensor:
        """(windows, scored tokens, vocab_size) float32 log-probabilities through ``backend``'s cache path."""
        runner = StorePath(self.model, self.geometry.num_layers)
        stores = [backend.new_store() for _ in self.windows]
        try:
            if not stores[0].supports_chunked_prefill:  # a store that decides once per prompt (dca): the prefix
                # as the prompt, then one decode step per token (a prompt's own prefill attends to its exact K/V:
                # scoring it would price reuse at nothing), the windows batched
                steps = [torch.stack([runner.prefill(w[: self.prefix], s)[-1] for w, s in zip(self.windows, stores)])]
                for pos in range(self.prefix, len(self.windows[0]) - 1):
                    steps.append(runner.decode([w[pos] for w in self.windows], stores))
                out = torch.stack(steps, dim=1)
            else:  # the prefix, then chunks of SCORE_CHUNK tokens, each reading the stored (compressed) form
                rows = []
                for w, s in zip(self.windows, stores):
                    first = runner.prefill(w[: self.prefix], s)[-1:]
                    rest = w[self.prefix : -1]
                    rows.append(torch.cat([first] + [runner.prefill(rest[i : i + SCORE_CHUNK], s, all_logits=True)
                                                     for i in range(0, len(rest), SCORE_CHUNK)]))
                out = torch.stack(rows)
        finally:
            for s in stores:
                s.release()
        return torch.log_softmax(out.float(), -1)

    def _targets(self) -> torch.Tensor:
        return torch.tensor([w[self.prefix :] for w in self.windows])  # (windows, scored)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``full``'s (log-probabilities, negative log-likelihood per scored token), computed once."""
        if self._reference is None:
            full = create("full", self.geometry)
            logp = self._logprobs(full)
            self._reference = (logp, token_nll(logp, self._targets()))
        return self._reference

    def price(self, backend: KVBackend) -> Price:
        """The price of a prepared ``backend`` (from the cache when it holds this setting's)."""
        if self.cache is None or not self.cache.directory:
            return self._measure(backend)
        spec = format_spec(backend.name, backend.params())
        figures = self.cache.fetch(  # the dtype is in the key: a price measured in float32 is not bfloat16's; so
            # are the windows' count and size (the same ids, cut otherwise, are other scored tokens)
            "price", self.model, self.ids, {"spec": spec, "prefix": self.prefix, "dtype": self._dtype(),
                                            "windows": len(self.windows), "window": len(self.windows[0])},
            fit=lambda: self._fit(backend), load=lambda _, figures: figures, version=PRICE_VERSION)
        return Price(**figures["price"])

    def _dtype(self) -> str:
        """The dtype the model computes in, as the cache records it (``float32``, ``bfloat16``...)."""
        return str(self.model.dtype).removeprefix("torch.")

    def _fit(self, backend: KVBackend) -> tuple[dict[str, torch.Tensor], dict]:
        price = self._measure(backend)  # with the dtype the model computed in (kvserve estimate names it)
        return {"kl": torch.tensor([price.kl])}, {"price": asdict(price), "dtype": self._dtype()}

    def _measure(self, backend: KVBackend) -> Price:
        ref_logp, ref_nll = self.reference()
        logp = self._logprobs(backend)
        kl = mean_kl(ref_logp, logp)
        nll = token_nll(logp, self._targets())
        change = 100.0 * math.expm1((nll.mean() - ref_nll.mean()).item())
        return Price(kl=kl, ppl_increase_pct=ppl_increase(kl), ppl_change_pct=change, tokens=nll.numel(),
                     agreement=top1_agreement(ref_logp, logp))

    # ---- the long input ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _long_pass(self, backend: KVBackend) -> tuple[torch.Tensor, list[bool]]:
        """Through ``backend``'s store, the long input: ``(log-probabilities of its scored tail, (LONG_SCORED,
        vocab_size) float32; each needle found)``. Everything before the tail is prefilled in chunks of
        :data:`LONG_CHUNK`, the rest fed in chunks of :data:`SCORE_CHUNK` (a store that decides once per prompt:
        one decode step per token), so every scored query reads what the store holds of the whole input."""
        probe = self.long_probe
        ids, start = probe.ids, probe.scored[0]
        runner = StorePath(self.model, self.geometry.num_layers)
        store = backend.new_store()
        try:
            if store.supports_chunked_prefill:
                for i in range(0, start, LONG_CHUNK):
                    last = runner.prefill(ids[i : min(i + LONG_CHUNK, start)], store)[-1:]
                rest = ids[start:-1]
                rows = torch.cat([last] + [runner.prefill(rest[i : i + SCORE_CHUNK], store, all_logits=True)
                                           for i in range(0, len(rest), SCORE_CHUNK)])
            else:
                steps = [runner.prefill(ids[:start], store)[-1:]]
                steps += [runner.decode([t], [store]) for t in ids[start:-1]]
                rows = torch.cat(steps)
        finally:
            store.release()
        rows = rows.float()  # row r predicts ids[start + r]
        top = rows.argmax(-1).tolist()
        found = [all(top[p - start] == ids[p] for p in range(a, b)) for a, b in probe.values]
        end = probe.scored[1] - start
        return torch.log_softmax(rows[:end], -1), found

    def long_reference(self) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
        """``full``'s (log-probabilities of the long input's scored tail, (LONG_SCORED, vocab_size); its negative
        log-likelihood per token, (LONG_SCORED,); each needle found), computed once.

        Raises:
            ValueError: the scorer has no long input.
        """
        if self.long_probe is None:
            raise ValueError("this scorer has no long input (KV_QUALITY_LONG_CONTEXT)")
        if self._long_reference is None:
            logp, found = self._long_pass(create("full", self.geometry))
            self._long_reference = (logp, self._long_nll(logp), found)
        return self._long_reference

    def _long_nll(self, logp: torch.Tensor) -> torch.Tensor:
        a, b = self.long_probe.scored
        return token_nll(logp, torch.tensor(self.long_probe.ids[a:b]))

    def long_price(self, backend: KVBackend) -> LongPrice:
        """The price of a prepared ``backend`` on the long input (from the cache when it holds this setting's on
        this very input: its ids, length, layout and the model's dtype are in the key).

        Raises:
            ValueError: the scorer has no long input.
        """
        if self.long_probe is None:
            raise ValueError("this scorer has no long input (KV_QUALITY_LONG_CONTEXT)")
        if self.cache is None or not self.cache.directory:
            return self._measure_long(backend)
        spec = format_spec(backend.name, backend.params())
        figures = self.cache.fetch(  # entries without a "price" figure: the CLIs' price book passes them over
            "price", self.model, self.long_probe.ids,
            {"spec": spec, "dtype": self._dtype(), "long": self.long_probe.params()},
            fit=lambda: self._fit_long(backend), load=lambda _, figures: figures, version=PRICE_VERSION)
        return LongPrice(**figures["long_price"])

    def _fit_long(self, backend: KVBackend) -> tuple[dict[str, torch.Tensor], dict]:
        price = self._measure_long(backend)
        return {"kl": torch.tensor([price.kl])}, {"long_price": asdict(price), "dtype": self._dtype()}

    def _measure_long(self, backend: KVBackend) -> LongPrice:
        ref_logp, ref_nll, ref_found = self.long_reference()
        logp, found = self._long_pass(backend)
        kl = mean_kl(ref_logp, logp)
        nll = self._long_nll(logp)
        return LongPrice(context=len(self.long_probe.ids), kl=kl, ppl_increase_pct=ppl_increase(kl),
                         ppl_change_pct=100.0 * math.expm1((nll.mean() - ref_nll.mean()).item()),
                         tokens=nll.numel(), agreement=top1_agreement(ref_logp, logp), depths=list(DEPTHS),
                         found=found, retrieval=sum(found) / len(found),
                         reference_retrieval=sum(ref_found) / len(ref_found))


def bytes_per_token(backend: KVBackend, seq_len: int = 1024) -> float:
    """All layers' bytes per token at ``seq_len`` tokens (the sums ``/info`` reports)."""
    return backend.bytes_per_token_per_layer(seq_len) * backend.geometry.num_layers


def search_axis(name: str, geometry: ModelGeometry) -> str | None:
    """The option the budget chooses for backend ``name`` (a composition: its outer part's), or ``None``."""
    axis = catalog.get(name.split("+")[0]).budget_axis
    return None if axis == "rank" and geometry.kv_lora_rank else axis  # a native latent's width is the model's


def candidates(name: str, axis: str, geometry: ModelGeometry, options: dict) -> list:
    """The values of ``axis`` to try, most compressive first."""
    if axis == "rank":
        width = 2 * geometry.num_key_value_heads * geometry.head_dim
        even = any(p == "int4" for p in name.split("+")) or 4 in (options.get("key_bits"), options.get("value_bits"))
        ranks = sorted({max(1, width * k // RANK_LADDER) for k in range(1, RANK_LADDER + 1)})
        return [r + (r % 2 if even else 0) for r in ranks if not even or r + r % 2 <= width]
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
