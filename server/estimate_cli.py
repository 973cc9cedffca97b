"""``kvserve estimate``: KV-cache size from a model's config, without loading weights; for a model folder, each
row's price from the quality budget where the calibration cache holds one (:mod:`server.cached_prices`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cache_backends import catalog
from cache_backends.estimate import DTYPE_BYTES, PRESETS, Shape, bytes_per_token_per_layer, default_specs, estimate_rows
from cache_backends.spec import check_options, format_options, format_spec, parse_spec
from server.cached_prices import dtype_note, load_prices, price_text


DEFAULT_SPECS = default_specs()
"""Without specs: every backend (int8's k8v4 mix, 8-bit keys and 4-bit values, too) and the compositions the
backends list (:func:`cache_backends.estimate.default_specs`), at ``default_params`` for the model."""

DEFAULT_BLOCK_SIZE = 16
"""``KV_BLOCK_SIZE``'s default (:data:`server.engine.setup.DEFAULT_BLOCK_SIZE`, not imported: it imports torch)."""

ESTIMATE_ONLY = tuple(sorted({o.name for d in catalog.declarations().values() for o in d.options if o.estimate_only}))
"""Options only the sums take (a latent's rope width, ``dca``'s share of reused layers, measured when served)."""


def check_served(shape: Shape, spec: tuple[str, dict], dtype_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 block_flag: str | None = "--block-size") -> None:
    """Refuse ``spec`` as ``kvserve serve`` would on this model: the backend built with its options
    (:func:`cache_backends.registry.create`, less :data:`ESTIMATE_ONLY`) and its KV pool laid out at ``block_size``
    tokens a block (:func:`server.engine.kv_cache.page_layouts`, the backend served alone). A per-head spec named on a
    natively-MLA model is sized as its expanded K and V heads, which the server does not serve: not checked.

    ``block_flag``: the command's option that sets ``block_size`` (``estimate``'s ``--block-size``), or ``None``
    where it has none (``advise`` checks at the server's default): what a refusal of the layout names.

    Raises:
        ValueError: the server's own one-line message (a layout's with the block size and the option setting it;
            sinks over a page naming the spec's option, not the server's variables, which the command does not read).
    """
    import torch

    from cache_backends.geometry import ModelGeometry
    from cache_backends.registry import create
    from cache_backends.window.backend import SinksOverPage
    from server.engine.kv_cache import page_layouts

    name, options = spec
    if shape.kv_lora_rank and name not in catalog.native_mla_backends():
        return
    geometry = ModelGeometry(shape.num_layers, shape.num_key_value_heads, shape.num_key_value_heads, shape.k_head_dim,
                             dtype_bytes, shape.kv_lora_rank, shape.rope_dim, shape.layer_windows,
                             shape.rope_per_layer_type)
    backend = create(name, geometry, **{k: v for k, v in options.items() if k not in ESTIMATE_ONLY})
    dtype = {4: torch.float32, 2: torch.float16}.get(dtype_bytes)
    if dtype is None:  # fp8: no pool is served in it
        return
    try:
        page_layouts({name: backend}, dtype, block_size)
    except RuntimeError:  # dca knows its layout only once calibrated
        return
    except SinksOverPage as exc:
        at, fix = ((f"--block-size {block_size}", "raise --block-size") if block_flag else
                   (f"the default block of {block_size}", "check a larger block with kvserve estimate --block-size"))
        raise ValueError(f"{format_spec(*spec)}: sinks={exc.sinks} must fit one page of its sink tier ({exc.per} "
                         f"tokens a page at {at}): lower sinks or {fix}") from None
    except ValueError as exc:
        raise ValueError(f"{exc} (" + (f"{block_flag} is {block_size}" if block_flag else
                                       f"at the default block of {block_size} tokens") + ")") from None


def applies(shape: Shape, spec: tuple[str, dict], dtype_bytes: int) -> bool:
    """Whether kvserve can serve ``spec`` on this model and the sums size it (a natively-MLA model takes only
    :func:`cache_backends.catalog.native_mla_backends`: it hands its cache a latent, not per-head K/V; a model with
    sliding-window layers or RoPE per layer type only the backends that serve them; :func:`check_served`)."""
    from cache_backends.registry import serves_layer_kinds

    if shape.kv_lora_rank and spec[0] not in catalog.native_mla_backends():
        return False
    if not serves_layer_kinds(spec[0], bool(shape.layer_windows), shape.rope_per_layer_type):
        return False
    try:
        bytes_per_token_per_layer(shape, *spec, dtype_bytes, 1)
        check_served(shape, spec, dtype_bytes)
    except ValueError:
        return False
    return True


def resolve_specs(shape: Shape, specs: list[str] | None, dtype_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE,
                  block_flag: str | None = "--block-size") -> list[tuple[str, dict]]:
    """``specs`` parsed, each checked as the server checks it (:func:`check_served`, after the sums' own checks, at
    ``block_size`` set by the command's ``block_flag``); without any, :data:`DEFAULT_SPECS` less what this model
    cannot take.

    Raises:
        ValueError: for a malformed spec (see :func:`parse_spec`), or one the server refuses (its message).
    """
    if not specs:
        return [spec for spec in map(parse_spec, DEFAULT_SPECS) if applies(shape, spec, dtype_bytes)]
    parsed = [parse_spec(s) for s in specs]
    for spec in parsed:
        check_options(*spec)
        bytes_per_token_per_layer(shape, *spec, dtype_bytes, 1)  # the sums' own message first
        check_served(shape, spec, dtype_bytes, block_size, block_flag)
    return parsed


def _ints(text: str) -> list[int]:
    """A comma list of whole numbers >= 1 (argparse type)."""
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of whole numbers >= 1 (e.g. 4096,8192), got {text!r}")
    return values


def _positive_int(text: str) -> int:
    """One whole number >= 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def load_shape(model: str) -> Shape:
    """A preset name, a config.json, or a model folder holding one.

    Raises:
        ValueError: if it is none of these.
    """
    if model in PRESETS:
        return PRESETS[model]
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {model!r} is not a preset ({', '.join(PRESETS)}) nor a config.json or model folder")
    return Shape.from_config(json.loads(path.read_text()))


def over_positions(shape: Shape, lengths: list[int]) -> list[int]:
    """The context lengths in ``lengths`` longer than the model holds (its ``max_position_embeddings``; none for a
    preset, which has no limit of its own)."""
    return [n for n in lengths if shape.max_positions and n > shape.max_positions]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.2f} TiB"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-2-7b", help=f"preset ({', '.join(PRESETS)}), config.json or folder")
    p.add_argument("--seq-len", type=_ints, default="4096,8192,32768", help="comma list of context lengths (tokens)")
    p.add_argument("--batch", type=_ints, default="1,8,16", help="comma list of batch sizes")
    p.add_argument("--dtype", default="fp16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--block-size", type=_positive_int, default=DEFAULT_BLOCK_SIZE,
                   help=f"KV_BLOCK_SIZE a spec is checked at, as the server lays out its pool (default "
                        f"{DEFAULT_BLOCK_SIZE}): window's sinks must fit one page")
    p.add_argument("backends", nargs="*",
                   help="backend specs, e.g. full gqa:groups=8 mla:rank=512,rope_dim=64 int8 int4 int8:value_bits=4 "
                        "dca:reuse_fraction=0.5 "
                        f"(default: {' '.join(DEFAULT_SPECS)}, each at the estimator's defaults for the model)")
    p.add_argument("--json", action="store_true", help="print rows as JSON")


def main(args: argparse.Namespace) -> int:
    try:
        shape = load_shape(args.model)
        specs = resolve_specs(shape, args.backends, DTYPE_BYTES[args.dtype], args.block_size)
        rows = estimate_rows(shape, specs, args.seq_len, args.batch, DTYPE_BYTES[args.dtype])
    except ValueError as exc:
        print(f"kvserve estimate: {exc}", file=sys.stderr)
        return 2
    if over := over_positions(shape, args.seq_len):  # sums, not a deployment: shown, with the limit named
        print(f"kvserve estimate: warning: --seq-len {','.join(map(str, over))} is more than {args.model}'s "
              f"{shape.max_positions} positions (max_position_embeddings): the model cannot hold that context; "
              "those rows show what the cache would cost if it could", file=sys.stderr)
    book = load_prices(args.model)
    for row in rows:
        row["price_pct"], _, row["price_dtype"] = book.priced(row["backend"], row["params"], args.dtype)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"KV cache for {args.model} ({args.dtype})")
    for col in ("backend", "params", "seq_len", "batch", "bytes/token/layer", "total", "price"):
        table.add_column(col, justify="right" if col not in ("backend", "params", "price") else "left",
                         overflow="fold" if col in ("params", "price") else "ellipsis")  # wrapped, never cut off
    for r in rows:
        params = format_options(r["params"], ", ") or "-"
        per, total = f"{r['bytes_per_token_per_layer']:.0f}", human(r["total_bytes"])
        if "min_bytes_per_token_per_layer" in r:  # elastic: from every compressible group quantized to all exact
            per, total = f"{r['min_bytes_per_token_per_layer']:.0f}-{per}", f"{human(r['min_total_bytes'])}-{total}"
        price = price_text(r["price_pct"]) + (dtype_note(r["price_dtype"], args.dtype) if r["price_pct"] is not None
                                              else "")
        table.add_row(r["backend"], params, str(r["seq_len"]), str(r["batch"]), per, total, price)
    Console(width=120).print(table)
    print("price: the perplexity increase the quality budget measured for that setting on its calibration text, from\n"
          "the calibration cache (KV_CALIBRATION_CACHE_DIR); not priced: no server priced one there; (measured in\n"
          f"DTYPE): with the model in another dtype than {args.dtype}, the price shown is that dtype's")
    return 0
