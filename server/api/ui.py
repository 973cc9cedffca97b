"""The built-in page (``GET /`` and ``GET /ui``) and the three small JSON routes it reads.

* ``POST /ui/api/generate``: one prompt through one backend (the request's own backend choice, as
  ``kv_backend`` on the TGI and OpenAI routes), answering the text, each token with its log-probability, and
  the request's own measures: its KV store's peak bytes (as ``kvserve_request_kv_cache_bytes`` records
  them), ``full``'s bytes for the same tokens and, where the backend held as many, the reason in words
  (:mod:`server.api.ui_compression`), bytes per cached token, TTFT and TPOT (the definitions of
  :mod:`server.metrics`). The page calls it once per backend to warm it, then once per backend per timing run.
* ``GET /ui/api/live``: the live counters by backend, read from the server's own metric objects (the
  recorder's, not a parse of ``/metrics``), plus the generated tokens of the running sequences.
* ``GET /ui/api/sums``: ``kvserve estimate``'s table for the served model at one context and batch, every
  backend the server knows, with a warning past the model's ``max_position_embeddings``, and each served
  backend's price from the quality budget (``/info``'s ``kv_quality``).
* ``GET /ui/api/defaults``: the page's presets, repetition penalty and chat-template switch for the served
  model (:mod:`server.api.ui_presets`).

The page itself and its assets are static files shipped in the package (``server/api/ui_assets``): they
carry no server data, so with ``API_KEY`` set they load without the key, and the page asks for it once and
sends it as the bearer token on the JSON routes, which need it like every other route.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, HTMLResponse
from pydantic import BaseModel, ConfigDict, Field

from cache_backends.estimate import (DTYPE_BYTES, Shape, bytes_per_token_per_layer, default_params, default_specs,
                                     estimate_rows)
from cache_backends.registry import available
from cache_backends.spec import parse_spec
from server.api.common import SHUTDOWN_MESSAGE, get_service
from server.api.request_model import RequestModel
from server.api.threaded_body import ThreadedBodyRoute
from server.api.types import Int
from server.api.ui_compression import uncompressed_reason
from server.api.ui_presets import chat_turn, has_chat_template, page_defaults
from server.engine.sequence import FinishReason
from server.errors import NotReady, error_response
from server.estimate_cli import applies
from server.service import GenerationRequest, InvalidRequest

ASSETS = Path(__file__).parent / "ui_assets"
# The page's files, served by name only (no path from the request reaches the file system).
ASSET_TYPES = {"app.js": "text/javascript", "style.css": "text/css"}
PUBLIC_PATHS = ("/", "/ui") + tuple(f"/ui/assets/{name}" for name in ASSET_TYPES)
"""Reachable without ``API_KEY`` on GET and HEAD: static files that hold no server data."""

router = APIRouter(tags=["built-in page"], route_class=ThreadedBodyRoute)
ERRORS = {code: {"description": "TGI-style error body {error, error_type}"} for code in (401, 422, 429, 503)}


@router.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse, include_in_schema=False)
@router.api_route("/ui", methods=["GET", "HEAD"], response_class=HTMLResponse, include_in_schema=False)
async def page() -> HTMLResponse:
    """The page (``POST /`` stays TGI's compatibility route)."""
    return HTMLResponse((ASSETS / "index.html").read_text(), headers={"Cache-Control": "no-cache"})


@router.api_route("/ui/assets/{name}", methods=["GET", "HEAD"], include_in_schema=False)
async def asset(name: str):
    if name not in ASSET_TYPES:
        return error_response(404, f"no asset {name!r}", "http")
    return FileResponse(ASSETS / name, media_type=ASSET_TYPES[name], headers={"Cache-Control": "no-cache"})


class UIGenerateRequest(RequestModel):
    """One comparison run: greedy when ``seed`` is null, else seeded sampling at ``temperature``. ``null`` for
    any optional field means its default (:class:`server.api.request_model.RequestModel`)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    prompt: str = Field(min_length=1)
    kv_backend: str = Field(min_length=1, description="One of the served backends (KV_BACKENDS).")
    max_new_tokens: Int = Field(32, ge=1, description="Tokens to generate.")
    seed: Int | None = Field(None, ge=0, le=2**63 - 1, description="null: greedy; else seeded sampling.")
    temperature: float = Field(1.0, gt=0.0, le=2.0, description="Sampling temperature (with a seed).")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    chat: bool = Field(False, description="Send the prompt as one user turn through the model's chat template.")


class UIToken(BaseModel):
    id: int
    text: str
    logprob: float


class UIGenerateResponse(BaseModel):
    kv_backend: str
    text: str
    tokens: list[UIToken]
    finish_reason: str
    prompt_text: str = Field(description="The text the model was given: the prompt, through the chat template "
                             "with ``chat``.")
    prompt_tokens: int
    kv_peak_bytes: int = Field(description="The request's KV store at its largest (bytes).")
    kv_bytes_per_token: float = Field(description="kv_peak_bytes / tokens cached at that size (all layers).")
    kv_full_peak_bytes: int = Field(description="What ``full`` holds for the same tokens (bytes).")
    kv_uncompressed_reason: str | None = Field(
        description="Why kv_peak_bytes is not below kv_full_peak_bytes, in words; null when it is, and for full.")
    ttft_s: float | None = Field(description="Arrival to first token (seconds).")
    tpot_s: float | None = Field(description="(last token - first token) / (generated - 1), seconds.")


@router.post("/ui/api/generate", response_model=UIGenerateResponse, responses=ERRORS)
async def ui_generate(body: UIGenerateRequest, request: Request):
    """Run ``prompt`` through one backend and report the request's KV bytes and latencies, against what ``full``
    holds for the same tokens (and, where the backend held as much, why). Each run prefills its whole prompt:
    it shares no block with another request through the prefix cache. Counted and refused as the other
    generation routes are: 429 past MAX_CONCURRENT_REQUESTS, 503 while draining for a shutdown, and 503 when the
    shutdown's grace period ends it."""
    service = get_service(request)
    prompt, special = body.prompt, True
    if body.chat:
        if not has_chat_template(service.tokenizer):
            raise InvalidRequest("`chat`: this model's tokenizer has no chat template", "chat")
        prompt, special = chat_turn(service.tokenizer, body.prompt)
    params = service.sampling(do_sample=body.seed is not None, temperature=body.temperature, top_p=None,
                              top_k=None, repetition_penalty=body.repetition_penalty, seed=body.seed)
    # a salt of its own: every run computes its whole prompt (no prefix-cache hit from the run before), so
    # repeated runs time the same work
    salt = uuid.uuid4().hex if service.prefix_caching else None
    req = GenerationRequest(prompt=prompt, max_new_tokens=body.max_new_tokens, params=params, stop=[],
                            backend=body.kv_backend, fields={"inputs": "prompt"}, add_special_tokens=special,
                            cache_salt=salt)
    seq, events = await service.run(req, request.receive)
    collected = [ev async for ev in events]
    last = collected[-1]
    if service.is_shutdown_end(last):  # SHUTDOWN_GRACE_SECONDS ended it: another replica can answer
        raise NotReady(SHUTDOWN_MESSAGE)
    if last.finish_reason == FinishReason.CANCELLED:
        return error_response(499, "client closed request", "cancelled")
    if last.finish_reason == FinishReason.ERROR:
        return error_response(500, last.error or "generation failed", "generation")
    tokens = [UIToken(id=ev.token_id, text=ev.text, logprob=ev.logprob) for ev in collected if ev.token_id >= 0]
    t, n = seq.times, len(seq.output_ids)
    # the largest store holds the prompt and every generated token but the last (never fed back)
    cached = len(seq.prompt_ids) + max(n - 1, 0)
    state = request.app.state.kvserve
    full_peak = round(full_bytes_per_token(state) * cached)
    reason = None
    if seq.backend_name != "full" and seq.peak_kv_stored_bytes >= full_peak:
        reason = uncompressed_reason(parse_spec(state.info["kv_estimate_spec"][seq.backend_name]), cached)
    return UIGenerateResponse(
        kv_backend=seq.backend_name, text=last.generated_text or "", tokens=tokens,
        finish_reason=last.finish_reason.value, prompt_text=prompt, prompt_tokens=len(seq.prompt_ids),
        kv_peak_bytes=seq.peak_kv_stored_bytes,
        kv_bytes_per_token=seq.peak_kv_stored_bytes / max(cached, 1), kv_full_peak_bytes=full_peak,
        kv_uncompressed_reason=reason,
        ttft_s=t.first_token - t.arrival if t.first_token is not None else None,
        tpot_s=(t.last_token - t.first_token) / (n - 1) if n > 1 else None)


@router.get("/ui/api/defaults", responses=ERRORS)
async def ui_defaults(request: Request) -> dict:
    """The page's presets, repetition penalty and chat-template switch for the served model
    (:func:`server.api.ui_presets.page_defaults`)."""
    return page_defaults(get_service(request).tokenizer)


def model_shape(state) -> Shape:
    """The served model's attention shape, from its loaded config."""
    return Shape.from_config(state.model_config)


def full_bytes_per_token(state) -> float:
    """``full``'s KV bytes per token over all layers for the served model in its dtype."""
    shape = model_shape(state)
    return bytes_per_token_per_layer(shape, "full", {}, DTYPE_BYTES[state.info["model_dtype"]], 1) * shape.num_layers


LIVE_GAUGES = {"kvserve_requests_running": "running", "kvserve_requests_waiting": "waiting",
               "kvserve_kv_cache_bytes": "kv_bytes", "kvserve_kv_cache_used_bytes": "kv_used_bytes",
               "kvserve_kv_cache_tokens": "kv_tokens", "kvserve_generation_tokens_total": "generated_tokens",
               "kvserve_requests_total": "requests"}


@router.get("/ui/api/live", responses=ERRORS)
async def ui_live(request: Request) -> dict:
    """The live counters by backend, from the server's own metric objects: requests running and waiting,
    KV bytes allocated and used, tokens cached, tokens generated (ended requests' plus the running ones'),
    requests ended; with the KV budget and a monotonic clock for rates."""
    state = request.app.state.kvserve
    service = get_service(request)
    backends = {name: dict.fromkeys(LIVE_GAUGES.values(), 0) for name in service.engine.backends}
    for family in state.metrics.registry.collect():
        for sample in family.samples:
            key = LIVE_GAUGES.get(sample.name)
            row = backends.get(sample.labels.get("backend"))
            if key is not None and row is not None:
                row[key] += int(sample.value)
    recorder = service.engine.recorder
    for name, row in backends.items():
        row["generated_tokens"] += (recorder.live_generated.get(name, 0) if recorder else 0)
    return {"time": time.monotonic(), "kv_cache_budget_bytes": state.settings.kv_cache_budget_bytes,
            "max_batch_size": state.settings.max_batch_size, "backends": backends}


def sums_specs(shape: Shape, dtype_bytes: int) -> list[str]:
    """Every backend in its declared order with its extra rows (``int8:value_bits=4``, vLLM's k8v4 mix), then every
    composition this server knows (:func:`cache_backends.registry.available`), less what kvserve cannot serve on
    the model (:func:`server.estimate_cli.applies`)."""
    singles = [s for s in default_specs() if "+" not in s]
    known = singles + [s for s in available() if s not in singles]
    return [s for s in known if applies(shape, parse_spec(s), dtype_bytes)]


def served_price(names: list[str], quality: dict) -> dict | None:
    """The quality budget's price of the first of the served backends ``names`` that it priced (``/info``'s
    ``kv_quality``): its perplexity increase (percent), its top-1 agreement with ``full`` (0-1), whether it is
    within the budget (both bounds), the budget and the agreement bound (``None``: none), how far the agreement is
    under that bound (``agreement_shortfall``, ``None`` when it is not) and whether the search served the setting
    closest to the bound because none reached it (``closest``), and what the long input says it loses that the price
    cannot show (``long_context_warning``: /info's, ``None`` when nothing); ``full``'s is 0 and 1 (the reference
    every price is measured against); ``None`` when none was priced (the budget off)."""
    for name in names:
        q = quality.get(name) or {}
        if name == "full":
            return {"served_as": name, "ppl_increase_pct": 0.0, "agreement": 1.0, "within_budget": True,
                    "budget_pct": q.get("budget_pct"), "min_agreement": q.get("min_agreement"),
                    "agreement_shortfall": None, "closest": False, "long_context_warning": None}
        if q.get("price"):
            short = q.get("agreement_shortfall")
            return {"served_as": name, "ppl_increase_pct": q["price"]["ppl_increase_pct"],
                    "agreement": q["price"]["agreement"], "within_budget": q["within_budget"],
                    "budget_pct": q["budget_pct"], "min_agreement": q["min_agreement"], "agreement_shortfall": short,
                    "closest": bool(short and q.get("searched") and not q.get("explicit")),
                    "long_context_warning": q.get("long_context_warning")}
    return None


def context_warnings(seq_len: int, max_positions: int | None, max_total_tokens: int | None) -> list[str]:
    """What a context of ``seq_len`` tokens runs into on this server, in words (empty when nothing)."""
    if max_positions and seq_len > max_positions:
        return [f"{seq_len:,} tokens is more than this model's {max_positions:,} positions "
                "(max_position_embeddings): it cannot hold that context; the sums show what the cache would cost "
                "if it could."]
    if max_total_tokens and seq_len > max_total_tokens:
        return [f"{seq_len:,} tokens is more than this server serves in one sequence (MAX_TOTAL_TOKENS = "
                f"{max_total_tokens:,})."]
    return []


@router.get("/ui/api/sums", responses=ERRORS)
async def ui_sums(request: Request, seq_len: int = Query(1024, ge=1, le=10_000_000, description="Context (tokens)."),
                  batch: int = Query(1, ge=1, le=100_000, description="Sequences.")) -> dict:
    """``kvserve estimate`` for the served model and dtype at ``seq_len`` tokens and ``batch`` sequences: every
    backend this server knows at the estimator's defaults for the model (and the k8v4 mix), and each served
    backend's own spec; ``aka`` names a row's common name (k8v4), ``price`` a served row's price from the
    quality budget (:func:`served_price`; ``None``: not priced), ``warnings`` a context the model or the server
    cannot hold."""
    state = request.app.state.kvserve
    get_service(request)
    info = state.info
    shape = model_shape(state)
    dtype_bytes = DTYPE_BYTES[info["model_dtype"]]
    served = {name: parse_spec(spec) for name, spec in info["kv_estimate_spec"].items()}
    names = sums_specs(shape, dtype_bytes)
    specs = [parse_spec(s) for s in names] + list(served.values())
    full = bytes_per_token_per_layer(shape, "full", {}, dtype_bytes, seq_len)
    rows, seen = [], set()
    for row in estimate_rows(shape, specs, [seq_len], [batch], dtype_bytes):
        key = (row["backend"], json.dumps(row["params"], sort_keys=True))
        if key in seen:  # a served spec the defaults already gave (e.g. int8 at its default group size)
            continue
        seen.add(key)
        per = row["bytes_per_token_per_layer"]
        params = row["params"]
        k8v4 = row["backend"] == "int8" and params.get("key_bits", 8) == 8 and params.get("value_bits", 8) == 4
        served_as = [name for name, (backend, opts) in served.items()
                     if backend == row["backend"] and {**default_params(shape, backend), **opts} == params]
        rows.append({**row, "bytes_per_token": per * shape.num_layers, "vs_full": full / per if per else None,
                     "aka": "k8v4" if k8v4 else None, "served_as": served_as,
                     "price": served_price(served_as, info.get("kv_quality") or {})})
    max_positions = state.model_config.get("max_position_embeddings")
    return {"model": info["model_id"], "dtype": info["model_dtype"], "num_layers": shape.num_layers,
            "seq_len": seq_len, "batch": batch, "specs": names, "max_position_embeddings": max_positions,
            "max_total_tokens": info.get("max_total_tokens"),
            "warnings": context_warnings(seq_len, max_positions, info.get("max_total_tokens")), "rows": rows}
