"""``kvserve advise``: which KV backends fit a workload, ranked by measured quality loss and TPOT.

Input: the workload (``--context`` tokens per sequence, ``--concurrency`` sequences, ``--memory-budget``
for the KV cache, optional ``--tpot-target`` seconds) and a ``kvserve bench`` results JSON. Without a
bench JSON it uses the estimator alone for a model config or preset: memory only, with each setting's price from
the quality budget where the calibration cache holds one for a model folder (:mod:`server.cached_prices`), else
"not priced".

A setting fits when bytes/token (measured by the bench at 1024 tokens, or the closed formula) ×
context × concurrency is within the budget. A measured setting is within the quality bound when its
held-out perplexity rises by at most ``--max-ppl-increase`` percent (default 1) and its greedy agreement
with ``full`` is at least ``--min-agreement`` (default 0.9; ``off``: no agreement bound); an unmeasured one is outside it when its price is
above ``--max-ppl-increase`` or the price's top-1 agreement with ``full`` (the quality budget's second figure,
``KV_QUALITY_MIN_AGREEMENT``'s) is below ``--min-agreement``. Fitting settings are ranked: those over the
latency target after the others, and within each, those outside the quality bound after those within it;
then by held-out perplexity change, then by TPOT at the nearest measured context. Each line says why, with the perplexity change and the agreement.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from cache_backends.estimate import DTYPE_BYTES, estimate_rows
from cache_backends import catalog
from cache_backends.spec import echo_recorded, format_spec
from server.cached_prices import dtype_note, load_prices, price_text
from server.estimate_cli import DEFAULT_SPECS as ESTIMATE_SPECS
from server.estimate_cli import human, load_shape, over_positions, resolve_specs

UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """'24GiB', '512M', '1e9' → bytes (argparse type).

    Raises:
        argparse.ArgumentTypeError: for anything else, or a size below 1 byte.
    """
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = UNITS.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if t[-1:] in UNITS else t) * scale)
    except (ValueError, OverflowError):  # not a number; inf
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a size such as 24GiB, 512MiB or 1e9 (bytes), got {text!r}")
    return n


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not 0 < value < float("inf"):  # nan and inf too (nan compared false with every TPOT: no target at all)
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value

    return parse


def _at_least_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _agreement_bound(text: str) -> float | None:
    """A share above 0 and at most 1, or ``off`` (``none``): no agreement bound, as ``KV_QUALITY_MIN_AGREEMENT``
    takes it (argparse type)."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share above 0 and at most 1, or off (no agreement bound), "
                                         f"got {text!r}")
    return value


def why(backend: str, context: int, concurrency: int, share: float, long_context: bool) -> str:
    """The one-line reason a kind of backend suits (or does not suit) this workload."""
    parts = backend.split("+")
    decls = [catalog.get(p) for p in parts]
    if len(parts) > 1 and any(d is not None and d.quantization for d in decls[1:]) and decls[0].calibrates:
        return "two savings stacked: the smallest cache when memory is the binding constraint"
    decl = decls[0]
    if decl is None:
        return ""
    if decl.summary_busy and concurrency >= 8 and not long_context:
        return decl.summary_busy
    return (decl.summary_long or decl.summary) if long_context else decl.summary


def rows_from_bench(path: str) -> list[dict]:
    """Rows of a ``kvserve bench`` results.json.

    Raises:
        ValueError: one line naming the file and what is wrong: not UTF-8 JSON, or not a bench result (the field
            that is missing or of the wrong kind); OSError if it cannot be read.
    """
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"--bench {path}: not a results.json written by kvserve bench (byte {exc.start} is not "
                         "UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--bench {path}: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise ValueError(f"--bench {path}: not a results.json written by kvserve bench (JSON nested too deeply)") \
            from None
    try:
        return _rows_from_bench(data)
    except ValueError as exc:
        raise ValueError(f"--bench {path}: not a results.json written by kvserve bench ({exc})") from None


def bench_model(path: str) -> str:
    """The model a ``kvserve bench`` results.json was measured on (its ``model`` field: a folder by its name, a hub
    id whole; read after :func:`rows_from_bench` accepted the file)."""
    model = str(json.loads(Path(path).read_text()).get("model", "an unnamed model"))
    folder = Path(model)
    return folder.name if folder.is_absolute() or folder.exists() else model  # a folder by its name; a hub id whole


def _rows_from_bench(data) -> list[dict]:
    """The rows advise reads from a parsed results.json.

    Raises:
        ValueError: naming the first field that is missing or of the wrong kind.
    """
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not data["rows"]:
        raise ValueError("no list of rows")
    rows = []
    for i, r in enumerate(data["rows"]):
        if not isinstance(r, dict):
            raise ValueError(f"rows[{i}] is not an object")
        for key in ("spec", "backend"):
            if not isinstance(r.get(key), str):
                raise ValueError(f"rows[{i}].{key} is missing or not text")
        tpot = r.get("tpot_s")
        if not isinstance(tpot, dict) or not all(k.isdigit() for k in tpot):
            raise ValueError(f"rows[{i}].tpot_s is missing or not seconds by context length")
        rows.append({"spec": echo_recorded(r["spec"]), "backend": r["backend"],
                     "bytes_per_token": _bench_number(r, "bytes_per_token", i, low=0, open_low=True),
                     "ppl_change_pct": _bench_number(r, "perplexity_change_pct", i, low=-100),
                     "tpot": {int(k): _bench_number(tpot, k, i, low=0, where="tpot_s") for k in tpot},
                     "agreement": _bench_number(r, "greedy_agreement", i, low=0, high=1)})
    return rows


def _bench_number(r: dict, key: str, i: int, low: float, high: float = float("inf"), open_low: bool = False,
                  where: str = "") -> float:
    """``r[key]``, a finite number from ``low`` (above it when ``open_low``) to ``high``, of row ``i``.

    Raises:
        ValueError: naming the field.
    """
    value = r.get(key)
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or value < low or value > high or (open_low and value == low):
        bounds = (f"above {low:g}" if open_low else f"from {low:g} to {high:g}" if high < float("inf")
                  else f"of at least {low:g}")
        raise ValueError(f"rows[{i}].{where + '.' if where else ''}{key} is "
                         f"{'missing' if key not in r else json.dumps(value)}: expected a number {bounds}")
    return float(value)


def rows_from_estimate(model: str, dtype: str, context: int, specs: list[str] | None) -> list[dict]:
    """Rows from the closed-form sums (no measured quality or speed; ``price_pct``, ``price_agreement`` and
    ``price_dtype``, the quality budget's price, top-1 agreement and the dtype they were measured in from the
    calibration cache, or ``None``; ``dtype``, the one sized); without ``specs``, estimate's default list.

    Raises:
        ValueError: for an unknown model, a malformed spec or one the model cannot take, or a ``context``
            longer than the model holds (its ``max_position_embeddings``): no setting serves that workload.
    """
    shape = load_shape(model)
    if over_positions(shape, [context]):
        raise ValueError(f"--context {context} is more than {model}'s {shape.max_positions} positions "
                         "(max_position_embeddings): the model cannot hold that context")
    parsed = resolve_specs(shape, specs, DTYPE_BYTES[dtype], block_flag=None)  # advise has no --block-size
    sums = estimate_rows(shape, parsed, [context], [1], DTYPE_BYTES[dtype])
    book = load_prices(model)
    # elastic fits where its fully compressed size does (its least; it is exact while the budget allows more)
    return [{"spec": format_spec(name, params), "backend": name,
             "bytes_per_token": row.get("min_bytes_per_token_per_layer", row["bytes_per_token_per_layer"])
             * shape.num_layers, "ppl_change_pct": None, "tpot": {}, "agreement": None,
             **dict(zip(("price_pct", "price_agreement", "price_dtype"),
                        book.priced(row["backend"], row["params"], dtype))), "dtype": dtype}
            for (name, params), row in zip(parsed, sums)]


MAX_PPL_INCREASE = 1.0  # percent: the quality bound's perplexity part (the int8 gate of the tests)
MIN_AGREEMENT = 0.9  # the quality bound's greedy-agreement part (fraction of greedy tokens equal to full's)


def advise(rows: list[dict], context: int, concurrency: int, budget: int, tpot_target: float | None,
           max_ppl_increase: float = MAX_PPL_INCREASE, min_agreement: float | None = MIN_AGREEMENT) -> list[dict]:
    """Annotate and rank ``rows``; returns every row with ``fits``, ``need_bytes``, ``quality_ok``, ``rank_key``
    and ``reason``.

    ``quality_ok`` is False for a measured row whose perplexity change (percent) is above ``max_ppl_increase``
    or whose greedy agreement (0-1) is below ``min_agreement``, and for an unmeasured one whose price
    (``price_pct``, the quality budget's) is above ``max_ppl_increase`` or whose price's top-1 agreement
    (``price_agreement``, 0-1) is below ``min_agreement``; unmeasured and unpriced quality is not held against a
    row (``min_agreement`` ``None``: no agreement bound). Fitting rows come first, ranked by (over ``tpot_target`` seconds, outside the quality bound,
    perplexity change, TPOT); the others follow by the bytes they need.
    """
    long_context = context >= 4096
    out = []
    for r in rows:
        need = r["bytes_per_token"] * context * concurrency
        tpot = None
        if r["tpot"]:
            nearest = min(r["tpot"], key=lambda c: abs(c - context))
            tpot = r["tpot"][nearest]
        slow = tpot_target is not None and tpot is not None and tpot > tpot_target
        quality = r["ppl_change_pct"] if r["ppl_change_pct"] is not None else 0.0
        agreement = r.get("agreement")
        ppl_over = r["ppl_change_pct"] is not None and r["ppl_change_pct"] > max_ppl_increase
        agreement_under = agreement is not None and min_agreement is not None and agreement < min_agreement
        price = r.get("price_pct") if r["ppl_change_pct"] is None else None  # measured quality stands in for it
        price_over = price is not None and price > max_ppl_increase
        top1 = r.get("price_agreement") if price is not None else None
        top1_under = top1 is not None and min_agreement is not None and top1 < min_agreement
        reason = why(r["backend"], context, concurrency, need / budget, long_context)
        facts = [f"{human(need)} for {concurrency} x {context} tokens ({100 * need / budget:.0f}% of budget)"]
        if r["ppl_change_pct"] is not None:
            facts.append(f"perplexity {r['ppl_change_pct']:+.2f}%"
                         + (f" (over the bound, +{max_ppl_increase:g}%)" if ppl_over else ""))
        else:
            facts.append(f"price {price_text(price)} perplexity{dtype_note(r.get('price_dtype'), r.get('dtype'))}"
                         if price is not None else price_text(None))
            facts[-1] += f" (over the bound, +{max_ppl_increase:g}%)" if price_over else ""
            if top1 is not None:
                facts[-1] += (f", top-1 agreement {top1:.3f}"
                              + (f" (under the bound, {min_agreement:g})" if top1_under else ""))
        if agreement is not None:
            facts.append(f"greedy agreement {agreement:.3f}"
                         + (f" (under the bound, {min_agreement:g})" if agreement_under else ""))
        if tpot is not None:
            facts.append(f"TPOT {1000 * tpot:.1f} ms" + (" (over target)" if slow else ""))
        outside = ppl_over or agreement_under or price_over or top1_under
        out.append({**r, "need_bytes": need, "fits": need <= budget, "slow": slow, "tpot_at_context": tpot,
                    "quality_ok": not outside,
                    "rank_key": (slow, outside, quality if r["ppl_change_pct"] is not None else -r["bytes_per_token"],
                                 tpot or 0.0),
                    "reason": f"{reason}; " + ", ".join(facts)})
    fitting = sorted((r for r in out if r["fits"]), key=lambda r: r["rank_key"])
    return fitting + sorted((r for r in out if not r["fits"]), key=lambda r: r["need_bytes"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", type=_positive(int), required=True, help="tokens per sequence (prompt + output)")
    p.add_argument("--concurrency", type=_positive(int), default=1, help="sequences held at once")
    p.add_argument("--memory-budget", type=parse_bytes, required=True, help="KV-cache budget, e.g. 24GiB or 512MiB")
    p.add_argument("--tpot-target", type=_positive(float), default=None, help="latency target: TPOT in seconds")
    p.add_argument("--max-ppl-increase", type=_at_least_zero, default=MAX_PPL_INCREASE, metavar="PCT",
                   help="quality bound: most held-out perplexity increase, percent; settings above it are ranked "
                        f"after those within and marked (default {MAX_PPL_INCREASE:g})")
    p.add_argument("--min-agreement", type=_agreement_bound, default=MIN_AGREEMENT, metavar="FRACTION",
                   help="quality bound: least greedy agreement with full, above 0 and at most 1, or off (without "
                        "--bench: the quality budget's top-1 agreement from the calibration cache); settings below it "
                        f"are ranked after those within and marked (default {MIN_AGREEMENT:g})")
    p.add_argument("--bench", help="results.json written by `kvserve bench` (measured quality and speed)")
    p.add_argument("--model", default=None, help="without --bench: preset, config.json or model folder "
                                                 "(default llama-2-7b)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPE_BYTES), help="without --bench (default fp16)")
    p.add_argument("--backends", nargs="+", default=None,
                   help=f"without --bench: specs to consider (default: {' '.join(ESTIMATE_SPECS)})")
    p.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    model, dtype = args.model or "llama-2-7b", args.dtype or "fp16"
    try:
        if args.bench:
            given = [f"--{k}" for k in ("model", "dtype", "backends") if getattr(args, k) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} only without --bench "
                                 "(the bench file fixes the model and settings)")
            rows = rows_from_bench(args.bench)
        else:
            rows = rows_from_estimate(model, dtype, args.context, args.backends)
    except OSError as exc:
        print(f"kvserve advise: --bench {args.bench}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"kvserve advise: {exc}", file=sys.stderr)
        return 2
    ranked = advise(rows, args.context, args.concurrency, args.memory_budget, args.tpot_target,
                    args.max_ppl_increase, args.min_agreement)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "rank_key"} for r in ranked], indent=2))
        return 0
    priced = any(r.get("price_pct") is not None for r in rows)
    source = (f"measured by {args.bench} on {bench_model(args.bench)}" if args.bench
              else f"estimated for {model} ({dtype}), quality "
                   + ("priced from the calibration cache where it holds a price" if priced else "unmeasured"))
    print(f"Workload: {args.concurrency} x {args.context} tokens, KV budget {human(args.memory_budget)}"
          + (f", TPOT target {1000 * args.tpot_target:.0f} ms" if args.tpot_target else "") + f" — {source}")
    if args.bench:
        agreement = ("no agreement bound" if args.min_agreement is None
                     else f"greedy agreement at least {args.min_agreement:g}")
        print(f"Quality bound: perplexity at most +{args.max_ppl_increase:g}%, {agreement} (settings outside it come "
              "after those within, marked \"outside the quality bound\")")
    n = 0
    for r in ranked:
        if r["fits"]:
            n += 1
            mark = "" if r["quality_ok"] else " (outside the quality bound)"
            print(f"{n:>2}. {r['spec']}{mark}: {r['reason']}")
    if n == 0:
        print("Nothing fits the budget.")
    elif args.bench and not any(r["quality_ok"] for r in ranked if r["fits"]):
        print("Nothing that fits is within the quality bound: a larger budget, fewer or shorter sequences, or "
              "looser --max-ppl-increase / --min-agreement.")
    for r in ranked:
        if not r["fits"]:
            print(f"  - {r['spec']} does not fit: {r['reason']}")
    return 0
