"""Start-up check of the served backends against the model's config (no weights loaded)."""

from __future__ import annotations

from pathlib import Path


#: The most pools :func:`possible_pages` lays out before the load (about 10 ms each on SmolLM2's 30 layers, where one
#: dca backend gives 16 and two 256: seconds of start-up, left to the check after the load).
MAX_POOL_VARIANTS = 64


def check_model_folder(model_id: str, source: str = "MODEL_ID") -> None:
    """Refuse a local model folder without ``config.json``, or a path (``/...``, ``./...``, ``~/...``) that does not
    exist, naming ``source`` (the variable or flag) and the folder: transformers would say "Unrecognized model ...
    Should have a `model_type` key in its config.json" or "Repo id must be in the form ...", as if it were a hub id.

    Raises:
        ConfigError: one line naming ``source``, the folder and what is missing.
    """
    from server.config import ConfigError

    path = Path(model_id).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(f"invalid {source}={model_id!r}: the folder has no config.json (a model folder holds "
                          "config.json, the tokenizer files and the weights)")
    if not path.exists() and (path.is_absolute() or model_id.startswith((".", "~"))):
        raise ConfigError(f"invalid {source}={model_id!r}: no such folder")


def check_backend(settings, model_source: str = "MODEL_ID") -> None:
    """Build the chosen backend against the model's config (no weights) so that a parameter the model
    cannot take (e.g. KV_GQA_GROUPS not dividing num_key_value_heads) stops start-up at once.

    ``model_source`` (``MODEL_ID``, or the flag that set it) is named when the model's config cannot be read.

    Raises:
        ConfigError: with the backend's one-line message.
    """
    import torch
    from transformers import AutoConfig

    from cache_backends.geometry import ModelGeometry
    from server.config import ConfigError
    from server.engine_loading import create_backends

    check_model_folder(settings.model_id, model_source)
    if settings.kv_calibration_file is not None and not Path(settings.kv_calibration_file).expanduser().is_file():
        raise ConfigError(f"invalid KV_CALIBRATION_FILE={settings.kv_calibration_file!r}: no such file")
    try:
        config = AutoConfig.from_pretrained(settings.model_id)
    except Exception as exc:  # noqa: BLE001 - any failure to read the config is a bad MODEL_ID
        raise ConfigError(f"invalid {model_source}={settings.model_id!r}: {exc}".splitlines()[0]) from None
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(settings.dtype, torch.float32)
    geometry = ModelGeometry.from_config(config, dtype)
    try:
        backends = create_backends(settings, geometry)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    # the engine's own checks of the pool, before the weights load (exit 2)
    check_pool(backends, dtype, settings.kv_block_size, settings.kv_cache_budget_bytes)


def check_pool(backends: dict, dtype, block_size: int, budget_bytes: int | None) -> None:
    """Lay out the KV pool of ``backends`` as the engine will (:func:`server.engine.kv_cache.page_layouts`), from the
    model's config alone, and refuse what it would refuse after the weights load: a layout a backend cannot take
    (``window``'s sinks wider than one page at ``KV_BLOCK_SIZE``, whatever is served beside it:
    :func:`possible_pages`) and a ``KV_CACHE_BUDGET_BYTES`` that holds fewer than two KV pages
    (:func:`server.engine.setup.pages_in_budget`; only where the page is known before calibration) or more than the
    machine's memory (both checked only when ``budget_bytes`` is given).

    Raises:
        ConfigError: the layout's one-line reason with ``KV_BLOCK_SIZE``'s value, or naming
            ``KV_CACHE_BUDGET_BYTES``, the page's bytes and the least budget that serves.
    """
    from server.config import ConfigError
    from server.engine.setup import pages_in_budget

    pages = possible_pages(backends, dtype, block_size)
    if budget_bytes is not None:
        memory = physical_memory()
        if memory and budget_bytes > memory:  # the pool is allocated whole: it failed after the load, exit 1
            raise ConfigError(f"invalid KV_CACHE_BUDGET_BYTES={budget_bytes}: more than this machine's memory "
                              f"({memory} bytes); the KV pool is allocated whole at start-up")
    if budget_bytes is not None and len(pages) == 1:  # else the page is known once dca is calibrated
        try:
            pages_in_budget(budget_bytes, pages.pop())
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def possible_pages(backends: dict, dtype, block_size: int) -> set[int]:
    """The page sizes the engine's pool may take for ``backends`` (:func:`server.engine.kv_cache.page_layouts`): one
    where every layout is known from the model's config; with ``dca``, whose layout calibration sets, one per layout
    it may be calibrated to (:meth:`~cache_backends.base.KVBackend.layout_variants`), so that what every one of them
    refuses (``window``'s sinks over a page, whatever is served beside it) is refused before the weights load. No
    page (nothing checked before the load) where a layout is unknown still, or past :data:`MAX_POOL_VARIANTS` pools.

    Raises:
        ConfigError: the layout's one-line reason with ``KV_BLOCK_SIZE``'s value, when every possible pool refuses
            it (of the sinks' refusals, the one with the most tokens a page).
    """
    import itertools
    import math

    from server.config import ConfigError
    from server.engine.kv_cache import page_layouts

    names = list(backends)
    variants = [backends[n].layout_variants() for n in names]
    if math.prod(map(len, variants)) > MAX_POOL_VARIANTS:  # several dca backends on a deep model: checked after
        return set()
    pages, refused = set(), []
    for variant in itertools.product(*variants):
        try:
            pages.add(page_layouts(dict(zip(names, variant)), dtype, block_size)[0])
        except RuntimeError:  # a layout still unknown before the load: the engine checks the pool then
            return set()
        except ValueError as exc:
            refused.append(exc)
    if not pages:
        exc = max(refused, key=lambda e: getattr(e, "per", 0))
        raise ConfigError(f"{exc} (KV_BLOCK_SIZE is {block_size})") from None
    return pages


def physical_memory() -> int | None:
    """This machine's memory in bytes (``sysconf``), or ``None`` where it cannot be read."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
