"""``python -m bench.report``: ``kvserve bench`` (the same flags, checks and output, under its own name), whose code
lives in :mod:`server.bench_cmd.report`; its names are re-exported here for the scripts and tests that import them."""

from __future__ import annotations

import sys

from server.bench_cmd.report import *  # noqa: F403


PROG = "python -m bench.report"


def cli(argv: list[str] | None = None) -> int:
    """``kvserve bench`` with ``argv`` (default: this process's arguments), named :data:`PROG` in its usage and
    errors."""
    from server.bench_cmd.report import main as bench
    from server.bench_cmd.report_cli import add_arguments
    from server.cli import OneLineParser, run

    parser = OneLineParser(prog=PROG, description="Measure every KV backend on the model: report.md, plots, JSON "
                           "(kvserve bench).")
    add_arguments(parser)
    parser.set_defaults(func=bench, subparser=parser, prog=PROG)
    return run(parser, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(cli())
