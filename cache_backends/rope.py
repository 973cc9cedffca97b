"""Rotary position embedding (RoPE, Su et al., arXiv 2104.09864) helpers for backends that cache keys
before RoPE (``mla``) and re-apply it when attending.

Layout follows transformers' Llama: channel i pairs with channel i + head_dim/2 ("rotate_half").
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RopeTable:
    """cos/sin of every position up to ``max_positions``, taken from the model's own rotary module.

    Args:
        model: a transformers causal LM whose ``model.rotary_emb`` computes ``(cos, sin)``.
        max_positions: positions to precompute (the model's ``max_position_embeddings``).

    Raises:
        ValueError: if the model has no ``model.rotary_emb``.
    """

    def __init__(self, model, max_positions: int):
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        if rotary is None:
            raise ValueError("model has no model.rotary_emb: this backend needs a RoPE model")
        self.rotary = rotary
        self.param = next(model.parameters())
        self._build(max_positions)

    @classmethod
    def llama(cls, head_dim: int, positions: int, base: float = 10_000.0,
              dtype: torch.dtype = torch.float32) -> "RopeTable":
        """A table of plain RoPE (``theta_i = base^(-2i/d)``, transformers' Llama layout) without a model, ``positions``
        rows in ``dtype``: for benchmarks and tests of the backends that re-apply RoPE. It does not grow."""
        table = cls.__new__(cls)
        inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None]
        table.cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
        table.sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
        table.norm = (table.cos.float() ** 2 + table.sin.float() ** 2).to(dtype)
        return table

    def _build(self, max_positions: int) -> None:
        p = self.param
        positions = torch.arange(max_positions, device=p.device).unsqueeze(0)
        with torch.no_grad():
            cos, sin = self.rotary(torch.zeros(1, device=p.device, dtype=torch.float32), positions)
        self.cos = cos[0].to(p.dtype)  # (max_positions, head_dim)
        self.sin = sin[0].to(p.dtype)
        self.norm = (self.cos.float() ** 2 + self.sin.float() ** 2).to(p.dtype)  # attention_scaling², 1.0 by default

    def _cover(self, stop: int) -> None:
        """Grow the tables (doubling) so positions up to ``stop`` exist: a served context may be set
        longer than ``max_position_embeddings`` (``MAX_TOTAL_TOKENS``)."""
        if stop > self.cos.shape[0] and hasattr(self, "rotary"):
            self._build(max(stop, 2 * self.cos.shape[0]))

    def float_tables(self, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, (rows, head_dim) each in fp32 (the model dtype's values widened), rows covering the positions
        below ``stop``: what the attention kernel rotates rebuilt keys with (``mla``). Kept until the tables grow."""
        self._cover(stop)
        cached = getattr(self, "_float", None)
        if cached is None or cached[0].shape[0] != self.cos.shape[0]:
            cached = self._float = (self.cos.float().contiguous(), self.sin.float().contiguous())
        return cached

    def apply(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate ``x`` (..., seq_len, head_dim) as positions ``start .. start + seq_len - 1``."""
        n = x.shape[-2]
        self._cover(start + n)
        cos, sin = self.cos[start : start + n], self.sin[start : start + n]
        return x * cos + rotate_half(x) * sin

    def invert(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Undo :meth:`apply` exactly (rotation by the opposite angle)."""
        n = x.shape[-2]
        self._cover(start + n)
        cos, sin, norm = self.cos[start : start + n], self.sin[start : start + n], self.norm[start : start + n]
        return (x * cos - rotate_half(x) * sin) / norm

    def _at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin and norm at ``positions`` (B, T) → (B, 1, T, head_dim) each."""
        self._cover(int(positions.max()) + 1 if positions.numel() else 0)
        return (self.cos[positions][:, None], self.sin[positions][:, None], self.norm[positions][:, None])

    def apply_at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (B, heads, T, head_dim) token by token at ``positions`` (B, T) (a batch of sequences)."""
        cos, sin, _ = self._at(positions)
        return x * cos + rotate_half(x) * sin

    def invert_at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Undo :meth:`apply_at` exactly."""
        cos, sin, norm = self._at(positions)
        return (x * cos - rotate_half(x) * sin) / norm
