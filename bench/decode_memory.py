"""Peak memory of one long-context stream: does a decode step allocate anything that grows with the context?

Each backend runs in a process of its own (a fresh interpreter: the peak is the process's): the server's engine
in-process (:func:`bench.budget.new_engine`) with a KV pool sized for the one stream, a prompt of ``--context``
tokens prefilled in chunks of ``--chunk``, then ``--decode-steps`` decode steps. The process's resident set is read
from ``/proc/self/status`` (``VmRSS``, and ``VmHWM``, its peak, reset before the decode by writing 5 to
``/proc/self/clear_refs``) at each phase: after the imports (the runtime), after the model loads, after the
prefill (the pool's touched pages and what the prefill kept), and at the decode's peak. The weights count by their
bytes (``numel * element_size``), not by the resident set after the load: safetensors maps the file, and its pages
become resident only as the first forward reads them. The decode's *growth* is its peak above the resident set after
the prefill: what decode steps allocate beyond what is already there, which should not grow with the context. The
last two columns are the decode's peak beyond the runtime, the weights and the KV bytes the pool holds (the
prefill's activations and scratch that the allocator keeps), and the decode's peak above the runtime as a share of
the weights plus the whole pool (the target: within 110%). Linux only.

    python -m bench.decode_memory --model models/smollm2-135m-instruct --contexts 2048 8000 \\
        --backends full int8 int4 --out docs/bench/decode_memory.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20


def status(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of process ``pid`` (this one by default), bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> None:
    """Make ``VmHWM`` start again from the current resident set (Linux 4.0+)."""
    Path("/proc/self/clear_refs").write_text("5")


def one(model_dir: str, spec: str, context: int, chunk: int, steps: int, threads: int) -> dict:
    """The figures of one backend at one context, in this process (see the module's docstring)."""
    import torch

    from bench.budget import load_reference, make_backend, new_engine
    from cache_backends.calibration import DEFAULT_EVAL_TEXT
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence

    torch.set_num_threads(threads)
    runtime = status()["VmRSS"]
    model, tok, _ = load_reference(model_dir)
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    loaded = status()["VmRSS"]
    backend = make_backend(spec, model, tok)
    ids = tok.encode(Path(DEFAULT_EVAL_TEXT).read_text(), add_special_tokens=False)[:context]
    if len(ids) < context:
        raise ValueError(f"the evaluation text holds {len(ids)} tokens, fewer than --contexts {context}")
    engine = new_engine(model, tok, backend, 1, None, chunk=chunk, prefix_caching=False)
    seq = Sequence(request_id="0", prompt_ids=ids, max_new_tokens=steps + 1, params=SamplingParams(), stop=[],
                   backend_name=backend.name)
    engine.submit(seq)
    while not seq.output_ids:
        engine.step()
    prefilled, held = status(), engine.scheduler.kv.used_bytes()
    reset_peak()
    while engine.running:
        engine.step()
    decoded = status()
    arena = engine.runner.pool.arena
    return {"backend": spec, "context": context, "decode_steps": len(seq.output_ids) - 1,
            "runtime_mib": runtime / MIB, "weights_mib": weights / MIB, "after_load_mib": loaded / MIB,
            "pool_mib": arena.numel() * arena.element_size() / MIB,
            "kv_held_mib": held / MIB,
            "after_prefill_mib": prefilled["VmRSS"] / MIB, "prefill_peak_mib": prefilled["VmHWM"] / MIB,
            "decode_peak_mib": decoded["VmHWM"] / MIB,
            "decode_growth_mib": (decoded["VmHWM"] - prefilled["VmRSS"]) / MIB,
            # beyond the runtime, the weights and the KV held: the activations and scratch the steps keep
            "beyond_mib": (decoded["VmHWM"] - runtime - weights - held) / MIB,
            "beyond_pct": 100 * (decoded["VmHWM"] - runtime - weights - held) / (weights + held),
            # the decode's peak above the runtime against the weights plus the whole pool
            "peak_vs_weights_pool_pct": 100 * (decoded["VmHWM"] - runtime) / (weights + arena.numel()
                                                                              * arena.element_size())}


def table(rows: list[dict]) -> str:
    head = ("| backend | context | runtime MiB | weights MiB | pool MiB (held) | after prefill MiB | prefill peak MiB | "
            "decode peak MiB | decode growth MiB | peak beyond runtime + weights + KV held | peak above runtime "
            "/ (weights + pool) |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| `{r['backend']}` | {r['context']} | {r['runtime_mib']:.0f} | {r['weights_mib']:.0f} | "
                     f"{r['pool_mib']:.0f} ({r['kv_held_mib']:.0f}) | {r['after_prefill_mib']:.0f} | "
                     f"{r['prefill_peak_mib']:.0f} | {r['decode_peak_mib']:.0f} | {r['decode_growth_mib']:.1f} | "
                     f"{r['beyond_mib']:.0f} MiB ({r['beyond_pct']:.0f}% of weights + KV) | "
                     f"{r['peak_vs_weights_pool_pct']:.0f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.budget import bad_spec

    p = argparse.ArgumentParser(prog="python -m bench.decode_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8000])
    p.add_argument("--backends", nargs="+", default=["full", "int8", "int4"])
    p.add_argument("--chunk", type=int, default=256, help="prefill tokens per step (MAX_NUM_BATCHED_TOKENS)")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--one", nargs=2, metavar=("SPEC", "CONTEXT"), help=argparse.SUPPRESS)  # the child's run
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.model, args.one[0], int(args.one[1]), args.chunk, args.decode_steps,
                             args.threads)))
        return 0
    if bad_spec(p.prog, args.backends):
        return 2
    if not Path("/proc/self/clear_refs").exists():
        p.error("needs Linux's /proc/self/clear_refs to reset the peak resident set")
    rows = []
    for context in args.contexts:
        for spec in args.backends:
            child = subprocess.run([sys.executable, "-m", "bench.decode_memory", "--model", args.model, "--chunk",
                                    str(args.chunk), "--decode-steps", str(args.decode_steps), "--threads",
                                    str(args.threads), "--one", spec, str(context)],
                                   capture_output=True, text=True)
            if child.returncode:
                print(child.stderr.strip().splitlines()[-1] if child.stderr.strip() else "failed", file=sys.stderr)
                return 1
            rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(f"{spec} @ {context}: decode growth {rows[-1]['decode_growth_mib']:.1f} MiB", flush=True)
    md = table(rows)
    print(f"\n{md}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                 for k, v in vars(args).items() if k != "one"},
                                        "rows": rows, "table": md}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
