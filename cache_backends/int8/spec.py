"""``int8``'s and ``int4``'s declarations: KIVI-style quantized K/V (arXiv 2402.02750) with an exact residual
window, optionally Hadamard-rotated (QuaRot, arXiv 2404.00456). One backend, two default widths."""

from cache_backends.declaration import BackendDecl, MAX_GROUP, MAX_TOKENS, Option
from cache_backends.kv_spec import Quantization
from cache_backends.quant_formats import BITS, bits_choices


def _options(name: str, bits: int) -> tuple[Option, ...]:
    widths = bits_choices(bits)  # "8 or 4": this name's width first
    return (Option("group_size", int, 32, low=1, high=MAX_GROUP, setting=f"kv_{name}_group_size",
                   help=f"{name}: tokens per key quantization group."),
            Option("residual", int, 32, low=0, high=MAX_TOKENS, setting=f"kv_{name}_residual",
                   help=f"{name}: newest tokens kept in full precision."),
            Option("key_bits", int, bits, choices=BITS, setting=f"kv_{name}_key_bits",
                   help=f"{name}: bits per key code, {widths}."),
            Option("value_bits", int, bits, choices=BITS, setting=f"kv_{name}_value_bits",
                   help=f"{name}: bits per value code, {widths}"
                        + (" (4: vLLM's k8v4 mix)." if bits == 8 else ".")),
            Option("rotate", bool, False, setting=f"kv_{name}_rotate",
                   help=f"{name}: Hadamard-rotate K/V before quantizing (QuaRot)."))


def _tier(bits: int):
    return lambda p: Quantization(p["group_size"], p["residual"], p.get("key_bits", bits), p.get("value_bits", bits))


def _uncompressed(name: str):
    def reason(params: dict, n: int) -> str | None:
        residual, group = int(params.get("residual", 32)), int(params.get("group_size", 32))
        if n < residual + group:
            return (f"all {n} tokens within the {residual} newest tokens kept exact and the group of {group} forming "
                    f"before them: {name} quantizes from {residual + group} tokens on")
        return None
    return reason


DECLARATIONS = (
    BackendDecl(
        name="int8", backend="cache_backends.int8.backend:Int8Backend",
        summary="quantized K/V: near-lossless, a safe default under memory pressure",
        summary_long="memory-bound long context favours a quantized cache: near-lossless",
        options=_options("int8", 8), windowed_pool=True, order=3, extra_rows=("int8:value_bits=4",),
        estimate_defaults=lambda shape: {"group_size": 32, "residual": 32}, quantization=_tier(8),
        uncompressed=_uncompressed("int8")),
    BackendDecl(
        name="int4", backend="cache_backends.int8.backend:Int4Backend",
        summary="4-bit K/V: about twice int8's savings at a small, measurable quality cost",
        options=_options("int4", 4), windowed_pool=True, budget_axis="rotate", order=4, quantization=_tier(4),
        estimate_defaults=lambda shape: {"group_size": 32, "residual": 32, "key_bits": 4, "value_bits": 4},
        uncompressed=_uncompressed("int4")),
)
