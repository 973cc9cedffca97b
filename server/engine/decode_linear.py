"""The model's linear layers at decode: a step of a few rows through ``kvserve::skinny_linear``.

A decode step multiplies a handful of rows (one per running sequence) by every weight of the model. On the CPU
MKL's sgemm serves those shapes poorly between 3 and 12 rows: on SmolLM2-135M's layers, one thread, 6 rows cost
1.9x what 1 row costs, though the weights are read once either way. kvserve's kernel streams each weight once,
multiplies two of its rows by up to six rows of the input held in registers and reads ahead of its loads
(``cache_backends/kernels/csrc/linear_avx2.cpp``): about 1.3-1.5x faster there. One row (what ``generate()`` runs
at batch 1), two, and more than :data:`MAX_ROWS` (a prefill chunk) stay with ``torch.nn.functional.linear``, as
does anything that is not fp32 on the CPU, or that autograd must see.

:func:`install` gives a model's ``nn.Linear`` modules this forward (their class becomes :class:`DecodeLinear`,
their parameters untouched: the module replacement transformers' quantizers do, without new modules) where the
kernel loads and ``KV_ATTENTION`` is not ``torch``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cache_backends import kernels

MIN_ROWS, MAX_ROWS = 3, 12
"""Rows (the input's leading dimensions flattened) the kernel takes: below and above, MKL is as fast or faster."""


class DecodeLinear(nn.Linear):
    """``nn.Linear`` whose forward sends :data:`MIN_ROWS`-:data:`MAX_ROWS` rows of fp32 input on the CPU through
    ``kvserve::skinny_linear``: ``x`` (..., in_features) → (..., out_features), the same values as ``F.linear`` up
    to the order of the sums (about 1e-6 relative)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if (MIN_ROWS <= rows <= MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu"
                and kernels.mode() != "torch"  # the reference path, set after install too (kernels.using)
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return torch.ops.kvserve.skinny_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def install(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` a :class:`DecodeLinear` when kvserve's kernels serve its device
    (:func:`cache_backends.kernels.active`) and its weights are fp32; returns how many (0: nothing changed)."""
    param = next(model.parameters(), None)
    if param is None or param.dtype != torch.float32 or not kernels.active(param.device):
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.is_contiguous():
            module.__class__ = DecodeLinear
            count += 1
    return count
