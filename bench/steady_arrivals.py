"""Fairness under steady arrivals: short requests keep their TTFT while long prompts keep arriving.

Starts kvserve on 127.0.0.1, measures the time to first token of ``--short-tokens``-token prompts alone, then for
``--duration`` seconds sends a short request every ``--short-every`` seconds and a long one (``--long-tokens``
prompt tokens) every ``--long-every`` seconds, each on its own thread at its planned time (open loop: a slow
server does not slow the arrivals), and reports each kind's TTFT (p50, p95, max) beside the short ones' alone.
What it checks is chunked prefill's fair share (docs/decode-path.md, "Chunked prefill in mixed batches"): a
short prompt admitted behind long ones is written in its first step, so its TTFT stays a few decode steps,
whatever the long prompts' length. Bounded: every request has a ``--timeout``, after which its TTFT is reported
as missing. Not a test: ``python -m bench.steady_arrivals``.

    python -m bench.steady_arrivals --model models/smollm2-135m-instruct --long-tokens 5900 --duration 120
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.serving import REPO, free_port, running

_seeds = itertools.count(1)
MOST_SECONDS = 86400.0
"""The longest period, run or wait the command takes (seconds): a bounded benchmark."""
MOST_TOKENS = 1 << 20
"""The longest prompt it sends (tokens)."""


def first_token_seconds(url: str, prompt_tokens: int, timeout: float) -> float | str | None:
    """Seconds from sending a streamed ``/v1/completions`` request of ``prompt_tokens`` token ids (random, a
    fresh seed each: no two prompts share a prefix-cache block) to its first token; ``None`` past ``timeout``;
    the server's error (status and body) when it refused the request."""
    rng = random.Random(next(_seeds))
    body = {"prompt": [rng.randrange(100, 1000) for _ in range(prompt_tokens)], "max_tokens": 4, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return f"{r.status_code} {r.read().decode(errors='replace')[:300]}"
            for line in r.iter_lines():
                if line.startswith("data:"):
                    return time.perf_counter() - start
                if time.perf_counter() - start > timeout:
                    return None
    except httpx.HTTPError:
        return None
    return None


def summary(times: list[float | str | None]) -> dict:
    """p50, p95 and max of the TTFTs that arrived (seconds), how many did not within the timeout, and the
    errors of those the server refused."""
    got = sorted(t for t in times if isinstance(t, float))
    errors = sorted({t for t in times if isinstance(t, str)})
    if not got:
        return {"n": len(times), "missing": len(times), "errors": errors}
    p95 = got[min(len(got) - 1, round(0.95 * (len(got) - 1)))]
    return {"n": len(times), "missing": len(times) - len(got), "p50_s": round(statistics.median(got), 3),
            "p95_s": round(p95, 3), "max_s": round(got[-1], 3), **({"errors": errors} if errors else {})}


def arrivals(duration: float, short_every: float, long_every: float) -> list[tuple[float, str]]:
    """``(seconds after the start, "short" | "long")`` of every request, in time order: the first long prompt at
    0, the first short one half a period later."""
    plan = [(i * long_every, "long") for i in range(int(duration // long_every) + 1) if i * long_every < duration]
    plan += [(short_every / 2 + i * short_every, "short") for i in range(int(duration // short_every) + 1)
             if short_every / 2 + i * short_every < duration]
    return sorted(plan)


def run_plan(url: str, plan: list[tuple[float, str]], tokens: dict[str, int], timeout: float) -> dict[str, list]:
    """Send ``plan``'s requests at their times, each on its own thread; each kind's TTFTs (``None``: timed out)."""
    out: dict[str, list] = {"short": [], "long": []}
    lock = threading.Lock()

    def one(kind: str) -> None:
        t = first_token_seconds(url, tokens[kind], timeout)
        with lock:
            out[kind].append(t)

    start, threads = time.perf_counter(), []
    for at, kind in plan:
        time.sleep(max(0.0, start + at - time.perf_counter()))
        th = threading.Thread(target=one, args=(kind,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout + 5)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.steady_arrivals", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "kjv-llama-mha"))
    ap.add_argument("--short-tokens", type=int, default=32, help="prompt tokens of a short request")
    ap.add_argument("--long-tokens", type=int, default=900, help="prompt tokens of a long request")
    ap.add_argument("--short-every", type=float, default=1.0, help="seconds between short requests")
    ap.add_argument("--long-every", type=float, default=10.0, help="seconds between long requests")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--alone", type=int, default=5, help="short requests timed alone first")
    ap.add_argument("--timeout", type=float, default=300.0, help="most seconds waited for a first token")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    times = (args.short_every, args.long_every, args.duration, args.timeout)
    if not all(math.isfinite(t) and 0 < t <= MOST_SECONDS for t in times) or not 1 <= args.alone <= 1000:
        ap.error(f"--short-every, --long-every, --duration and --timeout must be > 0 and <= {MOST_SECONDS:g} "
                 f"seconds, --alone in [1, 1000]")
    if not all(1 <= n <= MOST_TOKENS for n in (args.short_tokens, args.long_tokens)):
        ap.error(f"--short-tokens and --long-tokens must be in [1, {MOST_TOKENS}]")
    if not Path(args.model).is_dir():
        ap.error(f"--model {args.model}: no such model folder")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        ap.error(f"--out {args.out}: its folder does not exist")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"MODEL_ID": args.model, "PORT": str(port), "HOST": "127.0.0.1"}
    plan = arrivals(args.duration, args.short_every, args.long_every)
    tokens = {"short": args.short_tokens, "long": args.long_tokens}
    with running([str(REPO / ".venv" / "bin" / "kvserve"), "serve"], env, url + "/health", timeout=900):
        first_token_seconds(url, args.short_tokens, args.timeout)  # warm-up
        alone = [first_token_seconds(url, args.short_tokens, args.timeout) for _ in range(args.alone)]
        got = run_plan(url, plan, tokens, args.timeout)
    result = {"short_alone": summary(alone), "short_under_arrivals": summary(got["short"]),
              "long_under_arrivals": summary(got["long"]),
              **{k: v for k, v in vars(args).items() if k != "out"}}
    a, b = result["short_alone"], result["short_under_arrivals"]
    if "p50_s" in a and "p95_s" in b:
        result["short_p95_vs_alone_p50"] = round(b["p95_s"] / a["p50_s"], 2)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if not b.get("missing") and not result["long_under_arrivals"].get("missing") else 1


if __name__ == "__main__":
    sys.exit(main())
