"""A/B of two server settings, alternating, so that both see the same machine minute by minute.

Each round starts one server per setting (A then B, B then A in the next round, and so on) and measures, over HTTP:

* ``--measure streams``: the tokens/s of ``--streams`` concurrent streams of ``--tokens`` tokens (best of 3) and of
  one stream (best of 2);
* ``--measure long-prompts``: the inter-token latency of 8 running streams while 4 prompts of ~900 tokens arrive
  (as :mod:`bench.serving`'s part 4);
* ``--measure one-long``: one stream of a ``--prompt-tokens``-token prompt and ``--tokens`` greedy tokens
  (``ignore_eos``, OpenAI's completions route): its TTFT and TPOT.

A setting is a list of ``NAME=VALUE`` environment variables (e.g. ``ENGINE_PROCESS=true`` or
``TORCH_NUM_THREADS=2``); everything else is the server's default. ``--a-dir`` / ``--b-dir`` run a setting's
server from another checkout (``git worktree add /tmp/old <commit>``; the same Python environment): two commits'
code, side by side. This is a benchmark, not a test:
``python -m bench.ab_serving --a ENGINE_PROCESS=true --b ENGINE_PROCESS=false --rounds 3``;
``python -m bench.ab_serving --model models/smollm2-135m-instruct --a KV_BACKEND=full --b KV_BACKEND=full --b-dir
/tmp/old --measure one-long --prompt-tokens 7600 --tokens 32 --rounds 2``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from bench.serving import (REPO, _long_arrival, _stream_kvserve, concurrent, free_port, kvserve_env, long_prompts,
                           running)


def parse_setting(items: list[str]) -> dict[str, str]:
    """``["NAME=VALUE", ...]`` → ``{NAME: VALUE}``.

    Raises:
        SystemExit: an item without ``=``.
    """
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"a setting is NAME=VALUE, got {item!r}")
        out[name] = value
    return out


async def _one_long(url: str, prompt: str, tokens: int) -> dict:
    """One stream of ``prompt`` and ``tokens`` greedy tokens: its TTFT (s) and TPOT (ms, the mean gap after the
    first token)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    times = []
    async with httpx.AsyncClient(timeout=1800) as client:
        t0 = time.perf_counter()
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:") and line.strip() != "data: [DONE]":
                    if any(c.get("text") for c in json.loads(line[5:]).get("choices", [])):
                        times.append(time.perf_counter())
    return {"ttft_s": round(times[0] - t0, 3), "tpot_ms": round(1000 * (times[-1] - times[0]) / (len(times) - 1), 2),
            "tokens": len(times)}


def run_one(model: str, setting: dict[str, str], measure: str, streams: int, tokens: int, prompts: list[str],
            code: Path = REPO) -> dict:
    """One server with ``setting``, run from the checkout ``code``: the chosen measure's figures."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = kvserve_env({"MODEL_ID": model, "PORT": str(port), "HOST": "127.0.0.1", "LOG_LEVEL": "warning",
                       "MAX_BATCH_SIZE": str(max(streams, 16)), "PYTHONPATH": str(code),
                       **setting})  # long prompts: 8 running + 4 arriving
    with running([sys.executable, "-m", "server.cli", "serve"], env, url + "/health", inherit=False, cwd=code):
        asyncio.run(concurrent(lambda c: _stream_kvserve(c, url, 8), 1))  # warm-up
        if measure == "long-prompts":
            return asyncio.run(_long_arrival(url, prompts, 8, max(128, tokens)))
        if measure == "one-long":
            return asyncio.run(_one_long(url, prompts[0], tokens))
        many = max(asyncio.run(concurrent(lambda c: _stream_kvserve(c, url, tokens), streams))["aggregate_tokens_per_s"]
                   for _ in range(3))
        one = max(asyncio.run(concurrent(lambda c: _stream_kvserve(c, url, tokens), 1))["aggregate_tokens_per_s"]
                  for _ in range(2))
        return {f"{streams}_streams_tokens_per_s": many, "1_stream_tokens_per_s": one}


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.ab_serving", description="alternating A/B of two kvserve server settings")
    p.add_argument("--a", nargs="+", required=True, metavar="NAME=VALUE", help="setting A's environment variables")
    p.add_argument("--b", nargs="+", required=True, metavar="NAME=VALUE", help="setting B's environment variables")
    p.add_argument("--model", default=str(REPO / "models" / "kjv-llama-mha"))
    p.add_argument("--measure", choices=["streams", "long-prompts", "one-long"], default="streams")
    p.add_argument("--prompt-tokens", type=int, default=7600, help="one-long: the prompt's tokens")
    p.add_argument("--a-dir", type=Path, default=REPO, help="the checkout setting A's server runs from")
    p.add_argument("--b-dir", type=Path, default=REPO, help="the checkout setting B's server runs from")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "ab_serving.json"))
    args = p.parse_args()
    settings = {"a": parse_setting(args.a), "b": parse_setting(args.b)}
    if Path(args.model).exists():  # a local folder: the same for a server started in another checkout
        args.model = str(Path(args.model).resolve())
    prompts = long_prompts(args.model, 4, 900) if args.measure == "long-prompts" else []
    if args.measure == "one-long":
        prompts = long_prompts(args.model, 1, args.prompt_tokens)
    dirs = {"a": args.a_dir.resolve(), "b": args.b_dir.resolve()}
    rows = []
    for rnd in range(args.rounds):
        for name in ("a", "b") if rnd % 2 == 0 else ("b", "a"):
            r = {"round": rnd, "setting": name, **run_one(args.model, settings[name], args.measure, args.streams,
                                                          args.tokens, prompts, dirs[name])}
            rows.append(r)
            print(json.dumps({**r, "env": settings[name]}), flush=True)
    report = {"model": args.model, "measure": args.measure, "settings": settings,
              "dirs": {k: str(v) for k, v in dirs.items()}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
