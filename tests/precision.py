"""The device and dtypes the value tests run in, and the rule that compares values computed in them.

Selection (read here, once, by ``tests/conftest.py``): ``DEVICE`` (``cpu`` or ``cuda``; unset or ``auto``:
``cpu``, so a plain ``make test`` is the same on any machine) and ``DTYPE`` (``float32``, ``float16`` or
``bfloat16``; unset or ``auto``: float32 and bfloat16 on the CPU, bfloat16 and float16 on CUDA). Every
value test takes the argument ``precision`` (parametrized in ``tests/conftest.py``) and runs once per dtype,
with the model, the backends and every tensor it builds on that device in that dtype. ``make test-gpu``
runs them with ``DEVICE=cuda``.

Tolerance rule (:meth:`Precision.tol`): a value computed in a floating-point dtype carries a rounding
error proportional to the dtype's machine epsilon and to the magnitude of the values involved, so two
computations of the same quantity in another order (the cache path against the model's own forward, a
lossless backend against ``full``, attention over a stored form against attention over rebuilt K/V) may
differ by up to ``factor * eps(dtype) * max(1, scale)``: ``eps`` is ``torch.finfo(dtype).eps`` (fp32
1.2e-7, fp16 9.8e-4, bf16 7.8e-3), ``scale`` the magnitude the error grows with (the largest logit; for
attention, :meth:`Precision.assert_attention_close`), and the factor is stated once per kind of value
(:data:`LOGIT_FACTOR`, :data:`ATTENTION_FACTOR`) and is the same for every dtype: a bf16 tolerance is the
fp32 one times the ratio of the epsilons, never tuned by hand. Each factor is about 5x the largest error
measured on the CPU in units of ``eps * scale`` (fp32 is the worst case: bf16 and fp16 kernels accumulate
in fp32 and round once, so their errors stay under one eps).

Greedy tokens (:meth:`Precision.assert_greedy_agrees`): two correct computations in a low-precision
dtype may pick different tokens where the model's top two logits are closer than the tolerance, and
from there the sequences diverge for good. So greedy outputs are compared up to their first difference
only, and a difference is accepted only where the reference's top-2 logit margin at that position is
within :meth:`Precision.tol` of its logits (a near-tie); an agreeing output must agree token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.model_loading import DTYPES

LOGIT_FACTOR = 16
"""Logits after a whole forward pass, in eps of the largest logit. Measured: up to 2.9 in fp32 and 0.75 in
bf16 and fp16. For logits of ~13: 2.5e-5 in fp32, 0.21 in fp16, 1.6 in bf16."""
ATTENTION_FACTOR = 8
"""One attention output, in eps of ``max(1, max |score|) * max |value|``. Measured: up to 1.1 in fp32,
0.9 in bf16."""


@dataclass(frozen=True)
class Precision:
    """Where and in what dtype a value test computes.

    Args:
        device: the torch device.
        dtype: the floating-point dtype of the model, the backends and the test's own tensors.
    """

    device: torch.device
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{self.device.type}-{str(self.dtype).removeprefix('torch.')}"

    @property
    def eps(self) -> float:
        return torch.finfo(self.dtype).eps

    def tol(self, scale: float, factor: float = LOGIT_FACTOR) -> float:
        """``factor * eps * max(1, scale)``: the largest difference accepted for values of magnitude ``scale``."""
        return factor * self.eps * max(1.0, scale)

    def assert_close(self, got: torch.Tensor, want: torch.Tensor, factor: float = LOGIT_FACTOR, what: str = "",
                     scale: float | None = None, fp32_error: float = 0.0) -> None:
        """``got`` equals ``want`` within :meth:`tol` of ``scale`` (default: max |want|) plus ``factor *
        fp32_error`` (an error of arithmetic done in fp32 whatever the dtype), compared in float32."""
        assert got.shape == want.shape, (what, got.shape, want.shape)
        diff = (got.float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item() if scale is None else scale
        tol = self.tol(scale, factor) + factor * fp32_error
        assert diff <= tol, f"{what}: max |diff| {diff:.3g} > {tol:.3g} ({factor} eps of {self.dtype} x {scale:.3g})"

    def assert_attention_close(self, got: torch.Tensor, want: torch.Tensor, query: torch.Tensor, keys: torch.Tensor,
                               values: torch.Tensor, scaling: float, what: str = "", map_gain: float = 0.0) -> None:
        """Attention outputs ``got`` and ``want`` of ``query`` (1, Hq, 1, d) over ``keys``/``values``
        (1, H, T, d; GQA allowed) within ``ATTENTION_FACTOR`` eps of ``max(1, max |score|) * max |value|``:
        an error of eps * |score| in a softmax input moves the output by that times max |value| (the
        weighted sum itself adds eps * max |value|).

        ``map_gain``: where one side applies a linear map after attention and the other before it (dca's
        value map), in fp32 whatever the dtype, the map's rounding adds ``map_gain * eps(float32) *
        max |value|``, ``map_gain`` being the largest 2-norm of the weights that feed one output (independent
        roundings of its inputs add up in quadrature).
        """
        rep = query.shape[1] // keys.shape[1]
        scores = query.float() @ keys.float().repeat_interleave(rep, 1).transpose(-1, -2) * scaling  # (1, Hq, 1, T)
        top = values.float().abs().max().item()
        self.assert_close(got, want, ATTENTION_FACTOR, what, max(1.0, scores.abs().max().item()) * top,
                          map_gain * torch.finfo(torch.float32).eps * top)

    def randn(self, *shape: int, generator: torch.Generator) -> torch.Tensor:
        """Standard normal values drawn on the CPU (same draw on every device), in this device and dtype."""
        return torch.randn(*shape, generator=generator).to(self.device, self.dtype)

    def assert_greedy_agrees(self, model, prompt_ids: list[int], ours: list[int], ref: list[int]) -> None:
        """``ours`` equals ``ref`` (greedy continuations of ``prompt_ids``) up to their first difference, and
        that difference is a near-tie: ``model``'s top-2 logit margin there is within :meth:`tol`."""
        n = min(len(ours), len(ref))
        k = next((i for i in range(n) if ours[i] != ref[i]), None)
        if k is None:
            return
        ids = torch.tensor([prompt_ids + ref[:k]], device=self.device)
        with torch.no_grad():
            logits = model(ids).logits[0, -1].float()
        top = logits.topk(2).values
        margin, tol = (top[0] - top[1]).item(), self.tol(logits.abs().max().item())
        assert margin <= tol, (f"greedy tokens differ at step {k} where the top-2 margin {margin:.3g} > "
                               f"tolerance {tol:.3g}: ours {ours}, reference {ref}")


def selected(device: str | None, dtype: str | None) -> list[Precision]:
    """The precisions to test, from the ``DEVICE`` and ``DTYPE`` values (see the module docstring).

    Raises:
        ValueError: an unknown device or dtype, or ``cuda`` where no CUDA device is present (one line).
    """
    device = device or "auto"
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"DEVICE={device!r}: allowed auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        build = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None else
                 f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but sees no device")
        raise ValueError(f"DEVICE=cuda but no CUDA device is present ({build}); nothing was tested")
    where = torch.device("cpu" if device == "auto" else device)
    if dtype in (None, "", "auto"):
        names = ["float32", "bfloat16"] if where.type == "cpu" else ["bfloat16", "float16"]
    elif dtype in DTYPES:
        names = [dtype]
    else:
        raise ValueError(f"DTYPE={dtype!r}: allowed auto, {', '.join(DTYPES)}")
    return [Precision(where, DTYPES[name]) for name in names]
