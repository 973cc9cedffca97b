"""``mla``'s declaration: a latent per token and layer (a calibrated basis on MHA/GQA models, the model's own
kv_lora_rank on native-MLA ones; MLA, arXiv 2405.04434; MHA2MLA, arXiv 2502.14837)."""

from cache_backends.declaration import BackendDecl, Option
from cache_backends.kv_spec import StreamSpec
from cache_backends.sizes import Shape


def _defaults(shape: Shape) -> dict:
    h, dk, dv = shape.num_key_value_heads, shape.k_head_dim, shape.v_head_dim
    return {"rank": shape.kv_lora_rank or (h * (dk + dv)) // 8, "rope_dim": shape.rope_dim if shape.kv_lora_rank else 0}


def _streams(shape: Shape, params: dict):
    width = shape.num_key_value_heads * (shape.k_head_dim + shape.v_head_dim)  # full's K and V per token
    if not 1 <= params["rank"] <= width:  # as the served backend refuses it: a latent as wide saves nothing
        raise ValueError(f"mla rank={params['rank']} must be between 1 and full's width per token, "
                         f"num_key_value_heads*(k_head_dim+v_head_dim)={width}")
    rope = params["rope_dim"]  # on native MLA: the model's latent and its rope key, each per channel
    return (StreamSpec(1, params["rank"]),) + ((StreamSpec(1, rope),) if rope else ())


DECLARATIONS = (
    BackendDecl(
        name="mla", backend="cache_backends.mla.backend:MLABackend",
        summary="a latent cache: large savings, quality depends on the rank",
        summary_long="memory-bound long context favours a latent cache",
        options=(Option("rank", int, None, low=1, setting="kv_mla_rank",
                        help="mla: latent width per token per layer."),
                 Option("rope_dim", int, 0, low=0, estimate_only=True)),
        rope_refusal="mla un-rotates and re-rotates keys through one RoPE table for every layer",
        inners=("int8", "int4"), default_compositions=("mla+int8",), native_mla=True, calibrates=True,
        budget_axis="rank", order=2, estimate_defaults=_defaults, streams=_streams),
)
