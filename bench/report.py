"""``kvserve bench``: every backend on the served model, one table, plots and JSON.

For each backend setting it measures (see :mod:`bench.fidelity` for the definitions): bytes per token
held at 1024 tokens, compression vs ``full``, held-out perplexity through the cache path and its
change vs ``full``, greedy agreement with ``full``, TTFT (prefill of a 512-token prompt plus the first
sampled token, in-process), TPOT at several context lengths, and aggregate decode tokens/s of the
engine at 1 and 8 concurrent sequences. It writes ``report.md``, ``results.json`` and three PNG plots
(perplexity change vs compression, TPOT vs context, KV bytes vs context) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.fidelity import agreement, cache_path_perplexity, greedy_tokens, measured_bytes_per_token, tpot
from bench.quality import CALIB_SLICE, EVAL_SLICE, slice_token_ids
from cache_backends import ModelGeometry, create
from cache_backends.spec import format_spec, parse_spec
from server.engine.runner import ModelRunner

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SPECS = ["full", "gqa:groups=4,method=mean", "gqa:groups=4,method=pca", "gqa:groups=2,method=mean",
                 "gqa:groups=2,method=pca", "mla:rank=128", "mla:rank=64", "mla:rank=32",
                 "int8:group_size=32,residual=32", "int8:group_size=64,residual=64",
                 "dca:threshold=0.98,align=linear", "dca:threshold=0.9,align=none",
                 "gqa+int8:groups=4", "mla+int8:rank=64", "dca+int8:threshold=0.98", "dca+mla:threshold=0.98,rank=128"]
QUICK_SPECS = ["full", "gqa:groups=2,method=pca", "mla:rank=64", "int8", "dca"]


def engine_throughput(model, tokenizer, backend, streams: int, new_tokens: int) -> float:
    """Aggregate decode tokens/s of the engine (in-process) with ``streams`` concurrent greedy sequences."""
    from server.engine.engine import Engine
    from server.engine.sampling import SamplingParams
    from server.engine.scheduler import Scheduler
    from server.engine.sequence import Sequence

    g = backend.geometry
    engine = Engine(ModelRunner(model, g.num_layers), {backend.name: backend}, tokenizer, set(),
                    Scheduler(streams, None, {backend.name: 1.0}), streams)
    seqs = [Sequence(request_id=str(i), prompt_ids=tokenizer.encode(f"And the word of the LORD came {i}"),
                     max_new_tokens=new_tokens, params=SamplingParams(), stop=[], emit=lambda e: None,
                     backend_name=backend.name) for i in range(streams)]
    for s in seqs:
        engine.submit(s)
    t0 = time.perf_counter()
    while engine.running or engine.waiting:
        engine.step()
    return sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - t0)


@torch.inference_mode()
def ttft(model, backend, ids: list[int]) -> float:

    runner = ModelRunner(model, backend.geometry.num_layers)
    store = backend.new_store()
    t0 = time.perf_counter()
    int(runner.prefill(ids, store)[-1].argmax())
    elapsed = time.perf_counter() - t0
    store.release()
    return elapsed


def run(args) -> dict:
    from server.model_loading import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, torch.device("cpu"), torch.float32)
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    eval_ids = slice_token_ids(Path(args.model) / EVAL_SLICE, tokenizer)
    calib_ids = slice_token_ids(Path(args.model) / CALIB_SLICE, tokenizer)
    prompts = [eval_ids[i * 1000 : i * 1000 + 32] for i in range(args.prompts)]
    contexts = [512, 1024] if args.quick else [256, 512, 1024]
    rows, reference = [], None
    specs = args.backends or (QUICK_SPECS if args.quick else DEFAULT_SPECS)
    bar = tqdm(specs, desc="kvserve bench")
    for spec in bar:
        bar.set_postfix_str(spec)
        name, options = parse_spec(spec)
        backend = create(name, geometry, **options)
        t0 = time.perf_counter()
        backend.prepare(model, calib_ids)
        row = {"backend": name, "params": backend.params(), "spec": format_spec(name, backend.params()),
               "prepare_s": time.perf_counter() - t0, "details": backend.details()}
        row["bytes_per_token"] = measured_bytes_per_token(model, backend, calib_ids, 1024)
        row["formula_bytes_per_token"] = backend.bytes_per_token_per_layer() * geometry.num_layers
        row["bytes_vs_context"] = {}
        for c in (128, 256, 512, 768, 1024):
            store = backend.new_store()
            ModelRunner(model, geometry.num_layers).prefill(calib_ids[:c], store)
            row["bytes_vs_context"][c] = store.nbytes()
            store.release()
        row["perplexity"] = cache_path_perplexity(model, backend, eval_ids, max_windows=args.windows,
                                                  prefix=args.prefix)
        greedy = greedy_tokens(model, backend, prompts, args.new_tokens)
        if reference is None:
            reference = {"greedy": greedy, "perplexity": row["perplexity"], "bytes": row["bytes_per_token"]}
        row["greedy_agreement"] = agreement(greedy, reference["greedy"])
        row["compression"] = reference["bytes"] / row["bytes_per_token"]
        row["perplexity_change_pct"] = 100 * (row["perplexity"] / reference["perplexity"] - 1)
        row["ttft_s"] = ttft(model, backend, eval_ids[:512])
        row["tpot_s"] = {c: tpot(model, backend, calib_ids, c) for c in contexts}
        row["tokens_per_s"] = {n: engine_throughput(model, tokenizer, backend, n, args.stream_tokens)
                               for n in (1, 8)}
        rows.append(row)
        tqdm.write(f"{row['spec']}: {row['bytes_per_token']:.0f} B/token, ppl {row['perplexity']:.3f} "
                   f"({row['perplexity_change_pct']:+.2f}%), agreement {row['greedy_agreement']:.3f}")
    return {"model": args.model, "windows": args.windows, "prefix": args.prefix, "prompts": args.prompts,
            "new_tokens": args.new_tokens, "contexts": contexts, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "rows": rows}


def markdown(result: dict) -> str:
    ctx = result["contexts"]
    head = ("| backend | settings | bytes/token | compression | held-out ppl | Δ ppl | greedy agreement | TTFT s | "
            + " | ".join(f"TPOT ms @{c}" for c in ctx) + " | tok/s 1 stream | tok/s 8 streams |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in result["rows"]:
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items()) or "-"
        tp = " | ".join(f"{1000 * r['tpot_s'][c]:.1f}" for c in ctx)
        lines.append(f"| {r['backend']} | {params} | {r['bytes_per_token']:.0f} | {r['compression']:.2f}x | "
                     f"{r['perplexity']:.3f} | {r['perplexity_change_pct']:+.2f}% | {r['greedy_agreement']:.3f} | "
                     f"{r['ttft_s']:.3f} | {tp} | {r['tokens_per_s'][1]:.1f} | {r['tokens_per_s'][8]:.1f} |")
    return "\n".join(lines)


def similarity_table(result: dict) -> str:
    """Per-layer calibration similarity of dca rows (raw neighbour vs fitted linear map), if any."""
    for r in result["rows"]:
        sim = r.get("details", {}).get("calibration_similarity_by_layer")
        if sim:
            head = "| layer (vs the one before) | " + " | ".join(str(x) for x in sim["layers"]) + " |"
            lines = [head, "|" + "---|" * (len(sim["layers"]) + 1),
                     "| cosine, K/V as they are (`align=none`) | " + " | ".join(f"{x:.3f}" for x in sim["similarity_none"]) + " |",
                     "| cosine, through the fitted map (`align=linear`) | "
                     + " | ".join(f"{x:.3f}" for x in sim["similarity_linear"]) + " |"]
            return "\n".join(lines)
    return ""


def short_label(row: dict) -> str:
    """A backend and its distinguishing settings, for plot legends."""
    skip = {"probe_interval", "residual"}
    params = ",".join(f"{k}={v}" for k, v in row["params"].items() if k not in skip)
    return f"{row['backend']}({params})" if params else row["backend"]


def plots(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    paths = []
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, r in enumerate(rows):
        ax.scatter(r["compression"], r["perplexity_change_pct"], s=40, label=short_label(r))
        ax.annotate(str(i + 1), (r["compression"], r["perplexity_change_pct"]), fontsize=7, xytext=(4, 3),
                    textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_xlabel("KV compression vs full (x, log scale)")
    ax.set_ylabel("held-out perplexity change (%, symlog)")
    ax.set_title("Quality vs memory: the trade-off frontier")
    ax.grid(alpha=0.3)
    ax.legend([f"{i + 1}. {short_label(r)}" for i, r in enumerate(rows)], fontsize=6, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))
    paths.append(out / "frontier.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    for key, ylabel, fname, scale in (("tpot_s", "TPOT (ms)", "tpot_vs_context.png", 1000.0),
                                      ("bytes_vs_context", "KV bytes per sequence (MiB)", "kv_bytes_vs_context.png",
                                       1 / 2**20)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in rows:
            xs = sorted(int(c) for c in r[key])
            ax.plot(xs, [r[key][c if c in r[key] else str(c)] * scale for c in xs], marker="o", label=short_label(r))
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        paths.append(out / fname)
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(REPO / "models" / "kjv-llama-mha"))
    p.add_argument("--backends", nargs="*", help="backend specs, e.g. full gqa:groups=2,method=pca mla:rank=64")
    p.add_argument("--quick", action="store_true",
                   help="5 settings, 2 windows scored after 768 tokens, 4 prompts x 32 tokens (under 3 minutes)")
    p.add_argument("--out", default="reports/bench")
    p.add_argument("--windows", type=int, default=6,
                   help="1024-token windows of the eval slice scored through the cache path (20 = all; default 6)")
    p.add_argument("--prefix", type=int, default=512, help="tokens prefilled per window before scoring")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--stream-tokens", type=int, default=32, help="tokens per stream for the tokens/s columns")


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.windows = args.windows or 2
        args.prefix = max(args.prefix, 768)
        args.prompts = min(args.prompts, 4)
        args.new_tokens = min(args.new_tokens, 32)
        args.stream_tokens = min(args.stream_tokens, 16)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    result = run(args)
    result["wall_s"] = time.time() - started
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    images = plots(result, out)
    cmd = "kvserve bench" + (" --quick" if args.quick else "") + (
        " --backends " + " ".join(args.backends) if args.backends else "")
    sims = similarity_table(result)
    (out / "report.md").write_text(
        f"# kvserve bench — {Path(args.model).name}\n\nCommand: `{cmd}` ({result['wall_s'] / 60:.1f} min, "
        f"{result['threads']} threads, torch {result['torch']}).\n\n{table}\n\n"
        + (f"dca calibration similarity (mean cosine over tokens and heads, K and V averaged):\n\n{sims}\n\n"
           if sims else "")
        + "\n".join(f"![{p.stem}]({p.name})" for p in images) + "\n")
    if sims:
        print("\n" + sims)
    print(table)
    print(f"\nreport: {out / 'report.md'}")
    return 0
