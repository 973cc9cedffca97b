"""The shapes of kvserve's custom ops (``cache_backends/kernels/csrc/ops.cpp``) for tracing: ``torch.compile`` and
meta tensors see each op's output without running it (:func:`register_fakes`, once the library is loaded)."""

from __future__ import annotations

import torch


def register_fakes() -> None:
    """Shapes for tracing (``torch.compile``, meta tensors): (B, Hq, n, v_width) in the query's dtype ((B, H, n, r)
    for a native-MLA latent)."""
    if getattr(register_fakes, "done", False):
        return

    @torch.library.register_fake("kvserve::paged_attention")
    def _(query, arena, exact_table, q_table, ranges, layout, rotation, scaling):
        return query.new_empty(*query.shape[:-1], layout[2] if layout[20] else layout[3])  # a latent: r wide

    @torch.library.register_fake("kvserve::paged_latent_attention")
    def _(query, arena, exact_table, q_table, ranges, layout, key_up, key_mean, value_up, value_mean, positions,
          cos, sin, rotated_bases, scaling):
        return query.new_empty(query.shape)  # (B, Hq, n, head_dim)

    @torch.library.register_fake("kvserve::paged_dca_attention")
    def _(query, src_arena, src_exact_table, src_q_table, src_ranges, src_layout, src_positions, own_arena,
          own_exact_table, own_q_table, own_ranges, own_layout, own_positions, cuts, rotation, map_, latents, scaling):
        return query.new_empty(query.shape)

    @torch.library.register_fake("kvserve::skinny_linear")
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake("kvserve::paged_write")
    def _(arena, key, value, write_pages, write_slots, layout):
        return None

    @torch.library.register_fake("kvserve::paged_grouped_write")
    def _(arena, key, value, key_encode, value_encode, write_pages, write_slots, layout):
        return None

    @torch.library.register_fake("kvserve::paged_mapped_attention")
    def _(query, arena, exact_table, q_table, ranges, layout, rotation, query_map, output_map, scaling):
        return query.new_empty(*query.shape[:-1], output_map.shape[-1])

    @torch.library.register_fake("kvserve::paged_latent_write")
    def _(arena, key, value, positions, cos, sin, basis, mean, write_pages, write_slots, layout):
        return None

    register_fakes.done = True
