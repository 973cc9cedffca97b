"""Fair share under KV pressure: one wide request fills the KV pool, then a long prompt arrives; its TTFT.

Starts kvserve on 127.0.0.1 with a small pool (``--budget`` bytes of ``KV_CACHE_BUDGET_BYTES``), sends one
``/v1/completions`` request with ``n`` generations of ``--wide-tokens`` tokens each (``ignore_eos``), waits
``--delay`` seconds (the pool is full by then), then streams one ``/generate_stream`` request whose prompt is
``--prompt-tokens`` tokens (TGI's ``truncate`` cuts a long text to that) and reports the seconds to its first
token, alone and behind the wide request, and the preemptions counted. Bounded: every request has a timeout
(``--timeout``), after which its TTFT is reported as missing. Not a test: ``python -m bench.fair_share``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import httpx

from bench.serving import REPO, free_port, running

TEXT = "And God said, Let there be light: and there was light. " * 200


def first_token_seconds(url: str, prompt_tokens: int, timeout: float) -> float | None:
    """Seconds from sending a ``/generate_stream`` request to its first token event; ``None`` past ``timeout``."""
    body = {"inputs": TEXT, "parameters": {"max_new_tokens": 4, "truncate": prompt_tokens}}
    start = time.perf_counter()
    try:
        with httpx.stream("POST", url + "/generate_stream", json=body, timeout=timeout) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    return time.perf_counter() - start
                if time.perf_counter() - start > timeout:
                    return None
    except httpx.TimeoutException:
        return None
    return None


def send_wide(url: str, n: int, max_tokens: int) -> None:
    """The wide request (its answer is not read: the server stops before it ends)."""
    try:
        httpx.post(url + "/v1/completions", json={"prompt": "And", "n": n, "max_tokens": max_tokens,
                                                  "ignore_eos": True}, timeout=3600)
    except httpx.HTTPError:
        pass


def preemptions(url: str) -> float:
    """``kvserve_num_preemptions_total`` summed over backends."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvserve_num_preemptions_total"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fair_share", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "kjv-llama-mha"))
    ap.add_argument("--budget", type=int, default=33554432, help="KV_CACHE_BUDGET_BYTES")
    ap.add_argument("--n", type=int, default=16, help="generations of the wide request")
    ap.add_argument("--wide-tokens", type=int, default=1020, help="max_tokens of the wide request")
    ap.add_argument("--prompt-tokens", type=int, default=900, help="prompt of the later request")
    ap.add_argument("--delay", type=float, default=20.0, help="seconds between the two requests")
    ap.add_argument("--timeout", type=float, default=180.0, help="most seconds waited for the first token")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"MODEL_ID": args.model, "KV_CACHE_BUDGET_BYTES": str(args.budget), "PORT": str(port),
           "HOST": "127.0.0.1"}
    with running([str(REPO / ".venv" / "bin" / "kvserve"), "serve"], env, url + "/health", timeout=600):
        alone = first_token_seconds(url, args.prompt_tokens, args.timeout)
        threading.Thread(target=send_wide, args=(url, args.n, args.wide_tokens), daemon=True).start()
        time.sleep(args.delay)
        behind = first_token_seconds(url, args.prompt_tokens, args.timeout)
        result = {"ttft_alone_s": alone, "ttft_behind_wide_s": behind, "preemptions": preemptions(url),
                  "timeout_s": args.timeout, **{k: v for k, v in vars(args).items() if k != "out"}}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if behind is not None else 1


if __name__ == "__main__":
    sys.exit(main())
