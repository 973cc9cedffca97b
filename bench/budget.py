"""The memory-bound serving benchmark: what a KV budget buys each backend, plus decode-step scaling.

1. Budget run (``--streams`` concurrent greedy streams, prompts of ``--prompt-tokens`` tokens from the
   held-out slice, ``--new-tokens`` each, EOS ignored) for each backend in turn, with
   ``KV_CACHE_BUDGET_BYTES`` = ``--budget-seqs`` full-precision sequences of ``--context`` tokens (the
   default, 2 x 1024 tokens of ``full`` = 32 MiB on the reference model). The engine runs in-process, the
   same code the server runs (scheduler, chunked prefill, ragged batched decode, sampler), stepped by
   this script so that the KV bytes held can be read after every step. Reported per backend:
   output tokens/s (all generated tokens / wall time), decode tokens/s (tokens of the steps that carry
   no prefill chunk / time inside those steps' forward and sampling), TTFT and TPOT p50/p95 over streams, the most streams
   running at once, and the peak KV bytes allocated against the budget (it must never exceed it), and
   held-out perplexity through the cache path (2 windows) with its change vs ``full``.
   ``--every-token-kept`` (a model with sliding-window layers, Gemma 3): each backend runs first with every
   layer keeping every token (the model's windows ignored by the pool, ``KV_SLIDING_WINDOW_POOL=false``) and then
   as served, and the first such row is the baseline of the ratios. The budget is always counted in sequences of
   ``full`` keeping every token in every layer.
2. Scaling: one decode step's time (median of ``--steps``) vs context (batch 1) and vs batch (context
   512), per backend.

Writes ``budget.json``, ``budget.md`` and ``budget.png`` / ``decode_scaling.png`` to ``--out``.
Run: ``python -m bench.budget`` (about 10 minutes on a 2-core CPU), ``--quick`` for a smoke run.
This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from cache_backends.geometry import ModelGeometry
from cache_backends.registry import create
from cache_backends.spec import echo_recorded, format_spec, parse_spec
from server.bench_cmd.in_process import new_engine  # the other benchmarks take it from here too
from server.bench_cmd.quality import EVAL_SLICE, model_slice_ids

REPO = Path(__file__).resolve().parents[1]
SPECS = ["full", "int8", "gqa:groups=2,method=pca", "gqa+int8:groups=2", "mla:rank=64", "mla+int8:rank=64", "dca",
         "dca+int8", "elastic"]
QUICK_SPECS = ["full", "int8", "mla:rank=64"]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def bad_spec(prog: str, specs: list[str]) -> bool:
    """Print ``prog: <why>`` for the first spec that does not parse; whether one did not."""
    for spec in specs:
        try:
            parse_spec(spec)
        except ValueError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return True
    return False


def load_reference(path: str):
    """``(model, tokenizer, held-out token ids)`` of the model at ``path``, fp32 on the CPU, seeded."""
    from server.model_loading import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(path, torch.device("cpu"), torch.float32)
    return model, tokenizer, model_slice_ids(Path(path), EVAL_SLICE, tokenizer)


def make_backend(spec: str, model, tokenizer):
    name, options = parse_spec(spec)
    geometry = ModelGeometry.from_config(model.config, next(model.parameters()).dtype)
    backend = create(name, geometry, **options)
    backend.prepare(model)
    return backend


class OpCounter:
    """Counts the aten ops a block of code runs (views, which only relabel a shape, are not counted): how many
    torch calls one decode step makes, whatever they cost."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.count += not func.is_view
                return func(*args, **(kwargs or {}))

        self.count, self.mode = 0, Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def budget_run(model, tokenizer, backend, prompts: list[list[int]], new_tokens: int, budget: int,
               chunk: int) -> dict:
    """Serve ``prompts`` concurrently under ``budget`` KV bytes; return the measured figures."""
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence

    engine = new_engine(model, tokenizer, backend, len(prompts), budget, chunk)
    decode_time, decode_tokens = [0.0], [0]
    execute = engine.runner.execute

    def timed_execute(out, *args):  # decode speed: the steps that carry no prefill chunk (forward and sampling)
        t = time.perf_counter()
        result = execute(out, *args)
        if out.rows and out.decode_only:
            decode_time[0] += time.perf_counter() - t
            decode_tokens[0] += len(out.rows)
        return result

    engine.runner.execute = timed_execute
    seqs = [Sequence(request_id=str(i), prompt_ids=p, max_new_tokens=new_tokens, params=SamplingParams(), stop=[],
                     backend_name=backend.name) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for s in seqs:
        s.times.arrival = t0
        engine.submit(s)
    peak = peak_used = most_running = 0
    while engine.running or engine.waiting:
        engine.step()
        peak = max(peak, engine.kv_held_bytes())
        peak_used = max(peak_used, engine.kv_stored_bytes())
        most_running = max(most_running, len(engine.running))
    wall = time.perf_counter() - t0
    generated = sum(len(s.output_ids) for s in seqs)
    ttft = [s.times.first_token - s.times.arrival for s in seqs]
    tpot = [(s.times.token_times[-1] - s.times.token_times[0]) / (len(s.output_ids) - 1) for s in seqs]
    return {"output_tokens_per_s": generated / wall, "decode_tokens_per_s": decode_tokens[0] / decode_time[0],
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
            "tpot_p50_s": percentile(tpot, 0.5), "tpot_p95_s": percentile(tpot, 0.95),
            "wall_s": wall, "generated_tokens": generated, "most_running": most_running,
            "peak_kv_allocated_bytes": peak, "peak_kv_used_bytes": peak_used, "budget_bytes": budget,
            "pool_bytes": engine.kv.num_pages * engine.kv.page_bytes, "page_bytes": engine.kv.page_bytes,
            "within_budget": peak <= budget, "preemptions": sum(s.preemptions for s in seqs),
            "decode_share_of_wall": decode_time[0] / wall,
            "finished": sum(s.finish_reason is not None and s.finish_reason.value == "length" for s in seqs)}


@torch.inference_mode()
def step_time(model, tokenizer, backend, ids: list[int], context: int, batch: int, steps: int, ops: bool = False):
    """Median seconds of one engine decode step (forward, sampling, bookkeeping) with ``batch`` sequences of
    ``context`` cached tokens; with ``ops``, also the aten op count of one such step: ``(seconds, ops)``."""
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence

    engine = new_engine(model, tokenizer, backend, batch, None, chunk=None)
    seqs = [Sequence(request_id=str(b), prompt_ids=ids[b * 97 : b * 97 + context], max_new_tokens=steps + 4,
                     params=SamplingParams(), stop=[], backend_name=backend.name)
            for b in range(batch)]
    for s in seqs:
        engine.submit(s)
    engine.step()  # prefill every prompt whole, and the first decode step (one-off allocations)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    count = None
    if ops:
        with OpCounter() as counter:
            engine.step()
        count = counter.count
    for s in seqs:
        s.cancel()
    engine.step()
    median = statistics.median(times)
    return (median, count) if ops else median


def perplexity_change(model, backend, full_ppl: float | None, ids: list[int]) -> tuple[float, float | None]:
    """Held-out perplexity through the backend's cache path (2 windows) and its change vs ``full`` (%); for an
    on-demand tier (``elastic``) its worst case, every compressible group quantized at every step."""
    from server.bench_cmd.fidelity import cache_path_perplexity, paged_perplexity

    if backend.quantization and backend.quantization.on_demand:
        ppl = paged_perplexity(model, backend, ids, max_windows=2, compress_all=True)
    else:
        ppl = cache_path_perplexity(model, backend, ids, max_windows=2)
    return ppl, None if full_ppl is None else 100 * (ppl / full_ppl - 1)


def plots(results: list[dict], scaling: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["spec"] for r in results]
    axes[0].bar(names, [r["output_tokens_per_s"] for r in results], color="tab:blue")
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title("16 streams under one KV budget (2 full sequences)")
    axes[1].bar(names, [r["peak_kv_allocated_bytes"] / 2**20 for r in results], color="tab:orange")
    axes[1].axhline(results[0]["budget_bytes"] / 2**20, color="k", linestyle="--", label="budget")
    axes[1].set_ylabel("peak KV allocated (MiB)")
    axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=35)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(out / "budget.png", dpi=110)
    plt.close(fig)
    if not scaling:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for spec, s in scaling.items():
        axes[0].plot(list(s["context"]), [1e3 * v for v in s["context"].values()], marker="o", label=spec)
        axes[1].plot(list(s["batch"]), [1e3 * v for v in s["batch"].values()], marker="o", label=spec)
    axes[0].set_xlabel("context (tokens), batch 1")
    axes[1].set_xlabel("batch (sequences), context 512")
    for ax in axes:
        ax.set_ylabel("decode step (ms)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "decode_scaling.png", dpi=110)
    plt.close(fig)


def table(results: list[dict], args) -> str:
    lines = [f"{args.streams} streams, prompts of {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy; "
             f"KV budget {results[0]['budget_bytes']} bytes ({args.budget_seqs} x {args.context} tokens of full). "
             f"Command: `python -m bench.budget`.", "",
             "| backend | output tok/s | vs full | decode tok/s | TTFT p50 / p95 (s) | TPOT p50 / p95 (ms) | "
             "streams at once | preemptions | peak KV held / budget | held-out ppl (Δ vs full) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = results[0]["output_tokens_per_s"]
    for r in results:
        ppl = "" if r.get("ppl") is None else f"{r['ppl']:.2f} ({r['ppl_change_pct']:+.2f}%)"
        lines.append(f"| {echo_recorded(r['spec'])} | {r['output_tokens_per_s']:.0f} | {r['output_tokens_per_s'] / base:.2f}x | "
                     f"{r['decode_tokens_per_s']:.0f} | {r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | "
                     f"{1e3 * r['tpot_p50_s']:.1f} / {1e3 * r['tpot_p95_s']:.1f} | {r['most_running']} | "
                     f"{r['preemptions']} | {r['peak_kv_allocated_bytes'] / r['budget_bytes']:.2f} | {ppl} |")
    return "\n".join(lines) + "\n"


def scaling_table(scaling: dict) -> str:
    """One engine decode step (median ms) and its aten op count at 512 cached tokens, by batch size."""
    if not scaling:
        return ""
    batches = list(next(iter(scaling.values()))["batch"])
    lines = ["", "One decode step at 512 cached tokens per sequence (engine step: forward, sampling, bookkeeping; "
             "median ms) and its aten op count (views not counted), by batch size:", "",
             "| backend | " + " | ".join(f"batch {b}: ms / ops" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    for spec, s in scaling.items():
        lines.append(f"| {echo_recorded(spec)} | " + " | ".join(f"{1e3 * s['batch'][b]:.1f} / {s['ops'][b]}" for b in batches) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.budget", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "models" / "kjv-llama-mha"))
    ap.add_argument("--specs", nargs="+", default=None, help="backend specs (first is the baseline)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=448)
    ap.add_argument("--budget-seqs", type=int, default=2)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256, help="MAX_NUM_BATCHED_TOKENS of the engine")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per scaling point")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--no-quality", action="store_true")
    ap.add_argument("--quick", action="store_true", help="3 backends, 8 streams x 64 new tokens, no scaling")
    ap.add_argument("--every-token-kept", action="store_true",
                    help="on a model with sliding-window layers, run each backend first with every layer keeping "
                         "every token (KV_SLIDING_WINDOW_POOL=false), the baseline of the ratios")
    ap.add_argument("--out", default=str(REPO / "docs" / "bench"))
    args = ap.parse_args(argv)
    if args.quick:
        args.streams, args.new_tokens, args.no_scaling = 8, 64, True
        args.specs = args.specs or QUICK_SPECS
    specs = args.specs or SPECS
    if bad_spec("bench.budget", specs):
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer, ids = load_reference(args.model)
    if len(ids) < args.prompt_tokens:
        ap.error(f"the held-out slice holds {len(ids)} tokens of this model, fewer than --prompt-tokens")
    step = max(1, (len(ids) - args.prompt_tokens) // args.streams)
    prompts = [ids[i * step : i * step + args.prompt_tokens] for i in range(args.streams)]
    results, scaling, full_ppl = [], {}, None
    budget = None
    runs = [(spec, windowed) for spec in specs for windowed in ((False, True) if args.every_token_kept else (True,))]
    for spec, windowed in runs:
        backend = make_backend(spec, model, tokenizer)
        if args.every_token_kept and not backend.geometry.sliding_layers:
            ap.error("--every-token-kept: this model has no sliding-window layers")
        if budget is None:
            full = create("full", backend.geometry)
            budget = args.budget_seqs * full.reserved_bytes(args.context)  # every token of every layer
        backend.windowed_pool = backend.windowed_pool and windowed
        r = {"spec": format_spec(*parse_spec(spec)) + ("" if windowed else " (every token kept)")}
        r.update(budget_run(model, tokenizer, backend, prompts, args.new_tokens, budget, args.chunk))
        if not args.no_quality:
            r["ppl"], r["ppl_change_pct"] = perplexity_change(model, backend, full_ppl, ids)
            full_ppl = full_ppl or r["ppl"]
            r["ppl_change_pct"] = r["ppl_change_pct"] or 0.0
        if not args.no_scaling:
            batch = {b: step_time(model, tokenizer, backend, ids, 512, b, args.steps, ops=True) for b in (1, 4, 16)}
            scaling[r["spec"]] = {
                "context": {c: step_time(model, tokenizer, backend, ids, c, 1, args.steps) for c in (128, 512, 1024 - 16)},
                "batch": {b: t for b, (t, _) in batch.items()}, "ops": {b: n for b, (_, n) in batch.items()}}
        results.append(r)
        print(f"{r['spec']}: {r['output_tokens_per_s']:.0f} tok/s, peak KV {r['peak_kv_allocated_bytes']} / {budget}",
              file=sys.stderr)
    (out / "budget.json").write_text(json.dumps({"args": vars(args), "results": results, "scaling": scaling},
                                                indent=1))
    (out / "budget.md").write_text(table(results, args) + scaling_table(scaling))
    plots(results, scaling, out)
    print(table(results, args) + scaling_table(scaling))
    return 0 if all(r["within_budget"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
