"""``dca``'s similarity of a layer to its prediction (the mean cosine of K and of V) and what calibration derives
from it: per-span runtime thresholds and the reuse candidates."""

from __future__ import annotations

import torch

from cache_backends.dca.plan import SPANS

def token_similarity(own_k, own_v, pred_k, pred_v) -> torch.Tensor:
    """Per token, (cos(K) + cos(V)) / 2 averaged over heads: (1, H, n, d) inputs → (n,) float32 on the CPU.

    Raises:
        ValueError: for inputs of another layout (e.g. calibration's (tokens, H, d): use :func:`similarity`).
    """
    if own_k.dim() != 4 or own_k.shape[0] != 1:
        raise ValueError(f"token_similarity takes (1, H, n, d) inputs; got {tuple(own_k.shape)}")
    cos = torch.nn.functional.cosine_similarity
    both = cos(own_k.float(), pred_k.float(), dim=-1) + cos(own_v.float(), pred_v.float(), dim=-1)  # (1, H, n)
    return (0.5 * both.mean(1)[0]).cpu()


def similarity(own_k, own_v, pred_k, pred_v) -> float:
    """(cos(K) + cos(V)) / 2, each the mean over tokens and heads, for inputs of any layout whose last dimension
    is the head dimension: (1, H, n, d) as served (the mean of :func:`token_similarity`) or (tokens, H, d) as
    calibration collects them."""
    cos = torch.nn.functional.cosine_similarity
    both = cos(own_k.float(), pred_k.float(), dim=-1) + cos(own_v.float(), pred_v.float(), dim=-1)  # (..., H)
    return (0.5 * both).mean().item()


QUANTILE = 0.01  # a layer's runtime threshold: this quantile of its calibrated similarity over such spans


def span_thresholds(per_window: list[torch.Tensor], quantile: float = QUANTILE) -> dict[int, float]:
    """One layer's runtime thresholds: for each span n of :data:`SPANS`, the ``quantile`` of the mean
    per-token similarity over contiguous n-token spans of the calibration windows (each (tokens,)).
    Short spans vary more than long ones, so their thresholds are lower; a span longer than every window
    takes the windows' own means."""
    out = {}
    for n in SPANS:
        means = [w[: len(w) // n * n].reshape(-1, n).mean(1) for w in per_window if len(w) >= n]
        means = torch.cat(means) if means else torch.stack([w.mean() for w in per_window])
        out[n] = round(torch.quantile(means.double(), quantile).item(), 4)
    return out


def select_reuse_layers(mean_similarity: dict[int, float], threshold: float) -> list[int]:
    """The reuse candidates: the largest set of layers with calibrated similarity >= ``threshold`` in which no
    two are adjacent (a reuse layer's source must keep its own K/V); among equally large sets, the one with the
    highest summed similarity. Exact (dynamic programming over the layers in order)."""
    best = {0: (0, 0.0, [])}  # by "previous layer chosen" (1/0): (count, summed similarity, layers)
    best[1] = (-1, 0.0, [])
    for layer in sorted(mean_similarity):
        s = mean_similarity[layer]
        skip = max(best[0], best[1], key=lambda c: (c[0], c[1]))
        take = (best[0][0] + 1, best[0][1] + s, best[0][2] + [layer]) if s >= threshold else (-1, 0.0, [])
        best = {0: skip, 1: take}
    return max(best[0], best[1], key=lambda c: (c[0], c[1]))[2]
