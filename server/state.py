"""The server's state: the settings, the metrics, the engine core's client and what start-up learned from it (the
model's names, limits and ``/info``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from server import __version__
from server.config import Settings
from server.engine.core_client import CoreClient
from server.metrics import Metrics, Recorder
from server.service import GenerationService, Limits


@dataclass
class ServerState:
    """Everything the routes need; ``service`` is ``None`` until the model is loaded."""

    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    service: GenerationService | None = None
    core: CoreClient | None = None
    """The engine core's client (:class:`server.engine.core_client.CoreClient`), from the start of loading."""
    model_name: str = ""
    info: dict = field(default_factory=dict)
    load_error: str | None = None
    loading: str = "model is loading"
    """What start-up is doing until ``service`` is set: ``/health``'s 503 message (pricing takes minutes)."""
    started: float = field(default_factory=time.time)
    model_names: list[str] = field(default_factory=list)
    """What the OpenAI routes accept in ``model`` (``SERVED_MODEL_NAME``); the first is ``model_name``."""
    draining: bool = False
    """Set on SIGTERM (``kvserve serve``): ``/health`` answers 503 and new generation requests are refused."""
    in_flight: int = 0
    """Generation requests in flight (:class:`server.middleware.InFlight`)."""

    model_config: dict = field(default_factory=dict)
    """The served model's config (``config.json``'s fields; the built-in page's model shape)."""
    exit_on_fatal: bool = False
    """Stop the server (SIGINT to this process; ``kvserve serve`` then exits 1 naming ``load_error``) when the engine
    core dies (its process, or its thread with ``ENGINE_PROCESS=false``)."""

    def load(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine core (:class:`server.engine.core_client.CoreClient`: it loads the model and the KV
        backends in its own process, or in a thread of this one with ``ENGINE_PROCESS=false``), wait for it to be
        ready (``loading`` follows its stages) and serve through it, its outputs read by a task on ``loop`` (the
        server's event loop; ``None``: on the loop of the first request). Blocking: runs in a background thread at
        start-up.

        Raises:
            ValueError: a setting this model cannot take; RuntimeError: the core failed to load or exited.
        """
        s = self.settings
        where = "process" if s.engine_process else "thread"
        self.loading = f"the engine core {where} is loading the model and preparing the KV backends"
        self.core = CoreClient(s, on_death=self._core_died)
        ready = self.core.start(on_stage=lambda stage: setattr(self, "loading", stage))  # stops itself if it fails
        # MODEL_ID as given (a path for a local model, as vLLM names it: tools load the tokenizer from the served
        # name), and a local folder's name as an alias
        self.model_names = s.model_names(s.model_id, *([Path(s.model_id).name] if Path(s.model_id).exists() else []))
        self.model_name = self.model_names[0]
        max_input, max_total = s.token_limits(ready.max_position_embeddings)
        self.core.recorder = Recorder(self.metrics, self.model_name, ready.backends)
        self.core.recorder.cache_config(ready.info)
        self.model_config = ready.model_config
        self.info = {**self.server_info(max_input, max_total, ready.backends), **ready.info, "version": __version__}
        self.service = GenerationService(self.core, self.core.tokenizer,
                                         Limits(max_input, max_total, s.max_stop_sequences), s.kv_backend,
                                         prefix_caching=s.kv_prefix_caching, tool_call_parser=s.tool_call_parser)
        if loop is not None:
            self.core.listen(loop)  # a core that dies while no request runs turns /health 503 all the same

    def server_info(self, max_input: int, max_total: int, names: list[str]) -> dict:
        """``/info``'s facts of the settings and the limits (the engine core's:
        :func:`server.engine_loading.engine_info`)."""
        s = self.settings
        return {"model_id": self.model_name, "model_path": s.model_id, "kv_backend": s.kv_backend, "kv_backends": names,
                "max_input_tokens": max_input, "max_total_tokens": max_total,
                "max_stop_sequences": s.max_stop_sequences, "max_batch_size": s.max_batch_size,
                "max_concurrent_requests": s.max_concurrent_requests, "served_model_names": self.model_names,
                "shutdown_grace_seconds": s.shutdown_grace_seconds, "kv_cache_budget_bytes": s.kv_cache_budget_bytes}

    def _core_died(self, reason: str) -> None:
        """The engine core is gone: ``/health`` answers 503 with ``reason``, and the server stops."""
        self.load_error = reason
        self.service = None
        if self.exit_on_fatal:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGINT)

    def shutdown(self) -> None:
        """Stop the engine core (:meth:`server.engine.core_client.CoreClient.stop`)."""
        if self.core is not None:
            self.core.stop()
