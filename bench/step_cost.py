"""What one engine decode step spends, and where: the model's own matmuls, the model's other ops (norms, RoPE,
activations, residuals), kvserve's KV path (writes, page gathers, attention over the stored form), and the engine
outside the forward (scheduling, sampling, bookkeeping).

For each backend and batch size: the median wall time of a decode step (:func:`bench.budget.step_time`, no
profiler), the aten ops one step runs (views not counted) in each part, and each part's share of the step's CPU
time under ``torch.profiler`` (which slows small ops, so shares, not times, are what it gives). Every sequence has
``--context`` cached tokens.

    python -m bench.step_cost [--batches 1 16] [--backends full int8] [--out docs/bench/step_cost.json]

``--compile`` measures ``torch.compile`` (inductor) of parts of the model instead: ``mlp-norm`` compiles each decoder
layer's MLP and RMSNorms (regional compilation), ``layers`` each whole decoder layer with the KV path left eager
(a graph break at the cache write and at the attention); the step times before and after, and the seconds the
first compiled steps took (compilation and recompilations as the step's shapes change).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

PARTS = ("model matmuls", "model other ops", "kvserve KV path", "engine outside the forward")
MATMUL_OPS = ("linear", "mm", "addmm", "skinny_linear")
"""The ops of the model's linear layers (``skinny_linear``: a decode step's few rows, server.engine.decode_linear)."""


class _Regions:
    """Which part of the step the code is in (a stack), for the op counter and the profiler."""

    def __init__(self):
        self.stack = ["engine outside the forward"]

    @contextmanager
    def enter(self, name: str):
        self.stack.append(name)
        try:
            with torch.profiler.record_function(name):
                yield
        finally:
            self.stack.pop()


def _instrument(model, backend, regions: _Regions):
    """Wrap the model's forward and the backend's paged write/read and attention so that their ops are told apart."""

    def wrap(obj, name: str, region: str):
        inner = getattr(obj, name)

        def wrapped(*args, **kwargs):
            with regions.enter(region):
                return inner(*args, **kwargs)

        setattr(obj, name, wrapped)

    wrap(model, "forward", "model other ops")
    wrap(backend, "paged_layer", "kvserve KV path")
    wrap(backend, "attend_paged", "kvserve KV path")


def count_ops(engine, regions: _Regions) -> dict[str, int]:
    """The aten ops of one engine step by part (views not counted); matmuls inside the forward but outside the KV
    path are the model's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = dict.fromkeys(PARTS, 0)

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.namespace != "profiler":  # not the regions' own record_function ops
                part = regions.stack[-1]
                if part == "model other ops" and func.__name__.split(".")[0] in MATMUL_OPS:
                    part = "model matmuls"
                counts[part] += 1
            return func(*args, **(kwargs or {}))

    with Mode():
        engine.step()
    return counts


def time_shares(engine, steps: int) -> dict[str, float]:
    """Each part's share of the CPU time of ``steps`` engine steps under the profiler (self time of the aten ops
    in it; the rest of the step's wall time is Python outside any op, counted with the part it runs in)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t
    totals = {e.key: e.cpu_time_total for e in prof.key_averages()}
    # the model's linear layers are aten::mm/addmm or kvserve::skinny_linear; the KV path's products are bmm and
    # attention kernels
    model_matmul = sum(e.self_cpu_time_total for e in prof.key_averages()
                       if e.key.split("::")[-1] in MATMUL_OPS and e.key.split("::")[0] in ("aten", "kvserve"))
    kv = totals.get("kvserve KV path", 0.0)
    forward = totals.get("model other ops", 0.0)
    wall_us = wall * 1e6
    out = {"model matmuls": model_matmul, "model other ops": forward - kv - model_matmul, "kvserve KV path": kv,
           "engine outside the forward": wall_us - forward}
    return {k: round(v / wall_us, 3) for k, v in out.items()}


def measure(model, tok, spec: str, ids: list[int], batch: int, context: int, steps: int) -> dict:
    from bench.budget import make_backend, new_engine, step_time
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence

    backend = make_backend(spec, model, tok)
    seconds = step_time(model, tok, backend, ids, context, batch, steps)
    regions = _Regions()
    _instrument(model, backend, regions)
    try:
        engine = new_engine(model, tok, backend, batch, None, chunk=None)
        seqs = [Sequence(request_id=str(b), prompt_ids=ids[b * 97: b * 97 + context], max_new_tokens=2 * steps + 8,
                         params=SamplingParams(), stop=[], backend_name=backend.name)
                for b in range(batch)]
        for s in seqs:
            engine.submit(s)
        engine.step()  # prefill whole
        engine.step()
        ops = count_ops(engine, regions)
        shares = time_shares(engine, steps)
    finally:
        del model.forward  # the instance attribute set by _instrument; the class's method again
    return {"backend": spec, "batch": batch, "context": context, "step_ms": round(seconds * 1000, 2),
            "ops": ops, "ops_total": sum(ops.values()), "cpu_share": shares}


def compile_parts(model, how: str) -> None:
    """``torch.compile`` the parts of ``model`` that ``how`` names (``mlp-norm`` or ``layers``), in place."""
    if how == "layers":
        import server.engine.runner as runner

        runner._StepLayer.update = torch.compiler.disable(runner._StepLayer.update)
        runner.PagedRead.attend = torch.compiler.disable(runner.PagedRead.attend)
    for layer in model.model.layers:
        if how == "layers":
            layer.compile(dynamic=True)
        else:
            for part in (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
                part.compile(dynamic=True)


def compile_run(model, tok, ids: list[int], how: str, batches: list[int], context: int, steps: int) -> dict:
    """Decode step times (ms) of ``full`` before and after compiling ``how``, and the seconds the first compiled
    steps of each batch size took."""
    from bench.budget import make_backend, step_time

    backend = make_backend("full", model, tok)
    eager = {b: round(1000 * step_time(model, tok, backend, ids, context, b, steps), 2) for b in batches}
    compile_parts(model, how)
    t = time.perf_counter()
    for b in batches:
        step_time(model, tok, backend, ids, context, b, 2)
    first = round(time.perf_counter() - t, 1)
    compiled = {b: round(1000 * step_time(model, tok, backend, ids, context, b, steps), 2) for b in batches}
    return {"compile": how, "eager_step_ms": eager, "compiled_step_ms": compiled, "first_steps_s": first}


def markdown(rows: list[dict]) -> str:
    lines = ["| backend | batch | step ms | aten ops (model matmuls / model other / KV path / engine) | share of the "
             "step's time under the profiler (same order) |", "|---|---|---|---|---|"]
    for r in rows:
        ops = " / ".join(str(r["ops"][p]) for p in PARTS)
        share = " / ".join(f"{100 * r['cpu_share'][p]:.0f}%" for p in PARTS)
        lines.append(f"| `{r['backend']}` | {r['batch']} | {r['step_ms']:.2f} | {r['ops_total']} ({ops}) | {share} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from cache_backends.calibration import calibration_ids
    from server.engine.malloc_tuning import keep_step_memory
    from server.model_loading import load_model

    p = argparse.ArgumentParser(prog="python -m bench.step_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/kjv-llama-mha")
    p.add_argument("--backends", nargs="+", default=["full", "int8"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the count measured in the docs)")
    p.add_argument("--compile", choices=["mlp-norm", "layers"], default=None,
                   help="measure torch.compile of these parts of the model instead (full)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_step_memory()
    model, tok = load_model(args.model, torch.device("cpu"), torch.float32)
    ids = calibration_ids(model, tok, max_tokens=max(args.batches) * 97 + args.context + 100)
    if args.compile:
        report = compile_run(model, tok, ids, args.compile, args.batches, args.context, args.steps)
        print(json.dumps(report))
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")
        return 0
    rows = []
    for spec in args.backends:
        for batch in args.batches:
            rows.append(measure(model, tok, spec, ids, batch, args.context, args.steps))
            print(json.dumps(rows[-1]), flush=True)
    report = {"model": args.model, "threads": args.threads, "torch": torch.__version__, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
