"""``python -m bench.report``: ``kvserve bench`` (the same flags, checks and output), whose code lives in
:mod:`server.bench_cmd.report`; its names are re-exported here for the scripts and tests that import them."""

from __future__ import annotations

import sys

from server.bench_cmd.report import *  # noqa: F403


def cli(argv: list[str] | None = None) -> int:
    """``kvserve bench`` with ``argv`` (default: this process's arguments)."""
    from server.cli import main as kvserve

    return kvserve(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(cli())
