"""The engine core's loader: the model, the KV backends (calibrated and priced) and the engine over them, with the
:class:`~server.engine.messages.Ready` that tells the HTTP side what was loaded. :func:`load_core` runs in the
engine core's process or thread (:func:`server.engine.core.load_and_serve`), before its loop; the parts are
:mod:`server.engine_loading`'s."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from server.engine import messages as m

if TYPE_CHECKING:
    from server.engine.engine import Engine

log = logging.getLogger("kvserve.core")


def load_core(settings, progress=lambda stage: None) -> tuple[Engine, m.Ready]:
    """Load the model and backends for ``settings`` and build the engine; ``progress(stage)`` is told when the
    model is loaded and the backends are being calibrated and priced.

    Raises:
        ValueError: a setting this model cannot take; others: the model or a backend failed to load.
    """
    from cache_backends.calibration_cache import CalibrationCache
    from server.engine.setup import build_engine
    from server.engine_loading import (PRICING, create_backends, engine_info, engine_options, eos_token_ids,
                                       load_weights, prepare_backends)

    s = settings
    model, tokenizer, device, dtype, geometry = load_weights(s)
    names = list(create_backends(s, geometry))
    cache = CalibrationCache(s.kv_calibration_cache_dir)
    progress(PRICING)
    backends, quality = prepare_backends(s, names, model, tokenizer, geometry, cache)
    max_input, max_total = s.token_limits(model.config.max_position_embeddings)
    if max_total > model.config.max_position_embeddings:  # served (RoPE tables grow), as vLLM's opt-in long length
        log.warning("MAX_TOTAL_TOKENS=%d is more than the model's max_position_embeddings (%d): positions past it were "
                    "not trained, and the model's answers there may be poor", max_total,
                    model.config.max_position_embeddings)
    eos_ids = eos_token_ids(model, tokenizer)
    engine = build_engine(model, tokenizer, backends, eos_ids, **engine_options(s, max_total))
    info = engine_info(s, dtype, device, backends, quality, cache, geometry, max_total, engine.kv.info())
    return engine, m.Ready(sorted(eos_ids), names, model.config.max_position_embeddings, info,
                           json.loads(model.config.to_json_string(use_diff=False)))
