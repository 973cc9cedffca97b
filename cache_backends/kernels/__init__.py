"""kvserve's C++ attention kernel: one op per layer that reads a step's K/V in place from the paged pool.

``torch.ops.kvserve.paged_attention`` (``csrc/ops.cpp``) attends a step's queries over one layer's pages through the
block tables, in every stored form a K/V pair of streams takes: exact pages (fp32, bf16, fp16), the int8 family
(int8 keys per channel over token groups and values per token, int4 two codes a byte, k8v4, a Hadamard-rotated tier
scored with the query rotated instead of the keys) with the exact residual window in the same call; and a native-MLA
model's own entries (DeepSeek-V2/V3: its latent c_KV and shared rope key, in exact pages, or under ``mla+int8`` /
``mla+int4`` both quantized per channel over token groups, rotated or not, with their exact residual window) with
absorbed attention (DeepSeek-V2, arXiv 2405.04434, section 2.1.2): multi-query attention of every head's query, W_UK
folded in, over the key (c_t, k_rope_t) and the value c_t, W_UV applied by the caller
(:func:`cache_backends.absorbed_mla.absorbed_attention`). ``torch.ops.kvserve.paged_latent_attention`` attends a
post-hoc latent (``mla`` on an MHA/GQA model, exact or ``mla+int8`` / ``mla+int4``, :func:`latent_attention`): each
KV head's keys rebuilt block by block inside the op and rotated at each token's position, the values absorbed.
``paged_mapped_attention`` is ``paged_attention`` with ``gqa``'s read-backs around it (:func:`mapped_attention`);
``paged_grouped_write`` and ``paged_latent_write`` encode a step's new K/V into ``gqa``'s shared heads or a post-hoc
latent and write them (:func:`grouped_write`, :func:`latent_write`), so every backend's decode step is two ops a layer.
``torch.ops.kvserve.paged_dca_attention`` attends a ``dca`` reuse layer (:func:`dca_attention`): its source's pages
with the layer's map folded in and its own pages (K/V pairs, or ``dca+mla``'s post-hoc latents), merged into one
softmax. All query heads of one KV head are scored together (GQA),
the softmax is computed online (FlashAttention, arXiv 2205.14135), decode rows of different lengths and the tokens
of a prefill chunk go through the same call (each query token's visible tokens are intervals,
:attr:`cache_backends.step_meta.StepMeta.ranges`), and the work (row, KV head, query tile) is split over the
engine's threads. It copies no page: vLLM's paged attention (Kwon et al., arXiv 2309.06180) on the CPU, with
llama.cpp's and onnxruntime's habit of reading quantized K/V without a dequantized copy of the context.

It is compiled from ``csrc/`` with ``torch.utils.cpp_extension`` once per source version and torch version, into
``KVSERVE_KERNELS_DIR`` (default ``~/.cache/kvserve/kernels``), by ``make install`` / ``make test``, the Docker
image's build stage, or the first server that needs it; a build found there is loaded without a compiler. The
instruction set is chosen when it loads: AVX2 + FMA + F16C where the CPU reports them, portable C++ elsewhere.
Where it cannot be built or loaded, or the device is not the CPU, the torch path (:mod:`cache_backends.paged`'s
gathers and :mod:`cache_backends.paged_attention`) serves; :func:`status` says which, and why.

``KV_ATTENTION`` chooses: ``auto`` (the kernel where it loads, else torch), ``kernel`` (the kernel or a start-up
error), ``torch`` (today's reference path).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

from cache_backends.kernel_fakes import register_fakes

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("ops.cpp", "attention_avx2.cpp", "attention_portable.cpp", "linear_avx2.cpp")
HEADERS = ("paged_args.h", "attention_impl.h")
CFLAGS = ("-O3", "-std=c++17", "-fopenmp", "-fno-math-errno")
MODES = ("auto", "kernel", "torch")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lock = threading.Lock()
_state: dict = {"loaded": None, "error": None, "mode": os.environ.get("KV_ATTENTION", "auto")}


def build_dir() -> Path:
    """Where builds are kept: ``$KVSERVE_KERNELS_DIR`` or ``~/.cache/kvserve/kernels``, one folder per version of
    the sources, compiler flags and torch (:func:`build_key`)."""
    root = os.environ.get("KVSERVE_KERNELS_DIR") or Path.home() / ".cache" / "kvserve" / "kernels"
    return Path(root) / build_key()


def build_key() -> str:
    """A short hash of the sources, the flags and torch's version: a build is reused only by the same three."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(torch.__version__.encode())
    return f"torch{torch.__version__.split('+')[0]}-{h.hexdigest()[:16]}"


def _library(folder: Path) -> Path:
    return folder / "kvserve_kernels.so"


def build(verbose: bool = False) -> Path:
    """Compile the kernels into :func:`build_dir` (nothing to do when a build is there) and return the library.

    Raises:
        RuntimeError: when the compiler or ninja is missing or the build fails (its output in the message).
    """
    folder = build_dir()
    lib = _library(folder)
    if lib.exists():
        return lib
    from torch.utils import cpp_extension  # noqa: PLC0415 - only a build needs it

    folder.mkdir(parents=True, exist_ok=True)
    bin_dir = str(Path(sys.executable).parent)  # ninja from the environment's own `ninja` package
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        cpp_extension.load(name="kvserve_kernels", sources=[str(CSRC / s) for s in SOURCES],
                           extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"], build_directory=str(folder),
                           is_python_module=False, verbose=verbose)
    except Exception as exc:  # the compiler's output is in the exception: the caller reports it
        raise RuntimeError(f"building kvserve's attention kernel failed: {exc}") from exc
    if not lib.exists():
        raise RuntimeError(f"building kvserve's attention kernel left no {lib.name} in {folder}")
    return lib


def load() -> bool:
    """Load the kernels (building them first when no build matches), once per process; ``True`` when loaded. A
    failure is remembered and reported by :func:`status`, never raised."""
    with _lock:
        if _state["loaded"] is None:
            try:
                lib = build()
                if not hasattr(torch.ops.kvserve, "paged_attention"):
                    torch.ops.load_library(str(lib))
                register_fakes()
                _state["loaded"] = True
            except Exception as exc:  # noqa: BLE001 - any failure means the torch path serves
                _state["loaded"], _state["error"] = False, str(exc).strip().splitlines()[0][:300]
                log.warning("kvserve's attention kernel is not available (%s)%s", _state["error"],
                            "" if _state["mode"] == "kernel" else ": the torch path serves")
        return _state["loaded"]


def configure(mode: str) -> None:
    """Set ``KV_ATTENTION``: ``auto``, ``kernel`` or ``torch``.

    Raises:
        ValueError: for another value, or for ``kernel`` when the kernel cannot be loaded here (the reason in the
            message): a setting this machine cannot take.
    """
    if mode not in MODES:
        raise ValueError(f"KV_ATTENTION={mode!r} must be one of {', '.join(MODES)}")
    _state["mode"] = mode
    if mode == "kernel" and not load():
        raise ValueError(f"KV_ATTENTION=kernel, but the attention kernel cannot be loaded here ({_state['error']}); "
                         f"KV_ATTENTION=auto serves through the torch path instead")


@contextlib.contextmanager
def using(mode: str):
    """Run a block with ``KV_ATTENTION`` set to ``mode`` (:func:`configure`), then restore the previous mode (the
    tests compare the two paths with it)."""
    before = _state["mode"]
    configure(mode)
    try:
        yield
    finally:
        _state["mode"] = before


@contextlib.contextmanager
def exact_sums(on: bool = True):
    """Run a block with ``KVSERVE_KERNEL_EXACT_SUMS=1`` (``on``) or unset: with it (any value but empty or ``0``)
    the kernel scores a decode's
    4-bit keys in fp32, as the torch path does, instead of in integers (the query, the key group's scales folded
    in, rounded to int8 once per group and multiplied with the codes in int8 dot products, as llama.cpp's CPU flash
    attention scores its quantized keys). The kernel reads the variable on every call; the tests,
    ``bench.longctx --paths kernel-exact`` and ``bench.exact_sums`` compare the two with it."""
    before = os.environ.pop("KVSERVE_KERNEL_EXACT_SUMS", None)
    if on:
        os.environ["KVSERVE_KERNEL_EXACT_SUMS"] = "1"
    try:
        yield
    finally:
        os.environ.pop("KVSERVE_KERNEL_EXACT_SUMS", None)
        if before is not None:
            os.environ["KVSERVE_KERNEL_EXACT_SUMS"] = before


def mode() -> str:
    """``KV_ATTENTION`` as set now: ``auto``, ``kernel`` or ``torch`` (:func:`configure`, :func:`using`)."""
    return _state["mode"]


def active(device) -> bool:
    """Whether steps on ``device`` attend through the kernel (loading it on first use)."""
    if _state["mode"] == "torch" or torch.device(device).type != "cpu":
        return False
    return load()


def reads(views) -> bool:
    """Whether the kernel reads and writes a pool's pages in place: active on its device (:func:`active`) and
    fitting its layout (:func:`fits`)."""
    return active(views.arena.device) and fits(views.layout)


def status(device="cpu") -> dict:
    """What attends a step on ``device``, for the start-up log and ``/info``: ``{"path": "cpu-kernel" | "torch",
    "isa": "avx2" | "portable" | None, "reason": str | None}``, and with the kernel ``"int4_key_scores": "int8" |
    "fp32"``: how a decode scores 4-bit keys (int8 dot products on AVX2 unless :func:`exact_sums`)."""
    if _state["mode"] == "torch":
        return {"path": "torch", "isa": None, "reason": "KV_ATTENTION=torch"}
    if torch.device(device).type != "cpu":
        return {"path": "torch", "isa": None, "reason": f"the kernel is CPU-only; the device is {device}"}
    if not load():
        return {"path": "torch", "isa": None, "reason": _state["error"]}
    isa = torch.ops.kvserve.kernel_isa()
    exact = os.environ.get("KVSERVE_KERNEL_EXACT_SUMS", "") not in ("", "0")
    return {"path": "cpu-kernel", "isa": isa, "reason": None,
            "int4_key_scores": "int8" if isa == "avx2" and not exact else "fp32"}


def layout_args(layout, layer: int) -> list[int]:
    """The op's ``layout`` argument for one layer of a :class:`cache_backends.page_layout.PageLayout`: page bytes,
    heads, the two streams' widths, the exact tier's dtype, tokens per page and slab offsets, the quantized tier's
    (tokens per page, group size, each stream's bits and scale dtype, slab offsets; zeros when there is none), and
    the form: 0 for keys and values, 1 for a native-MLA model's latent and rope key (:func:`is_latent`; quantized,
    both per channel: the second stream's scales are per group and channel, not per token), 2 for a post-hoc latent
    (:func:`is_posthoc_latent`: one stream, the second's entries zero)."""
    if is_posthoc_latent(layout):
        (k,) = layout.exact_slabs[layer]
        args = [layout.page_bytes, k.heads, k.width, 0, _DTYPES[layout.dtype], layout.exact_tokens, k.offset, 0]
        q = layout.quantization
        if not q:
            return args + [0] * 12 + [2]
        ((kc, ks, kz),) = layout.q_slabs[layer]
        return args + [layout.q_tokens, q.group_size, q.bits(layout.streams[0].axis), 0, _DTYPES[ks.dtype], 0,
                       kc.offset, ks.offset, kz.offset, 0, 0, 0, 2]
    k, v = layout.exact_slabs[layer]
    args = [layout.page_bytes, k.heads, k.width, v.width, _DTYPES[layout.dtype], layout.exact_tokens, k.offset,
            v.offset]
    q, form = layout.quantization, int(is_latent(layout))
    if not q:
        return args + [0] * 12 + [form]
    (kc, ks, kz), (vc, vs, vz) = layout.q_slabs[layer]
    k_spec, v_spec = layout.streams
    return args + [layout.q_tokens, q.group_size, q.bits(k_spec.axis), q.bits(v_spec.axis), _DTYPES[ks.dtype],
                   _DTYPES[vs.dtype], kc.offset, ks.offset, kz.offset, vc.offset, vs.offset, vz.offset, form]


def is_latent(layout) -> bool:
    """Whether a layout holds a native-MLA model's own entries: its latent c_KV and its shared rope key, one head
    each, both grouped per channel (``full`` and ``mla`` on a DeepSeek-style model)."""
    streams = layout.streams
    return len(streams) == 2 and all(s.heads == 1 and s.axis == "channel" for s in streams)


def is_posthoc_latent(layout) -> bool:
    """Whether a layout holds a post-hoc latent: one stream of one head (``mla`` and ``mla+int8`` / ``mla+int4`` on an
    MHA/GQA model, :class:`cache_backends.mla.MLABackend`), read by :func:`latent_attention`."""
    streams = layout.streams
    return len(streams) == 1 and streams[0].heads == 1


def fits(layout) -> bool:
    """Whether a page layout is one the kernel reads, in fp32/bf16/fp16: two streams, keys per channel and values
    per token with as many heads, a rotated tier only with keys and values as wide; or a native-MLA latent and rope
    key (absorbed attention), in exact pages or quantized (``mla+int8``, ``mla+int4``, rotated or not); or a post-hoc
    latent (:func:`is_posthoc_latent`), in exact pages or quantized per channel, rotated or not."""
    streams = layout.streams
    if layout.dtype not in _DTYPES:
        return False
    if is_posthoc_latent(layout):
        return streams[0].axis == "channel"
    if len(streams) != 2:
        return False
    if is_latent(layout):
        return True
    q = layout.quantization
    k, v = streams
    if k.axis != "channel" or v.axis != "token" or k.heads != v.heads:
        return False
    return not (q and q.rotate and k.width != v.width)


def paged_attention(query: torch.Tensor, keys, values, meta, scaling: float) -> torch.Tensor:
    """Attention of a step's queries over one layer's K/V read in place from the pool, in one op.

    Args:
        query: (B, Hq, n, d) after RoPE, Hq a multiple of the layer's KV heads; on a native-MLA latent
            (:func:`is_latent`) (B, H, n, r + rope): each head's query with W_UK folded in, then its rope part.
        keys, values: the layer's :class:`cache_backends.paged.InPlaceRead` (the pool's views and the layer); on a
            native-MLA latent, its latent and rope key.
        meta: the step's :class:`cache_backends.step_meta.StepMeta` (block tables, :attr:`ranges`).
        scaling: the softmax scale.

    Returns:
        (B, Hq, n, dv) in the query's dtype; on a native-MLA latent (B, H, n, r), the weighted sum of the latent
        (W_UV is applied by the caller, :func:`cache_backends.absorbed_mla.absorbed_attention`).
    """
    views, layer = keys.views, keys.layer
    args = _layer_args(views, layer)
    q = views.layout.quantization
    rotation = None
    if q and q.rotate and meta.q_width:
        rotation = _rotation(args[2], args[3] if args[20] else 0, query.device)
    return torch.ops.kvserve.paged_attention(query, views.arena, meta.exact_table, meta.q_table, meta.ranges, args,
                                             rotation, scaling)


def mapped_attention(query: torch.Tensor, keys, values, meta, scaling: float, query_map: torch.Tensor,
                     output_map: torch.Tensor) -> torch.Tensor:
    """``gqa``'s attention (post-hoc head sharing; GQA, arXiv 2305.13245) over its shared heads' pages read in place,
    in one op: each query head's key read-back folded into its query (``q_h M_h^T``), :func:`paged_attention` over
    the G shared heads, each head's value read-back applied to its output (``o_h O_h``).

    Args:
        query: (B, Hq, n, d) after RoPE.
        keys, values: the layer's :class:`cache_backends.paged.InPlaceRead` (G shared heads).
        query_map: (Hq, e, d), output_map: (Hq, e, d): each query head's key and value read-back.

    Returns:
        (B, Hq, n, d) in the query's dtype.

    Raises:
        RuntimeError: (from the op) for maps that do not fit the query or the layout.
    """
    views, layer = keys.views, keys.layer
    args = _layer_args(views, layer)
    q = views.layout.quantization
    rotation = _rotation(args[2], 0, query.device) if q and q.rotate and meta.q_width else None
    return torch.ops.kvserve.paged_mapped_attention(query, views.arena, meta.exact_table, meta.q_table, meta.ranges,
                                                    args, rotation, query_map, output_map, scaling)


def latent_attention(query: torch.Tensor, latent, meta, scaling: float, bases: tuple, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
    """Attention of a step's queries over one layer's post-hoc latent (``mla`` on an MHA/GQA model; Palu, arXiv
    2407.21118; MHA2MLA, arXiv 2502.14837) read in place from the pool, in one op. Each KV head's keys are rebuilt
    block by block inside the op, ``RoPE_pos(c_t P_k,h + mu_k,h)`` at each token's position (the RoPE on every key
    channel keeps P_k,h out of the query). The values are absorbed, ``(Σ_t p_t c_t) P_v,h + mu_v,h`` once a row,
    or, where a tile's rows outnumber what that saves (a prefill chunk at a rank above head_dim), rebuilt block by
    block: nothing the size of the context is written either way.

    Args:
        query: (B, Hq, n, d) after RoPE, Hq a multiple of H.
        latent: the layer's :class:`cache_backends.paged.InPlaceRead` of the latent stream.
        meta: the step's :class:`cache_backends.step_meta.StepMeta` (block tables, :attr:`ranges`, :attr:`positions`).
        bases: ``(key_up, key_mean, value_up, value_mean)``: (H, r, d), (H, d), (H, r, d), (H, d), fp32; with a
            rotated quantized tier (codes of ``c R``) a fifth, (2, H, r, d): ``R P_k`` and ``R P_v``, which that
            tier's codes are rebuilt and projected with (its weighted latents summed apart).
        cos, sin: (rows, d) RoPE per position, fp32; a position past the last row takes the last.

    Returns:
        (B, Hq, n, d) in the query's dtype.

    Raises:
        RuntimeError: (from the op) for shapes that do not agree with the layout or each other.
    """
    views = latent.views
    rotated = bases[4] if len(bases) > 4 and meta.q_width else None
    return torch.ops.kvserve.paged_latent_attention(query, views.arena, meta.exact_table, meta.q_table, meta.ranges,
                                                    _layer_args(views, latent.layer), *bases[:4], meta.positions, cos,
                                                    sin, rotated, scaling)


def dca_attention(query: torch.Tensor, source, source_meta, own, own_meta, cuts: list[int], scaling: float,
                  map_args: list[torch.Tensor], latents: tuple = ()) -> torch.Tensor:
    """A ``dca`` reuse layer's attention (cross-layer KV sharing with a calibrated map; CLA, arXiv 2405.12981), both
    layers' pages read in place, in one op: each query reads the positions before its row's first own position from
    its source layer's pages, the map folded in, and the later ones from the layer's own pages, in one softmax (the
    two parts attended apart and merged by their log-sum-exp, FlashAttention's rescaling, arXiv 2205.14135). With a
    map, each query head ``q`` of KV head ``h`` scores every source head at once, ``Σ_g fold_g(q) · K_g,t + q · R_t
    b_h`` (the key bias rotated to each token's position inside the op), and sums every source head's values, mapped
    once a row; a rotated quantized tier is scored with each part's query rotated instead of the codes. Under
    ``dca+mla`` both layers hold post-hoc latents (:func:`is_posthoc_latent`): every source head's keys are rebuilt
    from the latent inside the op, the latent summed as the values and each head's projected once a row
    (:func:`latent_attention`'s sums), the layer's own as :func:`latent_attention` does.

    Args:
        query: (B, Hq, n, d) after RoPE, Hq a multiple of the layers' H KV heads.
        source, own: the source layer's and this layer's :class:`cache_backends.paged.InPlaceRead` (K/V pairs of H
            heads of width d, or post-hoc latents, :func:`reads_dca`); source_meta, own_meta: their groups' step metadata.
        cuts: four ints a row: its own pages' first exact slot and first code, its source's exact slots' end and
            codes' end (:func:`cache_backends.dca.paged.cuts_at`).
        map_args: ``[key_fold (Hq, d, H d), value_map (Hq, H d, d), value_bias (Hq, d), key_bias (H, d), cos, sin
            (rows, d)]`` fp32, or ``[]``: the source's K/V as they are.
        latents: for post-hoc latents, ``(source bases, own bases, cos, sin)``: each layer's
            :func:`latent_attention` bases (the first four: a latent under ``dca`` has no rotated tier) and RoPE's
            (rows, d) fp32 tables; else ``()``.

    Returns:
        (B, Hq, n, d) in the query's dtype.

    Raises:
        RuntimeError: (from the op) for shapes that do not agree with the layouts or each other, or ranges with
            attention sinks.
    """
    src_views, own_views = source.views, own.views
    q = own_views.layout.quantization
    rotation, latent_args = None, []
    if latents:
        src_bases, own_bases, cos, sin = latents
        latent_args = [*src_bases[:4], *own_bases[:4], cos, sin]
    elif q and q.rotate:
        rotation = _rotation(query.shape[-1], 0, query.device)
    return torch.ops.kvserve.paged_dca_attention(
        query, src_views.arena, source_meta.exact_table, source_meta.q_table, source_meta.ranges,
        _layer_args(src_views, source.layer), source_meta.positions, own_views.arena, own_meta.exact_table,
        own_meta.q_table, own_meta.ranges, _layer_args(own_views, own.layer), own_meta.positions, cuts, rotation,
        map_args, latent_args, scaling)


def reads_dca(layout) -> bool:
    """Whether :func:`dca_attention` reads a layout in place: a K/V pair of one width (a rotated tier too), or a
    post-hoc latent without a rotated tier (``dca+mla``)."""
    if not fits(layout) or is_latent(layout):
        return False
    if is_posthoc_latent(layout):
        return not (layout.quantization and layout.quantization.rotate)
    k, v = layout.streams
    return k.width == v.width


@functools.lru_cache(maxsize=16)
def _rotation(width: int, rope: int, device: torch.device) -> torch.Tensor:
    """The op's ``rotation``: the (d, d) Hadamard rotation of keys ``width`` wide; a latent's (``rope`` > 0), the
    latent's rotation then the rope key's, block-diagonal (each stream is rotated on its own when it drains)."""
    from cache_backends.quant import hadamard  # noqa: PLC0415 - a leaf; only rotated tiers need it

    r = hadamard(width, torch.float32, device)
    return torch.block_diag(r, hadamard(rope, torch.float32, device)) if rope else r


def _layer_args(views, layer: int) -> list[int]:
    """:func:`layout_args` of ``views``' layout, computed once per layer."""
    cache = views.__dict__.setdefault("kernel_layout", {})
    args = cache.get(layer)
    if args is None:
        args = cache[layer] = layout_args(views.layout, layer)
    return args


def latent_write(views, layer: int, meta, key: torch.Tensor, value: torch.Tensor, basis: torch.Tensor,
                 mean: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Write a step's new tokens of a post-hoc latent layer (``mla`` on an MHA/GQA model) into their exact slots
    (``meta.write_pages`` and ``write_slots``), in one op: each token's latent ``([RoPE^-1(K) ; V] - mean) basis``,
    RoPE undone at its own position (``meta.query_positions``), computed in fp32 and stored in the pool's dtype.

    Args:
        key, value: (B, H, n, d) after RoPE.
        basis: (2 H d, r) fp32; mean: (2 H d,) fp32 (:class:`cache_backends.mla.basis.LatentBasis`'s).
        cos, sin: (rows, d) fp32 RoPE per position.

    Raises:
        RuntimeError: (from the op) for shapes that do not agree with the layout or each other.
    """
    torch.ops.kvserve.paged_latent_write(views.arena, key, value, meta.query_positions, cos, sin, basis, mean,
                                         meta.write_pages, meta.write_slots, _layer_args(views, layer))


def grouped_write(views, layer: int, meta, key: torch.Tensor, value: torch.Tensor, key_encode: torch.Tensor,
                  value_encode: torch.Tensor) -> None:
    """``gqa``'s write in one op: each group of heads' K and V (B, H, n, d) concatenated and encoded into its shared
    head (``key_encode``, ``value_encode`` (G, H / G * d, d)), then written into the exact slots as
    :func:`paged_write` writes."""
    dtype = views.layout.dtype
    torch.ops.kvserve.paged_grouped_write(views.arena, key.to(dtype), value.to(dtype), key_encode, value_encode,
                                          meta.write_pages, meta.write_slots, _layer_args(views, layer))


def paged_write(views, layer: int, meta, key: torch.Tensor, value: torch.Tensor) -> None:
    """Write a step's new K/V, (B, heads, n, width) each, into their exact slots (``meta.write_pages`` and
    ``write_slots``) of ``layer``, in one op; cast to the pool's dtype first when they are in another."""
    dtype = views.layout.dtype
    torch.ops.kvserve.paged_write(views.arena, key.to(dtype), value.to(dtype), meta.write_pages, meta.write_slots,
                                  _layer_args(views, layer))
