"""The quantized tiers' code formats, one row a code width (:data:`FORMATS`): how many codes a byte packs, the stored
codes' dtype and range, the cap on the scales' size, and so the rule a stream's width must keep.

No torch and nothing of ours: the declarations (``int8``/``int4``'s ``key_bits``/``value_bits``, ``elastic``'s
``bits``: their choices are :data:`BITS`), the width checks (:mod:`cache_backends.kv_spec`, the backends, the quality
budget's ranks), the byte counts and page slabs (:mod:`cache_backends.kv_spec`, :mod:`cache_backends.page_layout`)
and the kernels' packing (:mod:`cache_backends.quant`) all read it. A new width is one row here (the C++ attention
kernel, :mod:`cache_backends.kernels`, reads 8-bit and 4-bit codes only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_COUNT = {2: "two", 3: "three", 4: "four", 8: "eight"}


@dataclass(frozen=True)
class CodeFormat:
    """How a ``bits``-bit stream stores its codes.

    Attributes:
        bits: the code width.
        per_byte: codes packed in one byte; a stream of width ``w`` stores ``w / per_byte`` bytes per token and head
            (channel ``j + i * w / per_byte`` in bits ``[i * bits, (i + 1) * bits)`` of byte ``j``: halves, not
            neighbours, so unpacking is one concatenation).
        code_dtype: the name of the stored codes' torch dtype (``"int8"``, ``"uint8"``).
        code_min, code_max: the smallest and largest code (``value = code * scale + zero``).
        scale_max_bytes: bytes a scale or zero point may take at most (a 2-byte float where the model's dtype is
            wider); ``None``: the model's dtype.
    """

    bits: int
    per_byte: int
    code_dtype: str
    code_min: int
    code_max: int
    scale_max_bytes: int | None = None

    def code_bytes(self, codes: int) -> int:
        """Bytes of ``codes`` codes (a multiple of :attr:`per_byte`)."""
        return codes * self.bits // 8

    def scale_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one scale or zero point in a model of ``dtype_bytes``."""
        return dtype_bytes if self.scale_max_bytes is None else min(dtype_bytes, self.scale_max_bytes)

    def width_refusal(self, width: int, what: str) -> str | None:
        """Why a stream ``width`` channels wide cannot be packed in these codes (``what`` names the width in the
        sentence, e.g. ``"rank=65"``), else ``None``."""
        if width % self.per_byte == 0:
            return None
        multiple = "even" if self.per_byte == 2 else f"a multiple of {self.per_byte}"
        return (f"{self.bits}-bit codes pack {_COUNT.get(self.per_byte, self.per_byte)} channels per byte: {what} "
                f"must be {multiple}")


FORMATS: dict[int, CodeFormat] = {
    8: CodeFormat(8, per_byte=1, code_dtype="int8", code_min=-128, code_max=127),
    4: CodeFormat(4, per_byte=2, code_dtype="uint8", code_min=0, code_max=15, scale_max_bytes=2),
}
BITS = tuple(sorted(FORMATS))  # the code widths a bits option may take


def bits_choices(first: int | None = None) -> str:
    """The widths in words, ``first`` first: ``"4 or 8"``, ``bits_choices(8)``: ``"8 or 4"``."""
    order = sorted(BITS, key=lambda b: b != first)
    return ", ".join(map(str, order[:-1])) + f" or {order[-1]}"


def code_format(bits: int) -> CodeFormat:
    """The format of ``bits``-bit codes.

    Raises:
        ValueError: no format has that width.
    """
    try:
        return FORMATS[bits]
    except KeyError:
        raise ValueError(f"no {bits}-bit code format: bits must be {bits_choices()}") from None


def width_multiple(*bits: int) -> int:
    """What a stream's width must be a multiple of to be stored in codes of each of ``bits``."""
    return math.lcm(*(code_format(b).per_byte for b in bits)) if bits else 1


def width_refusal(width: int, what: str, *bits: int) -> str | None:
    """Why ``width`` channels cannot be stored in codes of each of ``bits`` (the first width that refuses it; ``what``
    names the width in the sentence), else ``None``."""
    for b in sorted(set(bits)):
        why = code_format(b).width_refusal(width, what)
        if why:
            return why
    return None
