"""One stream at long context: TTFT and TPOT per backend, the attention kernel beside the torch path.

For each context (prompt tokens) and backend, the server's engine in-process (:func:`bench.budget.new_engine`, one
sequence, prompts prefilled in chunks of ``--chunk`` tokens as ``MAX_NUM_BATCHED_TOKENS`` does) measures the time to
the first token (the whole chunked prefill), the KV bytes the sequence then holds (as the engine measures them: a
model's sliding-window layers count their window only) and the median decode step over ``--decode-steps`` steps, once with
each attention path (``KV_ATTENTION``: ``kernel``, ``torch``; ``kernel-exact``: the kernel with
``KVSERVE_KERNEL_EXACT_SUMS=1``, a decode's 4-bit keys scored in fp32 instead of in integers). The streams of one context (every backend on every
path) take turns step by step (:func:`interleave`), so a drifting machine slows them alike. Each figure is also given as a ratio to ``full``'s
on the same path, beside the *byte-bound ratio*: (weights + the backend's KV bytes at that context) / (weights +
``full``'s), what a decode step bound by the bytes it reads would cost.

    python -m bench.longctx --model models/smollm2-135m-instruct --contexts 1024 4096 8000 \\
        --backends full int8 int4 --out docs/bench/longctx.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


class Stream:
    """One stream of prompt ``ids`` on ``backend`` through one attention path, stepped by :func:`interleave`."""

    def __init__(self, model, tok, backend, path: str, ids: list[int], chunk: int, steps: int):
        from bench.budget import new_engine
        from server.engine.sampling import SamplingParams
        from server.engine.sequence import Sequence

        self.path = path
        self.engine = new_engine(model, tok, backend, 1, None, chunk=chunk, prefix_caching=False)
        self.seq = Sequence(request_id="0", prompt_ids=ids, max_new_tokens=steps + 2, params=SamplingParams(),
                            stop=[], backend_name=backend.name)
        self.engine.submit(self.seq)
        self.prefill_s = 0.0
        self.kv_bytes = 0
        self.step_s: list[float] = []

    def step(self) -> float:
        """One engine step on this stream's path; its seconds."""
        from cache_backends import kernels

        exact = self.path == "kernel-exact"
        with kernels.using("kernel" if exact else self.path), kernels.exact_sums(exact):
            t = time.perf_counter()
            self.engine.step()
            return time.perf_counter() - t

    def close(self) -> None:
        self.seq.cancel()
        self.engine.step()


def interleave(streams: list[Stream], steps: int) -> list[dict]:
    """TTFT (s: the sum of a stream's own prefill steps) and median TPOT (ms) of each stream, stepped in turn.

    The streams take turns step by step, prefill chunks and decode steps alike, so a machine whose speed drifts
    (other load, frequency) slows every backend alike and the ratios compare peers at the same moments.
    """
    while any(not s.seq.output_ids for s in streams):
        for s in streams:
            if not s.seq.output_ids:
                s.prefill_s += s.step()
                s.kv_bytes = s.seq.kv_stored_bytes  # what it holds once its prompt is cached
    for _ in range(steps):
        for s in streams:
            s.step_s.append(s.step())
    out = []
    for s in streams:
        s.close()
        out.append({"ttft_s": round(s.prefill_s, 3), "tpot_ms": round(statistics.median(s.step_s) * 1000, 2),
                    "kv_bytes_at_context": s.kv_bytes})
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.budget import load_reference, make_backend

    p = argparse.ArgumentParser(prog="python -m bench.longctx", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8000])
    p.add_argument("--backends", nargs="+", default=["full", "int8", "int4"])
    p.add_argument("--paths", nargs="+", default=["kernel", "torch"], choices=["kernel", "torch", "kernel-exact"])
    p.add_argument("--chunk", type=int, default=256, help="prefill tokens per step (MAX_NUM_BATCHED_TOKENS)")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the server's default on 2 cores)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok, _ = load_reference(args.model)
    text_ids = tok.encode(Path("README.md").read_text() * 20)
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    rows = []
    for context in args.contexts:
        ids = text_ids[:context]
        runs = [(spec, path) for spec in args.backends for path in args.paths]
        backends = {spec: make_backend(spec, model, tok) for spec in args.backends}
        streams = [Stream(model, tok, backends[spec], path, ids, args.chunk, args.decode_steps)
                   for spec, path in runs]
        for (spec, path), r in zip(runs, interleave(streams, args.decode_steps)):
            row = {"context": context, "backend": spec, "path": path, **r, "weights_bytes": weights}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del streams
    _ratios(rows)
    print(markdown(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


def _ratios(rows: list[dict]) -> None:
    """Each row's TTFT and TPOT over ``full``'s at the same context on the same path, and the byte-bound ratio."""
    full = {(r["context"], r["path"]): r for r in rows if r["backend"] == "full"}
    for r in rows:
        f = full.get((r["context"], r["path"]))
        if f is None:
            continue
        r["ttft_vs_full"] = round(r["ttft_s"] / f["ttft_s"], 3)
        r["tpot_vs_full"] = round(r["tpot_ms"] / f["tpot_ms"], 3)
        if r["kv_bytes_at_context"] and f["kv_bytes_at_context"]:
            r["byte_bound_vs_full"] = round((r["weights_bytes"] + r["kv_bytes_at_context"])
                                            / (f["weights_bytes"] + f["kv_bytes_at_context"]), 3)


def markdown(rows: list[dict]) -> str:
    lines = ["| context | backend | path | TTFT s | TPOT ms | TTFT vs full | TPOT vs full | byte-bound |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['backend']} | {r['path']} | {r['ttft_s']} | {r['tpot_ms']} | "
                     f"{r.get('ttft_vs_full', '')} | {r.get('tpot_vs_full', '')} | {r.get('byte_bound_vs_full', '')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
