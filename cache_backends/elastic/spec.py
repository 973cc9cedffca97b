"""``elastic``'s declaration: exact while the KV pool has room, the oldest tokens quantized on demand."""

from cache_backends.declaration import MAX_GROUP, MAX_TOKENS, BackendDecl, Metric, Option
from cache_backends.kv_spec import Quantization
from cache_backends.quant_formats import BITS, bits_choices
from cache_backends.sizes import Shape, per_head_streams
from cache_backends.kv_spec import KVSpec


def _least(shape: Shape, params: dict, dtype_bytes: int, seq_len: int) -> float:
    """Every compressible group quantized (the pool at its shortest): its tier with its window as the residual
    window; its most is ``full``'s."""
    tier = Quantization(params["group_size"], params["window"], params["bits"], params["bits"])
    return KVSpec(per_head_streams(shape), shape.num_layers, dtype_bytes, tier).bytes_per_token_per_layer(seq_len)


def _uncompressed(params: dict, n: int) -> str:
    return (f"the KV pool had room: elastic keeps all {n} tokens exact and quantizes its oldest tokens only when the "
            "pool runs out (KV_CACHE_BUDGET_BYTES)")


DECLARATIONS = (
    BackendDecl(
        name="elastic", backend="cache_backends.elastic.backend:ElasticBackend",
        summary="exact while the budget holds every token, int8 for the oldest tokens only under pressure (sized "
                "here fully compressed)",
        options=(Option("group_size", int, 32, low=1, high=MAX_GROUP, setting="kv_int8_group_size",
                        help="int8: tokens per key quantization group."),
                 Option("window", int, 32, low=0, high=MAX_TOKENS, setting="kv_elastic_window",
                        help="elastic: newest tokens of a sequence that stay exact when the pool runs short (its "
                             "group size is KV_INT8_GROUP_SIZE)."),
                 Option("bits", int, 8, choices=BITS, setting="kv_elastic_bits",
                        help=f"elastic: code width of the compressed tier, {bits_choices(8)}.")),
        size_is_range=True, order=5,
        quantization=lambda p: Quantization(p["group_size"], None, p["bits"], p["bits"], window=p["window"]),
        min_bytes_per_token=_least, uncompressed=_uncompressed,
        metrics=(Metric("kvserve_elastic_compressed_blocks", "counter", "elastic: KV blocks freed by re-encoding "
                        "exact tokens to int8 because the pool ran short.", "compressed_blocks",
                        title="elastic: blocks compressed"),
                 Metric("kvserve_elastic_preemptions_avoided", "counter", "elastic: times the pool ran out of blocks "
                        "and compressing made room instead of a preemption.", "preemptions_avoided",
                        title="elastic: preemptions avoided"))),
)
