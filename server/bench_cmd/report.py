"""``kvserve bench``: every backend on the served model, one table, plots and JSON.

For each backend setting it measures (see :mod:`server.bench_cmd.fidelity` for the definitions): bytes per token
held at 1024 tokens, compression vs ``full``, held-out perplexity through the cache path and its
change vs ``full``, greedy agreement with ``full``, TTFT (prefill of a 512-token prompt plus the first
sampled token, in-process), TPOT at several context lengths, and aggregate decode tokens/s of the
engine at 1 and 8 concurrent sequences; with ``--needle-context N``, key retrieval at N prompt tokens
(:mod:`server.bench_cmd.needle`: one probe at each of five depths, found/asked); with ``--long-context N``, the
quality budget's long price on one N-token input (:mod:`server.long_context`: the perplexity change the KL from
``full`` implies and the top-1 agreement on its last tokens, and the needles found), which a backend that drops far
tokens (``window``) pays where the 1024-token windows cannot see it. Quality is measured setting by setting; speed is measured in
``--rounds`` rounds over all settings and reported as the median over rounds, with the spread (min-max) over
rounds beside it in the table (each round's value in ``speed_samples``). It writes ``report.md``,
``results.json`` (with each setting's wall time per phase) and three PNG plots (perplexity change vs
compression, TPOT vs context, KV bytes vs context) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from cache_backends.geometry import ModelGeometry
from cache_backends.registry import create
from cache_backends.spec import echo_recorded, format_options, format_spec, parse_spec
from cache_backends.store_path import StorePath
from server.bench_cmd import needle
from server.bench_cmd.fidelity import (PagedSequence, agreement, cache_path_perplexity, greedy_tokens,
                                       measured_bytes_per_token, tpot)
from server.bench_cmd.quality import CALIB_SLICE, EVAL_SLICE, model_slice_ids
from server.bench_cmd.report_cli import (BUDGETED, DEFAULT, DEFAULT_SPECS, MAX_PROMPTS, NEEDLE_DEPTHS,  # noqa: F401
                                         QUICK, QUICK_SPECS, REPO, WINDOW, add_arguments, command_line)

CHAT_PROMPT_TOKENS = 64  # tokens of held-out text in each chat-templated greedy prompt


def greedy_prompts(tokenizer, eval_ids: list[int], n: int) -> list[list[int]]:
    """The greedy-agreement prompts: ``n`` passages of the eval slice, one every 1000 tokens. A model with a
    chat template gets each as a chat turn (a 64-token passage to continue, through the template with the
    assistant's turn opened), as an instruct model is served; others get 32 raw tokens."""
    if not getattr(tokenizer, "chat_template", None):
        return [eval_ids[i * 1000 : i * 1000 + 32] for i in range(n)]
    prompts = []
    for i in range(n):
        passage = tokenizer.decode(eval_ids[i * 1000 : i * 1000 + CHAT_PROMPT_TOKENS])
        turn = [{"role": "user", "content": f"Continue this passage:\n\n{passage}"}]
        ids = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True, return_dict=False)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return prompts


def engine_throughput(model, tokenizer, backend, streams: int, new_tokens: int) -> float:
    """Aggregate decode tokens/s of the engine (in-process) with ``streams`` concurrent greedy sequences."""
    from server.bench_cmd.in_process import new_engine
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence

    engine = new_engine(model, tokenizer, backend, streams, None)
    seqs = [Sequence(request_id=str(i), prompt_ids=tokenizer.encode(f"And the word of the LORD came {i}"),
                     max_new_tokens=new_tokens, params=SamplingParams(), stop=[],
                     backend_name=backend.name) for i in range(streams)]
    for s in seqs:
        engine.submit(s)
    t0 = time.perf_counter()
    while engine.running or engine.waiting:
        engine.step()
    return sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - t0)


@torch.inference_mode()
def ttft(model, backend, ids: list[int]) -> float:
    """Time (seconds) to prefill ``ids`` into an empty cache and pick the first token, in-process, through the
    path the server serves the backend by (the paged pool)."""
    seq = PagedSequence(model, backend, len(ids))
    t0 = time.perf_counter()
    int(seq.step(ids).argmax())
    return time.perf_counter() - t0


class Phases:
    """Wall time (seconds) of each measurement of one setting, kept in the report to show where time goes."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        return out


def retrieval(model, tokenizer, backend, probes: list[dict]) -> dict:
    """Key retrieval of ``backend`` on :func:`server.bench_cmd.needle.probes` (one context): ``{"context", "found", "asked",
    "depths_missed"}``."""
    answers = needle.answer(model, tokenizer, backend, [p["ids"] for p in probes], 256)
    missed = [p["depth"] for p, text in zip(probes, answers) if p["value"] not in text]
    return {"context": probes[0]["context"], "found": len(probes) - len(missed), "asked": len(probes),
            "depths_missed": missed}


def bytes_vs_context(model, backend, token_ids: list[int], contexts=(128, 256, 512, 768, 1024)) -> dict[int, int]:
    """Bytes one sequence's store holds after a prefill of each context length (tokens -> bytes)."""
    runner, out = StorePath(model, backend.geometry.num_layers), {}
    for c in contexts:
        store = backend.new_store()
        runner.prefill(token_ids[:c], store)
        out[c] = store.nbytes()
        store.release()
    return out


def long_scorer(model, geometry, tokenizer, calib_ids: list[int], length: int):
    """A :class:`server.quality_price.Scorer` with the long input of ``length`` tokens built from the calibration
    text (:func:`server.long_context.build_long_probe`): it prices the ``@budget`` entries as the server does and
    every setting on the long input."""
    from server.long_context import build_long_probe
    from server.quality_price import Scorer

    return Scorer(model, geometry, calib_ids, long_probe=build_long_probe(tokenizer, calib_ids, length))


def settings(specs: list[str]) -> list[str]:
    """``specs`` without repeats, with ``full`` first: every compression, perplexity change and greedy
    agreement is measured against it, so it is added when not asked for."""
    specs = list(dict.fromkeys(s.strip() for s in specs))
    return ["full"] + [s for s in specs if s != "full"]


def run(args) -> dict:
    from server.model_loading import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, torch.device("cpu"), torch.float32)
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    eval_ids = model_slice_ids(Path(args.model), EVAL_SLICE, tokenizer)
    calib_ids = model_slice_ids(Path(args.model), CALIB_SLICE, tokenizer)
    prompts = greedy_prompts(tokenizer, eval_ids, args.prompts)
    scorer = long_scorer(model, geometry, tokenizer, calib_ids, args.long_context) if args.long_context else None
    contexts = [512, 1024] if args.quick else [256, 512, 1024]
    rows, backends, reference = [], [], None
    specs = settings(args.backends or (QUICK_SPECS if args.quick else DEFAULT_SPECS))
    needles = needle.probes(tokenizer, [args.needle_context], list(NEEDLE_DEPTHS), 1) if args.needle_context else []
    bar = tqdm(specs, desc="kvserve bench: quality")
    for spec in bar:
        bar.set_postfix_str(spec)
        timed = Phases()
        if spec.endswith(BUDGETED):  # the setting the quality budget chooses (as the server does at start-up)
            from server.quality_budget import choose
            from server.quality_price import Scorer

            name = spec.removesuffix(BUDGETED)
            scorer = scorer or Scorer(model, geometry, calib_ids)
            backend, choice = timed("prepare", choose, name, geometry, {}, set(), model, calib_ids, None, scorer,
                                    args.budget)
            budget = choice.as_dict()
        else:
            name, options = parse_spec(spec)
            backend, budget = create(name, geometry, **options), None
            timed("prepare", backend.prepare, model, calib_ids)
        row = {"backend": name, "params": backend.params(), "spec": format_spec(name, backend.params()),
               "details": backend.details(), "budget": budget}
        row["bytes_per_token"], row["formula_bytes_per_token"] = timed(
            "bytes", measured_bytes_per_token, model, backend, calib_ids, 1024)
        row["info_bytes_per_token"] = backend.bytes_per_token_per_layer() * geometry.num_layers  # what /info says
        row["bytes_vs_context"] = timed("bytes", bytes_vs_context, model, backend, calib_ids)
        row["perplexity"] = timed("perplexity", cache_path_perplexity, model, backend, eval_ids,
                                  window=WINDOW, max_windows=args.windows, prefix=args.prefix)
        greedy = timed("greedy", greedy_tokens, model, backend, prompts, args.new_tokens)
        if reference is None:
            reference = {"greedy": greedy, "perplexity": row["perplexity"], "bytes": row["bytes_per_token"]}
        row["greedy_agreement"] = agreement(greedy, reference["greedy"])
        row["compression"] = reference["bytes"] / row["bytes_per_token"]
        row["perplexity_change_pct"] = 100 * (row["perplexity"] / reference["perplexity"] - 1)
        if args.needle_context:
            row["retrieval"] = timed("retrieval", retrieval, model, tokenizer, backend, needles)
        if args.long_context:
            row["long_price"] = asdict(timed("long", scorer.long_price, backend))
        row["phase_s"] = timed.seconds
        rows.append(row)
        backends.append((backend, timed))
        tqdm.write(f"{row['spec']}: {row['bytes_per_token']:.0f} B/token, ppl {row['perplexity']:.3f} "
                   f"({row['perplexity_change_pct']:+.2f}%), agreement {row['greedy_agreement']:.3f}")
    # Speed: every setting once per round, round after round, and the median over rounds, so that a
    # slow spell of a shared machine spreads over all settings instead of landing on one.
    samples = [{"ttft": [], "tpot": {c: [] for c in contexts}, "tps": {1: [], 8: []}} for _ in rows]
    bar = tqdm(total=args.rounds * len(rows), desc="kvserve bench: speed")
    for _ in range(args.rounds):
        for (backend, timed), sample in zip(backends, samples):
            sample["ttft"].append(timed("latency", ttft, model, backend, eval_ids[:512]))
            for c in contexts:
                sample["tpot"][c].append(timed("latency", tpot, model, backend, calib_ids, c))
            for n in (1, 8):
                sample["tps"][n].append(timed("throughput", engine_throughput, model, tokenizer, backend, n,
                                              args.stream_tokens))
            bar.update()
    bar.close()
    for row, sample in zip(rows, samples):
        row["ttft_s"] = statistics.median(sample["ttft"])
        row["tpot_s"] = {c: statistics.median(v) for c, v in sample["tpot"].items()}
        row["tokens_per_s"] = {n: statistics.median(v) for n, v in sample["tps"].items()}
        row["speed_samples"] = {"ttft_s": sample["ttft"], "tpot_s": sample["tpot"], "tokens_per_s": sample["tps"]}
    windows = min(args.windows, len(range(0, len(eval_ids) - WINDOW + 1, WINDOW)))  # those scored (the slice's)
    return {"model": args.model, "windows": windows, "prefix": args.prefix, "prompts": args.prompts,
            "new_tokens": args.new_tokens, "rounds": args.rounds, "contexts": contexts, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "rows": rows}


def spread(value: float, samples: list[float] | None, scale: float = 1.0, digits: int = 1) -> str:
    """``value`` (a median) times ``scale`` with the min-max of ``samples`` (its rounds) beside it:
    ``"9.8 (9.5-10.4)"``; the value alone with fewer than 2 samples (one round, or a result without them)."""
    text = f"{scale * value:.{digits}f}"
    if samples and len(samples) > 1:
        text += f" ({scale * min(samples):.{digits}f}-{scale * max(samples):.{digits}f})"
    return text


def markdown(result: dict) -> str:
    """The results table (markdown): speed columns are medians over rounds, their min-max in brackets."""
    ctx = result["contexts"]
    head = ("| backend | settings | bytes/token | compression | held-out ppl | Δ ppl | greedy agreement | TTFT s | "
            + " | ".join(f"TPOT ms @{c}" for c in ctx) + " | tok/s 1 stream | tok/s 8 streams |")
    needles = [r.get("retrieval") for r in result["rows"]]
    if all(needles):
        head += f" retrieval @{needles[0]['context']} |"
    longs = [r.get("long_price") for r in result["rows"]]
    if all(longs):
        head += f" Δ ppl @{longs[0]['context']} (KL) | needles @{longs[0]['context']} |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in result["rows"]:
        params = format_options(r["params"], ", ") or "-"
        per_round = r.get("speed_samples", {})
        tp = " | ".join(spread(r["tpot_s"][c], per_round.get("tpot_s", {}).get(c), 1000) for c in ctx)
        tps = " | ".join(spread(r["tokens_per_s"][n], per_round.get("tokens_per_s", {}).get(n)) for n in (1, 8))
        label = r["backend"] + (f" (budget +{r['budget']['budget_pct']:g}%)" if r.get("budget") else "")
        lines.append(f"| {label} | {params} | {r['bytes_per_token']:.0f} | {r['compression']:.2f}x | "
                     f"{r['perplexity']:.3f} | {r['perplexity_change_pct']:+.2f}% | {r['greedy_agreement']:.3f} | "
                     f"{spread(r['ttft_s'], per_round.get('ttft_s'), digits=3)} | {tp} | {tps} |"
                     + (f" {r['retrieval']['found']}/{r['retrieval']['asked']} |" if all(needles) else "")
                     + (f" +{r['long_price']['ppl_increase_pct']:.2f}% | {sum(r['long_price']['found'])}/"
                        f"{len(r['long_price']['found'])} |" if all(longs) else ""))
    rounds = result.get("rounds", 1)
    note = (f"TTFT, TPOT and tokens/s: median over {rounds} rounds, min-max over the rounds in brackets."
            if rounds > 1 else "TTFT, TPOT and tokens/s: one round.")
    return "\n".join(lines) + "\n\n" + note


def similarity_table(result: dict) -> str:
    """Per-layer calibration similarity of dca rows (raw neighbour, the served map, the unrestricted map), if any."""
    for r in result["rows"]:
        sim = r.get("details", {}).get("calibration_similarity_by_layer")
        if sim:
            head = "| layer (vs the one before) | " + " | ".join(str(x) for x in sim["layers"]) + " |"
            lines = [head, "|" + "---|" * (len(sim["layers"]) + 1),
                     "| cosine, K/V as they are (`align=none`) | " + " | ".join(f"{x:.3f}" for x in sim["similarity_none"]) + " |",
                     "| cosine, through the served RoPE-commuting map (`align=linear`) | "
                     + " | ".join(f"{x:.3f}" for x in sim["similarity_linear"]) + " |"]
            if "similarity_full_linear" in sim:  # the unrestricted map served before (rebuilt K/V every step)
                lines.append("| cosine, through an unrestricted linear map on [K ; V] (not served) | "
                             + " | ".join(f"{x:.3f}" for x in sim["similarity_full_linear"]) + " |")
            return "\n".join(lines + served_threshold_rows(result, sim["layers"]))
    return ""


def served_threshold_rows(result: dict, layers: list[int]) -> list[str]:
    """Per dca setting: each layer's similarity as served (on what its inner backend stores) and, for its reuse
    candidates, the calibrated runtime thresholds at 1 / 16 / 1024 tokens."""
    lines = []
    for r in result["rows"]:
        details = r.get("details", {})
        if "served_similarity_by_layer" not in details:
            continue
        served = {int(k): v for k, v in details["served_similarity_by_layer"].items()}
        spans = {int(k): v for k, v in details["runtime_thresholds_by_layer"].items()}
        spec = echo_recorded(r["spec"])
        lines.append(f"| served similarity, `{spec}` | "
                     + " | ".join(f"{served[x]:.3f}" if x in served else "-" for x in layers) + " |")
        lines.append(f"| runtime threshold at 1 / 16 / 1024 tokens, `{spec}` | "
                     + " | ".join(f"{spans[x]['1']:.3f} / {spans[x]['16']:.3f} / {spans[x]['1024']:.3f}"
                                  if x in spans else "not a candidate" for x in layers) + " |")
    return lines


def short_label(row: dict) -> str:
    """A backend and its distinguishing settings, for plot legends."""
    skip = {"probe_interval", "residual"}
    params = format_options({k: v for k, v in row["params"].items() if k not in skip})
    return f"{row['backend']}({params})" if params else row["backend"]


def pareto_front(rows: list[dict]) -> list[dict]:
    """Settings no other setting beats on both compression (higher) and perplexity change (lower),
    ordered by compression."""
    front = [r for r in rows if not any(
        o["compression"] >= r["compression"] and o["perplexity_change_pct"] <= r["perplexity_change_pct"]
        and (o["compression"], o["perplexity_change_pct"]) != (r["compression"], r["perplexity_change_pct"])
        for o in rows)]
    return sorted(front, key=lambda r: r["compression"])


def style(row: dict, index: int) -> dict:
    """Plot style of one setting: a colour per backend (compositions share one), a marker per setting."""
    colours = {"full": "black", "gqa": "tab:red", "mla": "tab:blue", "int8": "tab:green", "dca": "tab:orange"}
    markers = "osD^vP*Xh<>p"
    return {"color": colours.get(row["backend"], "tab:purple"), "marker": markers[index % len(markers)]}


def plots(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    styles = [style(r, i) for i, r in enumerate(rows)]
    paths = []
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (r, st) in enumerate(zip(rows, styles)):
        ax.scatter(r["compression"], r["perplexity_change_pct"], s=45, label=f"{i + 1}. {short_label(r)}",
                   alpha=0.85, **st)
        ax.annotate(str(i + 1), (r["compression"], r["perplexity_change_pct"]), fontsize=7, xytext=(4, 3),
                    textcoords="offset points")
    front = pareto_front(rows)
    ax.plot([r["compression"] for r in front], [r["perplexity_change_pct"] for r in front], ls="--", lw=1,
            color="grey", zorder=0, label="frontier (best quality at each size)")
    changes = [r["perplexity_change_pct"] for r in rows]
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_ylim(min(-0.2, 2 * min(changes)), 3 * max(1.0, max(changes)))
    ax.set_xlabel("KV compression vs full (x, log scale)")
    ax.set_ylabel("held-out perplexity change (%, symlog)")
    ax.set_title("Quality vs memory: the trade-off frontier")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    paths.append(out / "frontier.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    for key, ylabel, fname, scale in (("tpot_s", "TPOT (ms)", "tpot_vs_context.png", 1000.0),
                                      ("bytes_vs_context", "KV bytes per sequence (MiB)", "kv_bytes_vs_context.png",
                                       1 / 2**20)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r, st in zip(rows, styles):
            xs = sorted(int(c) for c in r[key])
            ax.plot(xs, [r[key][c if c in r[key] else str(c)] * scale for c in xs], label=short_label(r),
                    ms=4, lw=1, **st)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        paths.append(out / fname)
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse, before any model is loaded, settings the run could not use.

    Raises:
        ValueError: one line naming the bad argument (an unknown backend or option, a count below 1,
            a prefix outside 1..1023, more prompts than the eval slice holds, a model folder without
            ``config.json``).
    """
    from transformers import AutoConfig

    for key in ("windows", "prompts", "new_tokens", "stream_tokens", "rounds"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1, got {getattr(args, key)}")
    budget = getattr(args, "budget", 1.0)
    if not math.isfinite(budget) or budget < 0:
        raise ValueError(f"--budget must be a finite number of percent, at least 0, got {budget:g}")
    if not 1 <= args.prefix < WINDOW:
        raise ValueError(f"--prefix must be between 1 and {WINDOW - 1} (windows are {WINDOW} tokens), got {args.prefix}")
    if args.prompts > MAX_PROMPTS:
        raise ValueError(f"--prompts must be at most {MAX_PROMPTS} (one per 1000 tokens of the eval slice)")
    if not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"--model {args.model}: no config.json in that folder")
    config = AutoConfig.from_pretrained(args.model)
    geometry = ModelGeometry.from_config(config, torch.float32)
    most = config.max_position_embeddings - needle.ANSWER_TOKENS
    if not 0 <= getattr(args, "needle_context", 0) <= most:
        raise ValueError(f"--needle-context must be between 0 (off) and {most} (the model's "
                         f"{config.max_position_embeddings} positions hold the prompt and the answer), "
                         f"got {args.needle_context}")
    check_long_context(args, config)
    for spec in args.backends or []:
        name, options = parse_spec(spec.removesuffix(BUDGETED))  # its errors name the spec
        budgeted = spec.endswith(BUDGETED) or name.endswith(BUDGETED)  # mla:rank=3@budget, mla@budget:rank=3
        if budgeted and options:
            raise ValueError(f"--backends {spec}: {BUDGETED} chooses the setting itself (within --budget) and takes "
                             f"no options: give {name.removesuffix(BUDGETED)}{BUDGETED} alone")
        try:
            create(name, geometry, **options)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"--backends {spec}: {exc.args[0] if exc.args else exc}") from None


def check_long_context(args: argparse.Namespace, config) -> None:
    """Refuse a ``--long-context`` the model cannot hold or the long input cannot be built at (its question, answers
    and scored tail need room: :func:`server.long_context.build_long_probe`), loading the tokenizer only when one is
    given.

    Raises:
        ValueError: one line naming ``--long-context`` and what is allowed.
    """
    from server.long_context import MIN_LONG_CONTEXT, build_long_probe

    length, most = getattr(args, "long_context", 0), config.max_position_embeddings
    if length == 0:
        return
    if not MIN_LONG_CONTEXT <= length <= most:
        allowed = (f"between {MIN_LONG_CONTEXT} and {most}" if most > MIN_LONG_CONTEXT else str(most)
                   if most == MIN_LONG_CONTEXT else f"nothing else: a long input is at least {MIN_LONG_CONTEXT} tokens")
        raise ValueError(f"--long-context must be 0 (off) or {allowed} (the model has {most} positions), got {length}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    try:
        build_long_probe(tokenizer, model_slice_ids(Path(args.model), CALIB_SLICE, tokenizer), length)
    except ValueError as exc:
        raise ValueError(f"--long-context {length}: {exc}") from None


def main(args: argparse.Namespace) -> int:
    for key, value in (QUICK if args.quick else DEFAULT).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    prog = args.__dict__.pop("prog", "kvserve bench")  # python -m bench.report names itself
    try:
        check_arguments(args)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"{prog}: --out {out}: {exc.strerror}", file=sys.stderr)
        return 2
    started = time.time()
    result = run(args)
    result["wall_s"] = time.time() - started
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    images = plots(result, out)
    cmd = command_line(args)
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
