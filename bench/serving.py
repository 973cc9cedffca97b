"""Serving benchmark: kvserve side by side with the peers a user would pick instead.

Two comparisons, in one run, on the same model, prompt and machine:

1. Single-stream decode tokens/s: kvserve (one ``/generate_stream`` request over HTTP, decode rate =
   (tokens - 1) / (last token time - first token time)) against transformers' ``model.generate()``
   in-process (decode rate = (N - 1) / (time for N tokens - time for 1 token), greedy, same prompt).
2. Aggregate streaming tokens/s and TTFT at several concurrencies: kvserve's ``/generate_stream``
   against ``transformers serve --continuous-batching`` (OpenAI ``/v1/completions`` streaming).
   Aggregate tokens/s = all tokens received / wall time from the first request sent to the last
   stream closed. TTFT = request sent → first token received, per stream.

3. Static batching: ``model.generate()`` on a batch of N copies of the prompt (the throughput a user gets
   by batching offline), aggregate tokens/s = N x tokens / wall time, best of ``--repeats``.
4. Inter-token latency of running streams while long prompts arrive: 8 streams decode, then 4 requests
   with ~900-token prompts arrive; ITL p50/p95 of the running streams from the first arrival to the end,
   with chunked prefill (``MAX_NUM_BATCHED_TOKENS``, default 256) and without (0: whole prompts).
5. Single-stream llama.cpp (``--gguf``, needs ``llama-cpp-python``): decode tokens/s on the same weights
   with f16 KV and with q8_0 KV + flash attention.
6. The engine alone: kvserve's engine in this process (no HTTP, no detokenization, stepped on the main thread),
   N sequences of the prompt, aggregate tokens/s = N x tokens / wall; and the server with its engine core in
   its own process (``ENGINE_PROCESS=true``, the default) beside the same core in a thread of the HTTP process
   (``false``; ``--engine-process``), so the cost of serving over HTTP, and what the separate process recovers of
   it, are visible.

Servers run one at a time on 127.0.0.1 (never both at once), so they do not share the CPU.
This is a benchmark, not a test: run it with ``python -m bench.serving`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
PROMPT = "And it came to pass, when the king heard the words of the book of the law, that he"


PREFILL_SETTINGS = {  # the long-prompt part's servers: whole prompts, chunks of 256 alone, and the default
    "whole-prompt prefill": {"MAX_NUM_BATCHED_TOKENS": "0"},
    "chunked prefill, 256 tokens/step": {"MAX_NUM_BATCHED_TOKENS": "256", "PREFILL_ITL_RATIO": "0"},
    "chunked prefill, 256 tokens/step, PREFILL_ITL_RATIO=2 (the default)": {},
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used, all its threads (Linux ``/proc``); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def child_pids(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux ``/proc``)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


class CpuMeter:
    """CPU seconds spent, between :meth:`start` and :meth:`stop`, by a server's process, by its children (the
    engine core process), and by this process (the benchmark's own HTTP client)."""

    def __init__(self, server_pid: int):
        self.pid = server_pid

    def _now(self) -> dict[str, float]:
        import resource

        me = resource.getrusage(resource.RUSAGE_SELF)
        return {"http_process_s": cpu_seconds(self.pid),
                "engine_core_process_s": sum(cpu_seconds(c) for c in child_pids(self.pid)),
                "client_s": me.ru_utime + me.ru_stime}

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> dict[str, float]:
        end = self._now()
        return {k: round(end[k] - self._start[k], 3) for k in end}


@contextmanager
def running(cmd: list[str], env: dict[str, str], health_url: str, timeout: float = 180, inherit: bool = True,
            cwd: Path = REPO):
    """Start a server process in ``cwd`` (its environment: this one's updated with ``env``, or with
    ``inherit=False`` ``env`` alone), wait for its health URL, yield the process, then stop it.

    Raises:
        RuntimeError: the process exited or was not healthy within ``timeout`` s (with the end of its stderr)."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env={**os.environ, **env} if inherit else env, cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=log)

    def tail() -> str:
        log.seek(0)
        return "\n".join(log.read().decode(errors="replace").splitlines()[-20:])

    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; its stderr ended:\n{tail()}")
            try:
                if httpx.get(health_url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"{cmd} not healthy after {timeout} s; its stderr ended:\n{tail()}")
            time.sleep(0.5)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def kvserve_env(env: dict[str, str]) -> dict[str, str]:
    """A kvserve server's whole environment: this one's without OpenMP's thread variables (the server takes its
    own wait policy, ``OMP_WAIT_POLICY=PASSIVE``, and its own thread count unless ``TORCH_NUM_THREADS`` is
    exported), then ``env``. The peers keep this process's
    (``make bench-serving`` gives them ``OMP_WAIT_POLICY=ACTIVE``: spinning threads, their best on a quiet CPU)."""
    keep = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    return {**keep, **env}


async def _stream_kvserve(client: httpx.AsyncClient, url: str, tokens: int, times: list | None = None,
                          prompt: str = PROMPT) -> dict:
    """Stream one request; ``times`` (token arrival times) fills as tokens arrive."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": tokens}}
    t0 = time.perf_counter()
    times = [] if times is None else times
    async with client.stream("POST", url + "/generate_stream", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                times.append(time.perf_counter())
    return {"start": t0, "times": times}


async def _stream_openai(client: httpx.AsyncClient, url: str, model: str, tokens: int) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    return {"start": t0, "times": times}


def summarize(results: list[dict]) -> dict:
    start = min(r["start"] for r in results)
    end = max(r["times"][-1] for r in results if r["times"])
    tokens = sum(len(r["times"]) for r in results)
    ttft = [r["times"][0] - r["start"] for r in results if r["times"]]
    return {"streams": len(results), "tokens": tokens, "wall_s": end - start,
            "aggregate_tokens_per_s": tokens / (end - start), "ttft_p50_s": statistics.median(ttft),
            "ttft_max_s": max(ttft)}


async def concurrent(fn, n: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        return summarize(await asyncio.gather(*[fn(client) for _ in range(n)]))


def decode_rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_generate(model_dir: str, tokens: int, repeats: int, device: str = "cpu") -> float:
    """transformers generate() on ``device`` (cpu or cuda): decode tokens/s (greedy), best of ``repeats``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_kernels=False).to(device).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids.to(device)

    def timed(n: int) -> float:
        _sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        _sync(device)
        assert out.shape[1] - ids.shape[1] == n
        return time.perf_counter() - t

    timed(4)  # warm-up
    best = 0.0
    for _ in range(repeats):
        best = max(best, (tokens - 1) / (timed(tokens) - timed(1)))
    return best


def bench_generate_static(model_dir: str, streams: int, tokens: int, repeats: int, device: str = "cpu") -> float:
    """transformers generate() on a static batch of ``streams`` copies of the prompt: aggregate tokens/s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_kernels=False).to(device).eval()
    ids = tok([PROMPT] * streams, return_tensors="pt").input_ids.to(device)
    best = 0.0
    for _ in range(repeats + (device == "cuda")):  # on CUDA the first run also warms up
        _sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                           pad_token_id=tok.eos_token_id)
        _sync(device)
        best = max(best, streams * tokens / (time.perf_counter() - t))
    return best


def bench_engine_alone(model_dir: str, streams: int, tokens: int, repeats: int, device: str = "cpu") -> float:
    """kvserve's engine in-process, ``full`` KV: aggregate tokens/s of ``streams`` greedy sequences of the prompt
    (``tokens`` each), best of ``repeats`` + 1 runs (the first also warms up)."""
    from bench.budget import make_backend, new_engine
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence
    from server.model_loading import load_model

    model, tok = load_model(model_dir, torch.device(device), torch.float32)
    backend = make_backend("full", model, tok)
    ids = tok(PROMPT).input_ids
    best = 0.0
    for _ in range(repeats + 1):
        engine = new_engine(model, tok, backend, streams, None)
        seqs = [Sequence(request_id=str(i), prompt_ids=list(ids), max_new_tokens=tokens, params=SamplingParams(),
                         stop=[], backend_name=backend.name) for i in range(streams)]
        t = time.perf_counter()
        for seq in seqs:
            engine.submit(seq)
        while engine.running or engine.waiting:
            engine.step()
        best = max(best, sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - t))
    return best


def long_prompts(model_dir: str, n: int, tokens: int) -> list[str]:
    """``n`` different ~``tokens``-token texts from the model's held-out slice."""
    from transformers import AutoTokenizer

    from bench.quality import EVAL_SLICE, model_slice_ids

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = model_slice_ids(Path(model_dir), EVAL_SLICE, tok)
    return [tok.decode(ids[i * tokens:(i + 1) * tokens]) for i in range(n)]


async def _long_arrival(url: str, prompts: list[str], running: int, tokens: int) -> dict:
    """``running`` streams decode ``tokens`` tokens; once each has 4 tokens, ``prompts`` arrive (8 new tokens
    each, streamed). Returns ITL p50/p95 (seconds) of the running streams' gaps that end after the first arrival, and
    the arriving prompts' TTFT (p50 and max, seconds)."""
    async with httpx.AsyncClient(timeout=600) as client:
        seen = [[] for _ in range(running)]
        streams = [asyncio.create_task(_stream_kvserve(client, url, tokens, times)) for times in seen]
        while min(len(t) for t in seen) < 4:
            await asyncio.sleep(0.01)
        arrival = time.perf_counter()
        long = [asyncio.create_task(_stream_kvserve(client, url, 8, prompt=p)) for p in prompts]
        results = await asyncio.gather(*streams)
        arrived = await asyncio.gather(*long)
    ttft = sorted(r["times"][0] - r["start"] for r in arrived if r["times"])
    if len(ttft) != len(prompts):
        raise RuntimeError("an arriving long prompt got no token")
    gaps = sorted(b - a for r in results for a, b in zip(r["times"], r["times"][1:]) if b > arrival)
    if not gaps:
        raise RuntimeError("no running-stream token after the long prompts arrived: raise --tokens")
    return {"itl_p50_s": statistics.median(gaps), "itl_p95_s": gaps[int(0.95 * (len(gaps) - 1))],
            "itl_p99_s": gaps[int(0.99 * (len(gaps) - 1))], "itl_max_s": gaps[-1], "gaps": len(gaps),
            "long_ttft_p50_s": statistics.median(ttft), "long_ttft_max_s": ttft[-1]}


def bench_llama_cpp(gguf: str, tokens: int, repeats: int) -> dict:
    """llama.cpp (llama-cpp-python) single-stream decode tokens/s on a GGUF of the same weights: f16 KV, and
    q8_0 KV with flash attention. Decode rate as kvserve's: (tokens - 1) / (last - first token time)."""
    import llama_cpp

    out = {}
    for name, kw in {"f16_kv": {}, "q8_0_kv_flash": {"type_k": llama_cpp.GGML_TYPE_Q8_0,
                                                      "type_v": llama_cpp.GGML_TYPE_Q8_0, "flash_attn": True}}.items():
        llm = llama_cpp.Llama(gguf, n_ctx=1024, n_threads=os.cpu_count() or 1, verbose=False, **kw)
        best = 0.0
        for _ in range(repeats):
            times = []
            for _chunk in llm.create_completion(PROMPT, max_tokens=tokens, temperature=0.0, stream=True):
                times.append(time.perf_counter())
            best = max(best, decode_rate(times))
        out[name] = best
        del llm
    return out


def in_child(fn: str, *args, threads: int | None = None):
    """``fn(*args)`` of this module run in a fresh Python process, with this process's environment, and its result
    (JSON); ``threads``: torch's thread count there (every CPU when ``None``).

    Every in-process measurement (``generate()``, the engine alone, llama.cpp) runs so: the threads a measurement
    starts end with its process. Run in this process, they outlived it, and with ``OMP_WAIT_POLICY=ACTIVE`` (the
    peers' setting) an idle OpenMP thread spins on a core for minutes, the servers measured next sharing the CPU
    with it (3 s of CPU in 3 s of sleep, measured)."""
    code = ("import json, sys, torch; import bench.serving as s; torch.set_num_threads(int(sys.argv[1])); "
            f"print(json.dumps(s.{fn}(*json.loads(sys.argv[2]))))")
    out = subprocess.run([sys.executable, "-c", code, str(threads or os.cpu_count() or 1), json.dumps(args)],
                         cwd=REPO, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.serving", description="kvserve vs transformers generate() and transformers serve")
    p.add_argument("--model", default=str(REPO / "models" / "kjv-llama-mha"))
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per stream")
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "serving.json"))
    p.add_argument("--skip-transformers-serve", action="store_true")
    p.add_argument("--gguf", help="the same weights as GGUF, to measure llama.cpp single-stream decode")
    p.add_argument("--long-prompt-tokens", type=int, default=900)
    p.add_argument("--engine-process", choices=["false", "true", "both"], default="both",
                   help="the server's ENGINE_PROCESS setting(s) measured at each concurrency (both: two servers)")
    p.add_argument("--skip-long-prompts", action="store_true", help="leave out the ITL-while-long-prompts-arrive part")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where kvserve, generate() and the engine alone run (transformers serve: skip it on cuda)")
    args = p.parse_args()
    dev = args.device
    levels = [int(x) for x in args.concurrency.split(",")]
    report: dict = {"model": args.model, "tokens": args.tokens, "prompt": PROMPT, "cpu_count": os.cpu_count(),
                    "device": dev, "torch": torch.__version__, "peers_omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset")}

    report["generate_decode_tokens_per_s"] = in_child("bench_generate", args.model, args.tokens, args.repeats, dev)
    print(f"generate(): {report['generate_decode_tokens_per_s']:.1f} decode tokens/s", flush=True)

    report["generate_static"] = {n: in_child("bench_generate_static", args.model, n, args.tokens, args.repeats, dev)
                                 for n in levels if n > 1}
    print("generate() static batch:", json.dumps(report["generate_static"]), flush=True)
    if args.gguf:
        report["llama_cpp_decode_tokens_per_s"] = in_child("bench_llama_cpp", args.gguf, args.tokens, args.repeats)
        print("llama.cpp:", json.dumps(report["llama_cpp_decode_tokens_per_s"]), flush=True)

    # the engine alone: with the benchmark's thread setting (every CPU, the peers' wait policy), and with the
    # server's own (one thread, as TORCH_NUM_THREADS=0 gives on 2 cores), so that HTTP's cost is seen apart
    from server.engine_loading import default_torch_threads

    server_threads = default_torch_threads()
    report["engine_alone"] = {n: in_child("bench_engine_alone", args.model, n, args.tokens, args.repeats, dev)
                              for n in levels}
    report["engine_alone_server_threads"] = {
        "threads": server_threads,
        **{n: in_child("bench_engine_alone", args.model, n, args.tokens, args.repeats, dev,
                         threads=server_threads)
           for n in levels}}
    print("engine alone:", json.dumps(report["engine_alone"]), "with the server's threads:",
          json.dumps(report["engine_alone_server_threads"]), flush=True)

    prompts = long_prompts(args.model, 4, args.long_prompt_tokens)
    report["long_prompt_itl"] = {}
    for label, prefill in () if args.skip_long_prompts else PREFILL_SETTINGS.items():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {"MODEL_ID": args.model, "PORT": str(port), "HOST": "127.0.0.1", "LOG_LEVEL": "warning",
               "MAX_BATCH_SIZE": "16", "DEVICE": dev, **prefill}
        with running([sys.executable, "-m", "server.cli", "serve"], kvserve_env(env), url + "/health", inherit=False):
            asyncio.run(concurrent(lambda c: _stream_kvserve(c, url, 8), 1))  # warm-up
            report["long_prompt_itl"][label] = {**asyncio.run(_long_arrival(url, prompts, 8, max(128, args.tokens))),
                                                "env": prefill}
        print(f"ITL while long prompts arrive, {label}:", json.dumps(report["long_prompt_itl"][label]), flush=True)

    modes = ["true", "false"] if args.engine_process == "both" else [args.engine_process]  # the default first
    for mode in modes:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {"MODEL_ID": args.model, "PORT": str(port), "HOST": "127.0.0.1", "LOG_LEVEL": "warning",
               "MAX_BATCH_SIZE": str(max(levels)), "ENGINE_PROCESS": mode, "DEVICE": dev}
        key = "kvserve" if mode == modes[0] else "kvserve_other_mode"
        report.setdefault("engine_process", {})[key] = mode == "true"
        with running([sys.executable, "-m", "server.cli", "serve"], kvserve_env(env), url + "/health",
                     inherit=False) as proc:
            asyncio.run(concurrent(lambda c: _stream_kvserve(c, url, 8), 1))  # warm-up
            if key == "kvserve":
                single = [decode_rate(asyncio.run(_single(lambda c: _stream_kvserve(c, url, args.tokens))))
                          for _ in range(args.repeats)]
                report["kvserve_decode_tokens_per_s"] = max(single)
                print(f"kvserve single stream: {max(single):.1f} decode tokens/s", flush=True)
            report[key] = {}
            for n in levels:
                meter = CpuMeter(proc.pid)
                meter.start()
                row = asyncio.run(concurrent(lambda c: _stream_kvserve(c, url, args.tokens), n))
                report[key][n] = {**row, "cpu": meter.stop()}
            print(f"kvserve ENGINE_PROCESS={mode}:", json.dumps(report[key]), flush=True)

    if not args.skip_transformers_serve and dev == "cpu":
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [str(Path(sys.executable).with_name("transformers")), "serve", "--continuous-batching",
               "--device", "cpu", "--port", str(port), args.model]
        with running(cmd, {}, url + "/health"):
            model = args.model
            asyncio.run(concurrent(lambda c: _stream_openai(c, url, model, 8), 1))  # warm-up (loads the model)
            report["transformers_serve"] = {
                n: asyncio.run(concurrent(lambda c: _stream_openai(c, url, model, args.tokens), n)) for n in levels}
            print("transformers serve:", json.dumps(report["transformers_serve"]), flush=True)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))


async def _single(fn) -> list[float]:
    async with httpx.AsyncClient(timeout=600) as client:
        return (await fn(client))["times"]


def markdown(report: dict) -> str:
    """The README table for a report."""
    lines = ["| measure | kvserve | peer | ratio |", "|---|---|---|---|"]
    k, g = report["kvserve_decode_tokens_per_s"], report["generate_decode_tokens_per_s"]
    lines.append(f"| single-stream decode tokens/s (peer: `generate()`) | {k:.1f} | {g:.1f} | {k / g:.2f}x |")
    peer = report.get("transformers_serve", {})
    for n, row in report["kvserve"].items():
        prow = peer.get(n) or peer.get(str(n))
        if prow:
            ratio = row["aggregate_tokens_per_s"] / prow["aggregate_tokens_per_s"]
            lines.append(f"| {n} streams: aggregate tokens/s (peer: `transformers serve`) | "
                         f"{row['aggregate_tokens_per_s']:.1f} | {prow['aggregate_tokens_per_s']:.1f} | {ratio:.2f}x |")
            lines.append(f"| {n} streams: TTFT p50 s | {row['ttft_p50_s']:.3f} | {prow['ttft_p50_s']:.3f} | |")
        static = report.get("generate_static", {})
        srow = static.get(n) or static.get(str(n))
        if srow:
            lines.append(f"| {n} streams: aggregate tokens/s (peer: `generate()` static batch) | "
                         f"{row['aggregate_tokens_per_s']:.1f} | {srow:.1f} | "
                         f"{row['aggregate_tokens_per_s'] / srow:.2f}x |")
        if not prow and not srow:
            lines.append(f"| {n} streams: aggregate tokens/s | {row['aggregate_tokens_per_s']:.1f} | - | |")
    alone = report.get("engine_alone", {})
    alone_own = report.get("engine_alone_server_threads", {})
    other = report.get("kvserve_other_mode", {})
    mode = "true" if report.get("engine_process", {}).get("kvserve") else "false"
    other_mode = "false" if mode == "true" else "true"
    for n, row in report["kvserve"].items():
        arow, orow = alone.get(n) or alone.get(str(n)), other.get(n) or other.get(str(n))
        if arow:
            lines.append(f"| {n} streams: server (ENGINE_PROCESS={mode}) vs the engine alone in-process, tokens/s | "
                         f"{row['aggregate_tokens_per_s']:.1f} | {arow:.1f} | {row['aggregate_tokens_per_s'] / arow:.2f}x |")
        orow_own = alone_own.get(n) or alone_own.get(str(n))
        if orow_own:
            lines.append(f"| {n} streams: server vs the engine alone in-process at the server's thread count "
                         f"({alone_own['threads']}), tokens/s | {row['aggregate_tokens_per_s']:.1f} | {orow_own:.1f} | "
                         f"{row['aggregate_tokens_per_s'] / orow_own:.2f}x |")
        if orow:
            lines.append(f"| {n} streams: server, ENGINE_PROCESS={other_mode} vs {mode}, tokens/s | "
                         f"{orow['aggregate_tokens_per_s']:.1f} | {row['aggregate_tokens_per_s']:.1f} | "
                         f"{orow['aggregate_tokens_per_s'] / row['aggregate_tokens_per_s']:.2f}x |")
    for name, rate in report.get("llama_cpp_decode_tokens_per_s", {}).items():
        lines.append(f"| single-stream decode tokens/s (peer: llama.cpp, {name}) | {k:.1f} | {rate:.1f} | "
                     f"{k / rate:.2f}x |")
    for label, r in report.get("long_prompt_itl", {}).items():
        lines.append(f"| ITL p50 / p95 / p99 / max s of 8 running streams while 4 long prompts arrive ({label}); "
                     f"the long prompts' TTFT p50 / max s | "
                     f"{r['itl_p50_s']:.3f} / {r['itl_p95_s']:.3f} / {r['itl_p99_s']:.3f} / {r['itl_max_s']:.3f}; "
                     f"{r['long_ttft_p50_s']:.2f} / {r['long_ttft_max_s']:.2f} | | "
                     f"p95/p50 {r['itl_p95_s'] / r['itl_p50_s']:.1f} |")
    for n, row in report["kvserve"].items():
        cpu = row.get("cpu")
        if cpu:
            per = 1000 / row["tokens"]
            lines.append(f"| {n} streams: CPU s per 1000 tokens, engine core process / HTTP process / the benchmark's "
                         f"client (wall s per 1000 tokens: {row['wall_s'] * per:.2f}) | "
                         f"{cpu['engine_core_process_s'] * per:.2f} / {cpu['http_process_s'] * per:.2f} / "
                         f"{cpu['client_s'] * per:.2f} | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
