"""``bench.mla_layer_ranks``'s per-layer rank allocations (pure functions of the layers' spectra)."""

from __future__ import annotations

import torch

from bench.mla_layer_ranks import equal_variance, kept, water_filling


def _spectrum(decay: float, n: int = 64) -> torch.Tensor:
    return torch.tensor([decay**i for i in range(n)], dtype=torch.float64)


def test_identical_layers_get_the_uniform_rank():
    specs = [_spectrum(0.9)] * 4
    assert equal_variance(specs, 4 * 20) == [20] * 4
    assert water_filling(specs, 4 * 20) == [20] * 4


def test_a_layer_whose_variance_sits_in_few_components_gets_a_smaller_rank():
    steep, flat = _spectrum(0.5), _spectrum(0.97)
    for allocate in (equal_variance, water_filling):
        ranks = allocate([steep, flat], 2 * 24)
        assert sum(ranks) <= 48 and ranks[0] < 24 < ranks[1], (allocate.__name__, ranks)
    ranks = equal_variance([steep, flat], 48)
    # a common share of each layer's variance is kept (to the rank's step)
    assert abs(kept(steep, ranks[0]) - kept(flat, ranks[1])) < 0.05


def test_every_layer_keeps_at_least_one_component():
    specs = [_spectrum(0.01), _spectrum(0.999)]
    assert min(water_filling(specs, 10)) >= 1 and min(equal_variance(specs, 10)) >= 1
