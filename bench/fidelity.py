"""Fidelity and speed of a KV backend through its own cache path: :mod:`server.bench_cmd.fidelity` (``kvserve
bench`` measures with it), re-exported here for the benchmarks, scripts and tests that import it."""

from __future__ import annotations

from server.bench_cmd.fidelity import *  # noqa: F403
