"""``kvserve bench``'s command line, whose code lives in :mod:`server.bench_cmd.report_cli` (re-exported here)."""

from __future__ import annotations

from server.bench_cmd.report_cli import *  # noqa: F403
