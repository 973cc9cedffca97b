"""The quality budget's price (:mod:`server.quality_budget`): what a backend setting costs against ``full``,
measured through its own cache path (:class:`Scorer`: :class:`Price` on short windows of the calibration text,
:class:`LongPrice` on one long input).

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
(:attr:`server.quality_budget.Choice.long_context_warning`). Long prices are cached as the others, keyed by the long input's tokens and
layout.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from cache_backends.base import KVBackend
from cache_backends.geometry import ModelGeometry
from cache_backends.registry import create
from cache_backends.spec import format_spec
from cache_backends.store_path import StorePath
from server.long_context import DEPTHS, LongProbe

PRICE_WINDOWS = 3  # windows of the calibration text scored per price
PRICE_WINDOW = 512  # tokens per window
PRICE_PREFIX = 256  # of which prefilled (not scored): the rest are scored in chunks
SCORE_CHUNK = 16  # tokens per scoring chunk (each chunk's queries read the stored, compressed form)
PRICE_VERSION = 6  # of the cached price entries (6: the dtype in the key; 5's, which may be another dtype's, and
# 4's, without the agreement, are not read back)
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
