"""``/health`` while large request bodies are parsed: the event loop must stay free for it.

Starts kvserve on 127.0.0.1, times ``/health`` idle, then sends ``--bodies`` large ``/v1/completions`` bodies at
once (``--prompts`` prompts of ``--ids`` token ids each: 64 x 7,420 ids is about 1.9 MB of JSON) ``--rounds``
times, polling ``/health`` every ``--every`` seconds meanwhile, and reports its latency (p50, p99, max) idle and
under the bodies. The bodies are parsed and validated off the event loop (:mod:`server.api.threaded_body`);
``--max-tokens`` is chosen so that the server refuses each prompt with a 400 once it has parsed and validated
the body (prompt + ``max_tokens`` over the model's context), so the engine runs nothing. The model must take
``--prompts`` x ``--ids`` values in one body (the reference model's limit is lower: SmolLM2 takes it). Bounded: ``--rounds`` rounds, each request with a timeout. Not a test:
``python -m bench.health_under_bodies``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.serving import REPO, free_port, running

MOST_IDS = 4_000_000
"""The most token ids one body carries (about 16 MB of JSON): the server refuses larger bodies anyway."""


def latencies(url: str, stop: threading.Event, every: float) -> list[float]:
    """``/health`` round trips (seconds) every ``every`` seconds until ``stop`` is set."""
    out = []
    with httpx.Client(timeout=30) as c:
        while not stop.is_set():
            t = time.perf_counter()
            c.get(url + "/health")
            out.append(time.perf_counter() - t)
            stop.wait(every)
    return out


def stats(xs: list[float]) -> dict:
    """p50, p99 and max of ``xs`` in milliseconds."""
    xs = sorted(xs)
    return {"n": len(xs), "p50_ms": round(1000 * statistics.median(xs), 1),
            "p99_ms": round(1000 * xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))], 1),
            "max_ms": round(1000 * xs[-1], 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.health_under_bodies", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--bodies", type=int, default=3, help="large bodies sent at once")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per body")
    ap.add_argument("--ids", type=int, default=7420, help="token ids per prompt")
    ap.add_argument("--max-tokens", type=int, default=4000, help="max_tokens of each body (see above)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--every", type=float, default=0.01, help="seconds between /health probes")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    if not (1 <= args.bodies <= 64 and 1 <= args.rounds <= 10000 and 1 <= args.prompts and 1 <= args.ids
            and args.prompts * args.ids <= MOST_IDS):
        ap.error(f"--bodies must be in [1, 64], --rounds in [1, 10000], --prompts and --ids >= 1 with "
                 f"--prompts x --ids <= {MOST_IDS}")
    if not (math.isfinite(args.every) and 0 < args.every <= 60) or args.max_tokens < 1:
        ap.error("--every must be in (0, 60] seconds, --max-tokens >= 1")
    if not Path(args.model).is_dir():
        ap.error(f"--model {args.model}: no such model folder")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        ap.error(f"--out {args.out}: its folder does not exist")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"MODEL_ID": args.model, "PORT": str(port), "HOST": "127.0.0.1"}
    body = json.dumps({"prompt": [[(7 * i + j) % 1000 + 10 for j in range(args.ids)] for i in range(args.prompts)],
                       "max_tokens": args.max_tokens}, separators=(",", ":")).encode()
    answers: set[str] = set()

    def send() -> None:
        r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=120)
        answers.add(f"{r.status_code} {r.text[:160]}")

    with running([str(REPO / ".venv" / "bin" / "kvserve"), "serve"], env, url + "/health", timeout=600):
        stop = threading.Event()
        threading.Timer(2.0, stop.set).start()
        idle = latencies(url, stop, args.every)
        loaded: list[float] = []
        for _ in range(args.rounds):
            stop = threading.Event()
            senders = [threading.Thread(target=send) for _ in range(args.bodies)]
            probe = threading.Thread(target=lambda: loaded.extend(latencies(url, stop, args.every)))
            probe.start()
            for s in senders:
                s.start()
            for s in senders:
                s.join(150)
            stop.set()
            probe.join(40)
    result = {"health_idle": stats(idle), "health_under_bodies": stats(loaded), "body_bytes": len(body),
              "answers": sorted(answers), **{k: v for k, v in vars(args).items() if k != "out"}}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
