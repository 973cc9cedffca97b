"""Load test: many concurrent streaming clients against a kvserve started here on 127.0.0.1.

Bounded in count and time: ``--clients`` concurrent clients each send ``--requests-per-client``
requests (short and long prompts mixed; every ``--disconnect-every``-th request disconnects after a
few tokens), with a hard ``--deadline``. Reports errors (target 0), p50/p95 TTFT and TPOT (client
side: TTFT = request sent → first token event; TPOT = (last − first token time) / (tokens − 1)), the
server's resident memory before and after (target: back to baseline within 5%), and that the KV gauge
returns to 0. Not a test (it runs for minutes): ``python -m bench.load_test``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from bench.serving import REPO, free_port, running

SHORT = "And God said"
LONG = ("And it came to pass in the days of Ahasuerus, which reigned from India even unto Ethiopia, over an "
        "hundred and seven and twenty provinces, that in those days, when the king Ahasuerus sat on the throne "
        "of his kingdom, which was in Shushan the palace, in the third year of his reign, he made a feast")


def rss_bytes(pid: int) -> int:
    """Resident bytes of process ``pid`` and of its children (the engine core process, which holds the KV pool)."""
    from bench.decode_memory import status
    from bench.serving import child_pids

    return sum(status(p)["VmRSS"] for p in [pid, *child_pids(pid)])


def server_pid(port: int) -> int:
    """The pid listening on ``port`` (the kvserve child), found through /proc."""
    import os

    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if int(parts[1].split(":")[1], 16) == port and parts[3] == "0A":
                inode = parts[9]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return int(pid)
        except OSError:
            continue
    raise RuntimeError("server pid not found")


async def one(client, url, i, args) -> dict:
    long = i % 2 == 1
    disconnect = args.disconnect_every and i % args.disconnect_every == 0
    body = {"inputs": LONG if long else SHORT, "parameters": {"max_new_tokens": args.tokens}}
    t0 = time.perf_counter()
    times = []
    try:
        async with client.stream("POST", url + "/generate_stream", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    if "error" in json.loads(line[5:]):
                        return {"error": line}
                    times.append(time.perf_counter())
                    if disconnect and len(times) >= 3:
                        break
    except httpx.HTTPError as exc:
        return {"error": repr(exc)}
    return {"start": t0, "times": times, "disconnected": bool(disconnect)}


async def client_loop(url, cid, args, results):
    async with httpx.AsyncClient(timeout=args.deadline) as client:
        for k in range(args.requests_per_client):
            results.append(await one(client, url, cid * args.requests_per_client + k, args))


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.load_test", description="kvserve load test on 127.0.0.1")
    p.add_argument("--model", default=str(REPO / "models" / "kjv-llama-mha"))
    p.add_argument("--backend", default="full")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--disconnect-every", type=int, default=5)
    p.add_argument("--deadline", type=float, default=600.0, help="seconds before the run is abandoned")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "load_test.json"))
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"MODEL_ID": args.model, "PORT": str(port), "HOST": "127.0.0.1", "LOG_LEVEL": "warning",
           "KV_BACKEND": args.backend, "MAX_BATCH_SIZE": "16", "MAX_CONCURRENT_REQUESTS": str(args.clients * 2)}
    with running([sys.executable, "-m", "server.cli", "serve"], env, url + "/health"):
        pid = server_pid(port)
        httpx.post(url + "/generate", json={"inputs": SHORT, "parameters": {"max_new_tokens": 8}}, timeout=60)
        before = rss_bytes(pid)
        results: list[dict] = []
        t0 = time.perf_counter()

        async def run_all():
            await asyncio.wait_for(asyncio.gather(*[client_loop(url, c, args, results) for c in range(args.clients)]),
                                   args.deadline)

        asyncio.run(run_all())
        wall = time.perf_counter() - t0
        time.sleep(2.0)
        after = rss_bytes(pid)
        metrics = httpx.get(url + "/metrics", timeout=10).text
    kv_line = [ln for ln in metrics.splitlines() if ln.startswith("kvserve_kv_cache_bytes{")]
    ok = [r for r in results if "error" not in r and r["times"]]
    ttft = [r["times"][0] - r["start"] for r in ok]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in ok
            if len(r["times"]) > 1 and not r["disconnected"]]
    report = {"clients": args.clients, "requests": len(results), "errors": len(results) - len(ok),
              "disconnected_early": sum(r.get("disconnected", False) for r in ok), "wall_s": wall,
              "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95), "tpot_p50_s": pct(tpot, 0.5),
              "tpot_p95_s": pct(tpot, 0.95), "tokens": sum(len(r["times"]) for r in ok),
              "rss_before_bytes": before, "rss_after_bytes": after, "rss_change_pct": 100 * (after / before - 1),
              "kv_cache_bytes_after": kv_line, "error_samples": [r["error"] for r in results if "error" in r][:5]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
