"""``kvserve calibrate``: fit what the chosen backends need (``gqa`` codecs, ``mla`` bases, ``dca`` maps) into
the calibration cache ahead of serving, e.g. in a Docker build step or a Kubernetes init container.

It reads the same settings as ``kvserve serve`` (``MODEL_ID``, ``KV_BACKEND``/``KV_BACKENDS``, the
``KV_<PART>_*`` parameters, ``KV_CALIBRATION_FILE``, ``KV_CALIBRATION_CACHE_DIR``, ``DEVICE``, ``DTYPE``),
so with the server's environment it fills exactly the entries that server will look up. ``--backend``
replaces ``KV_BACKEND``/``KV_BACKENDS``; it may be repeated, take several names, or a comma list
(``--backend gqa --backend mla``, ``--backend gqa mla``, ``--backend gqa,mla`` are the same), since each
spelling is one someone will try and none is ambiguous. Backends with nothing to fit (``full``, ``int8``,
``gqa`` with ``method=mean``, ``mla`` on a native-MLA model) are reported as such.

Exit status: 0 on success, 2 for a bad setting (one line), 1 when the model or the calibration text
cannot be loaded (one line).
"""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", action="extend", nargs="+", metavar="NAME",
                        help="backend(s) to calibrate: repeat the flag, give several names, or a comma list "
                             "(default: KV_BACKEND and KV_BACKENDS, as `kvserve serve` serves them)")
    parser.add_argument("--model", help="model folder or hub id (default: MODEL_ID)")
    parser.add_argument("--refit", action="store_true",
                        help="fit again and overwrite entries the cache already holds")


def backend_names(values: list[str] | None) -> list[str]:
    """``--backend`` values flattened: comma lists split, blanks and repeats dropped, order kept."""
    names = [n.strip() for value in values or [] for n in value.split(",")]
    return list(dict.fromkeys(n for n in names if n))


def _figures_lines(kind: str, figures: dict) -> list[str]:
    """One line per per-layer figure list (dca's compare layer l with l - 1, so they start at layer 1)."""
    first = 1 if kind == "dca" else 0
    lines = []
    for name, values in figures.items():
        if isinstance(values, list) and values:
            label = f"{name.replace('_', ' ')} (layers {first}-{first + len(values) - 1})"
            lines.append(f"    {label}: " + " ".join(f"{x:.4f}" for x in values))
    return lines


def report(name: str, backend, events, seconds: float) -> list[str]:
    """The lines printed for one backend: each artefact (fitted or loaded, time, entry, figures)."""
    from cache_backends.spec import format_options

    params = format_options(backend.params(), ", ")
    lines = [f"{name}{f' ({params})' if params else ''}: " + (f"{seconds:.2f} s" if events else "nothing to fit")]
    for e in events:
        how = "fitted" if e.source == "fitted" else "loaded from the cache"
        where = f" -> {e.path}" if e.path else " (not saved)"
        lines.append(f"  {e.kind}: {how} in {e.seconds:.2f} s{where}")
        lines += _figures_lines(e.kind, e.figures)
    if hasattr(backend, "expected_reuse_layers"):  # dca: what the similarities mean at this threshold
        reused = backend.expected_reuse_layers()
        lines.append(f"  reuse layers at threshold {backend.threshold} (align={backend.align}): "
                     f"{', '.join(map(str, reused)) or 'none'} ({len(reused)} of {backend.geometry.num_layers})")
    return lines


def main(args: argparse.Namespace) -> int:
    from server.backend_check import check_backend
    from server.config import ConfigError, load_settings

    overrides = {}
    names = backend_names(args.backend)
    if names:
        overrides.update(kv_backend=names[0], kv_backends=",".join(names[1:]))
    if args.model:
        overrides["model_id"] = args.model
    flags = {"kv_backend": "--backend", "kv_backends": "--backend", "model_id": "--model"}  # named in a refusal
    try:
        settings = load_settings(flags={k: v for k, v in flags.items() if k in overrides}, **overrides)
        if not settings.kv_calibration_cache_dir:
            raise ConfigError("KV_CALIBRATION_CACHE_DIR is empty (no cache): kvserve calibrate has nowhere to write")
        check_backend(settings, "--model" if args.model else "MODEL_ID")
    except ConfigError as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    # full and int8, served by default besides KV_BACKEND, fit nothing: only what the settings name is reported
    names = [n for n in settings.served_backends() if n not in settings.optional_backends()]
    return _calibrate(settings, names, args.refit)


def _calibrate(settings, names: list[str], refit: bool) -> int:
    from tqdm import tqdm

    from cache_backends.geometry import ModelGeometry
    from cache_backends.calibration import calibration_file, calibration_ids
    from cache_backends.calibration_cache import CalibrationCache
    from server.model_loading import load_model, resolve_device, resolve_dtype
    from server.engine_loading import long_probe
    from server.quality_budget import choose, long_summary
    from server.quality_price import Scorer

    start = time.perf_counter()
    try:
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        model, tokenizer = load_model(settings.model_id, device, dtype)
        loaded = time.perf_counter()
        ids = calibration_ids(model, tokenizer, path=settings.kv_calibration_file)
        source = calibration_file(model, settings.kv_calibration_file)
    except (OSError, ValueError) as exc:
        print(f"kvserve: cannot calibrate: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    geometry = ModelGeometry.from_config(model.config, dtype)
    cache = CalibrationCache(settings.kv_calibration_cache_dir, refit=refit)
    print(f"kvserve calibrate: {settings.model_id} on {device.type} ({str(dtype).removeprefix('torch.')}), "
          f"{len(ids)} calibration tokens of {source}; model loaded in {loaded - start:.2f} s", flush=True)
    budget = settings.kv_quality_budget
    scorer = Scorer(model, geometry, ids, cache, long_probe=long_probe(settings, names, model, tokenizer, geometry,
                                                                      ids)) if budget is not None else None
    lines = []
    for name in tqdm(names, desc="calibrate", unit="backend"):
        before, began = len(cache.events), time.perf_counter()
        backend, choice = choose(name, geometry, settings.backend_options(name), settings.explicit_options(name),
                                 model, ids, cache, scorer, budget, settings.kv_quality_min_agreement)
        events = [e for e in cache.events[before:] if e.kind != "price"]
        lines += report(name, backend, events, time.perf_counter() - began)
        lines.append(f"  quality: {choice.message}")
        if choice.long_price is not None:
            lines.append(f"  long input: {choice.long_context_warning or long_summary(choice)}")
    print("\n".join(lines))
    print(f"total {time.perf_counter() - start:.2f} s; cache: {cache.directory}")
    return 0
