"""Thread settings of the server, measured: how OpenMP's idle threads wait, and how many there are.

torch's intra-op threads (OpenMP, libgomp in torch's Linux wheels) wait between parallel regions. They can spin
(``OMP_WAIT_POLICY=ACTIVE``), spin a bounded number of times then sleep (``GOMP_SPINCOUNT``; libgomp's default,
with no variable set, is 300,000 spins: given here explicitly, as ``kvserve`` sets ``OMP_WAIT_POLICY=PASSIVE``
when neither variable is set), or sleep at once (``OMP_WAIT_POLICY=PASSIVE``). Each setting is run with each thread count (``TORCH_NUM_THREADS`` 1 up
to the CPUs this process may use), on a quiet machine and beside one process that keeps one core busy (a Python
busy loop started by this script), and measured over HTTP as a user sees it:

* single-stream TPOT: (tokens - 1) / (last token time - first token time) of one ``/generate_stream`` request,
  inverted (seconds per token), median of ``--repeats``;
* aggregate tokens/s of ``--streams`` concurrent streams (all tokens / wall time), best of ``--repeats``.

The report gives each setting's worst case: its slowest ratio to the best setting of the same measure and
condition (1.00 = the best), and each setting's busy TPOT over its quiet TPOT. The default should have the best
worst case. This is a benchmark, not a test: ``python -m bench.threads`` (see ``--help``); one server runs at a
time on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from bench.serving import REPO, _single, _stream_kvserve, concurrent, decode_rate, free_port, kvserve_env, running

WAITS = {  # setting → the variables it sets (every other OpenMP wait variable is removed)
    "spin": {"OMP_WAIT_POLICY": "ACTIVE"},
    "libgomp default": {"GOMP_SPINCOUNT": "300000"},  # its spin count when no variable is set (kvserve sets one)
    "bounded 10k": {"GOMP_SPINCOUNT": "10000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}


@contextmanager
def busy_core(on: bool):
    """One process spinning on one core while the block runs (``on``), else nothing."""
    if not on:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield
    finally:
        proc.kill()
        proc.wait()


def server_env(model: str, port: int, wait: dict[str, str], threads: int, streams: int,
               engine_process: bool) -> dict[str, str]:
    """The server's whole environment: this one's without OpenMP's thread variables, then the setting's."""
    return kvserve_env({"MODEL_ID": model, "PORT": str(port), "HOST": "127.0.0.1", "LOG_LEVEL": "warning",
                        "MAX_BATCH_SIZE": str(streams), "TORCH_NUM_THREADS": str(threads),
                        "ENGINE_PROCESS": str(engine_process).lower(), **wait})


def measure(model: str, wait: dict[str, str], threads: int, streams: int, tokens: int, repeats: int,
            busy: bool, engine_process: bool) -> dict:
    """One server with one setting: TPOT of one stream (median, s) and ``streams`` streams' tokens/s (best)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = server_env(model, port, wait, threads, streams, engine_process)
    with running([sys.executable, "-m", "server.cli", "serve"], env, url + "/health", inherit=False), busy_core(busy):
        asyncio.run(concurrent(lambda c: _stream_kvserve(c, url, 8), 1))  # warm-up
        tpot = statistics.median(1 / decode_rate(asyncio.run(_single(lambda c: _stream_kvserve(c, url, tokens))))
                                 for _ in range(repeats))
        agg = max(asyncio.run(concurrent(lambda c: _stream_kvserve(c, url, tokens), streams))["aggregate_tokens_per_s"]
                  for _ in range(repeats))
    return {"tpot_s": tpot, "aggregate_tokens_per_s": agg}


def worst_cases(rows: list[dict]) -> dict[str, dict]:
    """Per setting (wait, threads): its slowest ratio to the best of each measure and condition, and its busy TPOT
    over its quiet TPOT."""
    best = {}
    for r in rows:
        for measure, better in (("tpot_s", min), ("aggregate_tokens_per_s", max)):
            key = (measure, r["busy"])
            best[key] = better(best.get(key, r[measure]), r[measure])
    out: dict[str, dict] = {}
    for r in rows:
        name = f"{r['wait']}, {r['threads']} thread{'s' if r['threads'] > 1 else ''}"
        o = out.setdefault(name, {"wait": r["wait"], "threads": r["threads"], "worst_ratio": 1.0})
        ratios = [r["tpot_s"] / best[("tpot_s", r["busy"])],
                  best[("aggregate_tokens_per_s", r["busy"])] / r["aggregate_tokens_per_s"]]
        o["worst_ratio"] = max(o["worst_ratio"], *ratios)
        o["busy" if r["busy"] else "quiet"] = r
    for o in out.values():
        if "busy" in o and "quiet" in o:
            o["busy_over_quiet_tpot"] = o["busy"]["tpot_s"] / o["quiet"]["tpot_s"]
    return out


def markdown(report: dict) -> str:
    """The docs' table: one row per setting, best worst case first."""
    lines = ["| setting | TPOT quiet / busy ms | busy / quiet TPOT | tokens/s of "
             f"{report['streams']} streams quiet / busy | worst ratio to the best |", "|---|---|---|---|---|"]
    for name, o in sorted(report["settings"].items(), key=lambda kv: kv[1]["worst_ratio"]):
        q, b = o.get("quiet"), o.get("busy")
        tp = " / ".join(f"{x['tpot_s'] * 1000:.1f}" if x else "-" for x in (q, b))
        ag = " / ".join(f"{x['aggregate_tokens_per_s']:.0f}" if x else "-" for x in (q, b))
        ratio = f"{o['busy_over_quiet_tpot']:.2f}x" if "busy_over_quiet_tpot" in o else "-"
        lines.append(f"| {name} | {tp} | {ratio} | {ag} | {o['worst_ratio']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.threads",
                                description="the server's OpenMP wait policy and thread count, quiet and beside a "
                                            "busy core")
    p.add_argument("--model", default=str(REPO / "models" / "kjv-llama-mha"))
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--streams", type=int, default=16, help="concurrent streams of the aggregate measure")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--waits", nargs="+", default=list(WAITS), choices=list(WAITS))
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="TORCH_NUM_THREADS values (default: 1 up to the CPUs this process may use)")
    p.add_argument("--engine-process", choices=["false", "true"], default="true",
                   help="the servers' ENGINE_PROCESS (default true: the engine core's threads alone in their process)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "threads.json"))
    args = p.parse_args()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = args.threads or list(range(1, cpus + 1))
    rows = []
    for busy in (False, True):
        for wait in args.waits:
            for n in threads:
                t = time.perf_counter()
                r = {"wait": wait, "threads": n, "busy": busy,
                     **measure(args.model, WAITS[wait], n, args.streams, args.tokens, args.repeats, busy,
                                args.engine_process == "true")}
                rows.append(r)
                print(json.dumps(r), f"({time.perf_counter() - t:.0f} s)", flush=True)
    report = {"model": args.model, "engine_process": args.engine_process == "true", "cpus": cpus, "streams": args.streams, "tokens": args.tokens,
              "repeats": args.repeats, "rows": rows, "settings": worst_cases(rows)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
