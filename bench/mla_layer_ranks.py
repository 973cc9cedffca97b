"""Does a rank per layer pay for post-hoc ``mla``? Uniform ranks against per-layer ranks of the same total bytes.

Post-hoc ``mla`` projects each layer's [K_pre ; V] (2 H d wide) onto its calibrated principal components
(:class:`cache_backends.mla.LatentBasis`). The quality budget picks one rank for every layer. The layers'
spectra differ, so a layer whose variance sits in fewer components could keep a smaller rank and another a
larger one for the same bytes. This benchmark measures whether that buys anything on the model at hand:

1. each layer's share of the calibration variance kept at rank ``r`` (the eigenvalues of [K_pre ; V]'s
   covariance on the calibration text, as the backend fits them);
2. for each uniform rank of ``--ranks``, a per-layer allocation with the same total width, chosen two ways:
   ``equal-variance`` (each layer keeps the smallest rank that keeps a common share of its variance, the share
   bisected so that the widths add up to the uniform total) and ``water-filling`` (the total width's largest
   eigenvalues over all layers, each layer's normalized by its trace);
3. each setting's price as the quality budget measures it (:class:`server.quality_price.Scorer`: the mean KL
   divergence from ``full`` on the calibration text's last windows, as a perplexity increase), and the held-out
   perplexity through the cache path (``bench.fidelity.cache_path_perplexity``) of the eval slice.

The per-layer settings are priced by zeroing each layer's basis columns past its rank, in a backend fitted at
full width: the same latent the narrower basis would store, since the columns are ordered by eigenvalue. The
served pool lays out one latent width per block, so a per-layer setting is priced here, not served.

Writes ``mla_layer_ranks.json`` and ``mla_layer_ranks.md`` to ``--out``. Run:
``python -m bench.mla_layer_ranks --model models/smollm2-135m-instruct``. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.fidelity import cache_path_perplexity
from bench.quality import CALIB_SLICE, EVAL_SLICE, model_slice_ids
from cache_backends.geometry import ModelGeometry
from cache_backends.calibration import collect_kv
from cache_backends.registry import create


def spectra(model, geometry: ModelGeometry, ids: list[int]) -> list[torch.Tensor]:
    """Per layer, the eigenvalues (2 H d,) of [K_pre ; V]'s calibration covariance, largest first (float64)."""
    out = []
    for k, v in collect_kv(model, geometry, ids, desc="spectra"):
        x = torch.cat([k.flatten(1), v.flatten(1)], dim=1).double()
        xc = x - x.mean(0)
        out.append(torch.linalg.eigvalsh(xc.T @ xc).flip(0).clamp_min(0))
    return out


def kept(spec: torch.Tensor, rank: int) -> float:
    """Share of a layer's variance its top ``rank`` components keep."""
    return (spec[:rank].sum() / spec.sum()).item()


def equal_variance(specs: list[torch.Tensor], total: int) -> list[int]:
    """Per-layer ranks keeping a common share of each layer's variance, their sum as close to ``total`` as the
    share's bisection gets without exceeding it."""
    cums = [(s.cumsum(0) / s.sum()) for s in specs]

    def ranks(share: float) -> list[int]:
        return [min(len(c), int((c < share).sum().item()) + 1) for c in cums]

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(ranks(mid)) <= total else (lo, mid)
    return ranks(lo)


def water_filling(specs: list[torch.Tensor], total: int) -> list[int]:
    """Per-layer ranks taking the ``total`` largest trace-normalized eigenvalues over all layers (at least 1 each)."""
    values = torch.cat([s / s.sum() for s in specs])
    layer = torch.cat([torch.full((len(s),), i) for i, s in enumerate(specs)])
    top = layer[values.argsort(descending=True)[:total]]
    return [max(1, int((top == i).sum().item())) for i in range(len(specs))]


def with_ranks(backend, ranks: list[int]):
    """``backend`` (post-hoc mla fitted at full width) with layer i's basis columns past ``ranks[i]`` zeroed."""
    for basis, r in zip(backend.bases, ranks):
        basis.basis = basis.basis.clone()  # the loaded basis may be shared with the calibration cache
        basis.basis[:, r:] = 0
    return backend


def main(argv: list[str] | None = None) -> int:
    from server.model_loading import load_model
    from server.quality_price import Scorer

    parser = argparse.ArgumentParser(prog="python -m bench.mla_layer_ranks", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--ranks", type=int, nargs="+", default=[240, 288, 336],
                        help="uniform ranks to compare (each against per-layer ranks of the same total)")
    parser.add_argument("--windows", type=int, default=2, help="held-out 1024-token windows (default 2)")
    parser.add_argument("--prefix", type=int, default=768, help="tokens prefilled per held-out window")
    parser.add_argument("--out", default="docs/bench/real")
    args = parser.parse_args(argv)

    began = time.perf_counter()
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, torch.device("cpu"), torch.float32)
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    calib = model_slice_ids(Path(args.model), CALIB_SLICE, tokenizer)
    heldout = model_slice_ids(Path(args.model), EVAL_SLICE, tokenizer)
    width = 2 * geometry.num_key_value_heads * geometry.head_dim
    specs = spectra(model, geometry, calib)
    scorer = Scorer(model, geometry, calib)
    full_ppl = cache_path_perplexity(model, create("full", geometry), heldout, window=1024, prefix=args.prefix,
                                     max_windows=args.windows)
    rows = []
    for uniform in args.ranks:
        total = uniform * geometry.num_layers
        for how, ranks in (("uniform", [uniform] * geometry.num_layers),
                           ("equal-variance", equal_variance(specs, total)),
                           ("water-filling", water_filling(specs, total))):
            backend = create("mla", geometry, rank=width)
            backend.prepare(model, calib)
            with_ranks(backend, ranks)
            price = scorer.price(backend)
            ppl = cache_path_perplexity(model, backend, heldout, window=1024, prefix=args.prefix,
                                        max_windows=args.windows)
            row = {"uniform_rank": uniform, "allocation": how, "ranks": ranks, "total_width": sum(ranks),
                   "compression": width * geometry.num_layers / sum(ranks),
                   "calibration_price_pct": price.ppl_increase_pct, "kl": price.kl,
                   "heldout_ppl": ppl, "heldout_change_pct": 100 * (ppl / full_ppl - 1)}
            rows.append(row)
            print(f"{how:>14} @ {uniform}: total {sum(ranks)}, price +{price.ppl_increase_pct:.2f}%, "
                  f"held-out {row['heldout_change_pct']:+.2f}%", flush=True)
    result = {"model": args.model, "width": width, "layers": geometry.num_layers, "full_heldout_ppl": full_ppl,
              "kept_at_uniform": {r: [round(kept(s, r), 5) for s in specs] for r in args.ranks},
              "rows": rows, "minutes": (time.perf_counter() - began) / 60}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mla_layer_ranks.json").write_text(json.dumps(result, indent=1))
    (out / "mla_layer_ranks.md").write_text(report(result, args))
    print(report(result, args))
    return 0


def report(result: dict, args) -> str:
    lines = ["# mla: uniform against per-layer ranks", "",
             f"Command: `python -m bench.mla_layer_ranks --model {result['model']} --ranks "
             f"{' '.join(str(r) for r in args.ranks)}`.", "",
             f"Model `{result['model']}`: {result['layers']} layers, [K_pre ; V] {result['width']} wide; `full`'s "
             f"held-out perplexity {result['full_heldout_ppl']:.3f} ({args.windows} windows of 1024 tokens, the last "
             f"{1024 - args.prefix} of each scored). Price: the quality budget's (KL on the calibration text, as a "
             f"perplexity increase). {result['minutes']:.1f} min.", "",
             "| uniform rank | allocation | total width | compression | calibration price | held-out Δ ppl | "
             "smallest / largest layer rank |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['uniform_rank']} | {r['allocation']} | {r['total_width']} | {r['compression']:.2f}x | "
                     f"+{r['calibration_price_pct']:.2f}% | {r['heldout_change_pct']:+.2f}% | "
                     f"{min(r['ranks'])} / {max(r['ranks'])} |")
    lines += ["", "Share of each layer's calibration variance kept at a uniform rank:", ""]
    for rank, shares in result["kept_at_uniform"].items():
        lines.append(f"- rank {rank}: min {min(shares):.4f} (layer {shares.index(min(shares))}), "
                     f"max {max(shares):.4f} (layer {shares.index(max(shares))})")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
