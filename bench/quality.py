"""Held-out text slices and teacher-forced perplexity: :mod:`server.bench_cmd.quality` (``kvserve bench`` reads
them), re-exported here for the benchmarks, scripts and tests that import it."""

from __future__ import annotations

from server.bench_cmd.quality import *  # noqa: F403
