"""``kvserve`` command line: ``kvserve serve`` starts the HTTP server with settings from the environment;
``kvserve calibrate`` fills the calibration cache it reads."""

from __future__ import annotations

import argparse
import logging
import sys


def check_backend(settings) -> None:
    """Build the chosen backend against the model's config (no weights) so that a parameter the model
    cannot take (e.g. KV_GQA_GROUPS not dividing num_key_value_heads) stops start-up at once.

    Raises:
        ConfigError: with the backend's one-line message.
    """
    import torch
    from transformers import AutoConfig

    from cache_backends import ModelGeometry
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


def serve(_: argparse.Namespace) -> int:
    from server.config import ConfigError, load_settings

    try:
        settings = load_settings()
        check_backend(settings)
    except ConfigError as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from server.app import create_app

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings, exit_on_load_error=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)
    error = app.state.kvserve.load_error
    if error:  # the server stopped because it could never serve: say why, in one line, and fail
        print(f"kvserve: cannot serve: {error}", file=sys.stderr)
        return 1
    return 0


def bench(args: argparse.Namespace) -> int:
    from bench.report import main as bench_main

    return bench_main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM inference server with pluggable KV caches.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="serve the model over HTTP (configured by environment variables)")
    p_serve.set_defaults(func=serve)
    p_cal = sub.add_parser("calibrate", help="fit the gqa/mla/dca calibration ahead of serving into the "
                           "calibration cache (same settings as serve)")
    from server.calibrate_cli import add_arguments as calibrate_arguments
    from server.calibrate_cli import main as calibrate_main

    calibrate_arguments(p_cal)
    p_cal.set_defaults(func=calibrate_main)
    p_est = sub.add_parser("estimate", help="KV-cache size from a model config (no weights)")
    from server.estimate_cli import add_arguments as estimate_arguments
    from server.estimate_cli import main as estimate_main

    estimate_arguments(p_est)
    p_est.set_defaults(func=estimate_main)
    p_adv = sub.add_parser("advise", help="rank the backends that fit a workload's memory budget")
    from server.advise_cli import add_arguments as advise_arguments
    from server.advise_cli import main as advise_main

    advise_arguments(p_adv)
    p_adv.set_defaults(func=advise_main)
    p_bench = sub.add_parser("bench", help="measure every KV backend on the model: report.md, plots, JSON")
    from bench.report import add_arguments

    add_arguments(p_bench)
    p_bench.set_defaults(func=bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
