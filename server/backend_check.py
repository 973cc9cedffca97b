"""Start-up check of the served backends against the model's config (no weights loaded)."""

from __future__ import annotations


def check_backend(settings) -> None:
    """Build the chosen backend against the model's config (no weights) so that a parameter the model
    cannot take (e.g. KV_GQA_GROUPS not dividing num_key_value_heads) stops start-up at once.

    Raises:
        ConfigError: with the backend's one-line message.
    """
    import torch
    from transformers import AutoConfig

    from cache_backends.base import ModelGeometry
    from server.config import ConfigError
    from server.state import create_backends

    try:
        config = AutoConfig.from_pretrained(settings.model_id)
    except Exception as exc:  # noqa: BLE001 - any failure to read the config is a bad MODEL_ID
        raise ConfigError(f"invalid MODEL_ID={settings.model_id!r}: {exc}".splitlines()[0]) from None
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(settings.dtype, torch.float32)
    geometry = ModelGeometry.from_config(config, dtype)
    try:
        create_backends(settings, geometry)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
