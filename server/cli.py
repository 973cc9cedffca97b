"""``kvserve`` command line: ``kvserve serve`` starts the HTTP server with settings from the environment."""

from __future__ import annotations

import argparse
import logging
import sys


def serve(_: argparse.Namespace) -> int:
    from server.config import ConfigError, load_settings

    try:
        settings = load_settings()
    except ConfigError as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from server.app import create_app

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM inference server with pluggable KV caches.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="serve the model over HTTP (configured by environment variables)")
    p_serve.set_defaults(func=serve)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
