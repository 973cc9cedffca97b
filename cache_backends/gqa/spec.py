"""``gqa``'s declaration: post-hoc head sharing (GQA, arXiv 2305.13245), calibrated per layer."""

from cache_backends.declaration import BackendDecl, Option
from cache_backends.sizes import Shape, per_head_streams


def default_gqa_groups(num_key_value_heads: int) -> int:
    """gqa's default shared K/V heads per layer: the largest divisor of ``num_key_value_heads`` that is at most a
    quarter of it (at least 1), e.g. 2 of 8, 1 of 3, 1 of 9 (a plain ``heads // 4`` would not divide 9)."""
    quarter = max(1, num_key_value_heads // 4)
    return max(g for g in range(1, quarter + 1) if num_key_value_heads % g == 0)


def _streams(shape: Shape, params: dict):
    groups, h = params["groups"], shape.num_key_value_heads
    if groups < 1 or h % groups:
        raise ValueError(f"gqa groups={groups} must divide num_key_value_heads={h}")
    return per_head_streams(shape, groups)


DECLARATIONS = (
    BackendDecl(
        name="gqa", backend="cache_backends.gqa.backend:GQABackend",
        summary="head sharing: fixed savings, quality cost grows with fewer groups",
        summary_busy="short context with high concurrency favours head sharing",
        options=(Option("groups", int, None, low=1, setting="kv_gqa_groups",
                        help="gqa: K/V heads kept (default num_kv_heads/4)."),
                 Option("method", str, "pca", choices=("pca", "mean"), setting="kv_gqa_method",
                        help="gqa: calibrated (pca) or mean pooling.")),
        rope_refusal="gqa fits its key codecs on keys un-rotated through one RoPE table for every layer",
        inners=("int8", "int4"), default_compositions=("gqa+int8",), calibrates=True, budget_axis="groups",
        order=1, estimate_defaults=lambda shape: {"groups": default_gqa_groups(shape.num_key_value_heads)},
        streams=_streams),
)
