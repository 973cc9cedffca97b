"""The project's multiple-choice task scored per KV backend through the server, with lm-eval's real client.

For each backend in ``--backends``: start ``kvserve serve`` on 127.0.0.1 and a free port with ``MODEL_ID=--model``,
``KV_BACKEND=<backend>`` and ``KV_BACKENDS=""`` (that backend alone, at the settings ``KV_QUALITY_BUDGET`` chooses
unless the environment sets them), wait for ``/health`` 200, read ``/v1/models`` (the served name) and ``/info``
(``kv_backend_params``, ``kv_bytes_per_token``, ``kv_quality``), run lm-evaluation-harness ``local-completions``
(``base_url=http://127.0.0.1:PORT/v1/completions``, the model folder's tokenizer, token-id requests) on
``bench/tasks/kvserve_mc`` (74 four-choice questions, log-likelihood scoring), collect ``acc`` and ``acc_norm``
with their standard errors, and stop the server. Every request goes to 127.0.0.1; the hub is kept offline.

Writes ``--out`` (JSON: one entry per backend, its settings, bytes per token, accuracies and delta vs ``full``)
and prints a markdown table. A backend whose server does not start (exits, or is not healthy within
``--start-timeout`` seconds) is recorded with its error and the run goes on. Run:
``python -m bench.lm_eval_backends --model models/smollm2-135m-instruct --backends full int8 int4 mla gqa dca``
(start-up calibrates mla/gqa/dca: set ``KV_CALIBRATION_CACHE_DIR`` to reuse the fits between runs).
This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TASK_DIR = REPO / "bench" / "tasks" / "kvserve_mc"
TASK = "kvserve_mc"
BACKENDS = ["full", "int8", "int4", "mla", "gqa", "dca"]


def task_config(task_dir: Path = TASK_DIR) -> dict:
    """The task's YAML as a dict, its ``data_files`` made absolute (the YAML's are relative to the repository
    root, where ``datasets`` resolves them against the working directory), for ``simple_evaluate(tasks=[...])``."""
    config = yaml.safe_load((task_dir / f"{TASK}.yaml").read_text())
    files = config["dataset_kwargs"]["data_files"]
    config["dataset_kwargs"]["data_files"] = {split: str(REPO / path) for split, path in files.items()}
    return config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``kvserve serve`` for one backend on 127.0.0.1, its output in ``log`` (stopped by :meth:`stop`)."""

    def __init__(self, model: str, backend: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(self.port), "MODEL_ID": model,
               "KV_BACKEND": backend, "KV_BACKENDS": "", "HF_HUB_OFFLINE": "1"}
        self._out = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve"], env=env, cwd=REPO,
                                     stdout=self._out, stderr=subprocess.STDOUT, text=True)

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until ``/health`` answered 200.

        Raises:
            RuntimeError: the server exited (with its log's tail) or was not healthy within ``timeout`` s.
        """
        import httpx

        start = time.time()
        while time.time() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.time() - start
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"server not healthy within {timeout:.0f} s: {self.tail()}")

    def tail(self, lines: int = 5) -> str:
        self._out.flush()
        return " | ".join(self.log.read_text().strip().splitlines()[-lines:])

    def warnings(self) -> list[str]:
        """The server log's warning lines (start-up: a backend priced over the budget, one that saves nothing)."""
        self._out.flush()
        return [line.strip() for line in self.log.read_text().splitlines() if "WARNING" in line.upper()]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


def evaluate(url: str, served: str, tokenizer: str, limit: int | None, num_concurrent: int) -> dict:
    """lm-eval ``local-completions`` on the task against ``url``: ``{acc, acc_stderr, acc_norm,
    acc_norm_stderr, items}`` (accuracies in [0, 1])."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = (f"base_url={url}/v1/completions,model={served},tokenizer={tokenizer},tokenizer_backend=huggingface,"
            f"tokenized_requests=True,num_concurrent={num_concurrent},max_retries=1")
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=[task_config()],
                                  task_manager=TaskManager(), batch_size=1, limit=limit)
    res = out["results"][TASK]
    return {"acc": res["acc,none"], "acc_stderr": res["acc_stderr,none"], "acc_norm": res["acc_norm,none"],
            "acc_norm_stderr": res["acc_norm_stderr,none"], "items": out["n-samples"][TASK]["effective"]}


def run_backend(model: str, backend: str, args, logs: Path) -> dict:
    """One backend: serve, read what the server chose, evaluate, stop. ``error`` is set if the server did not
    start or the evaluation failed."""
    import httpx

    entry: dict = {"backend": backend}
    server = Server(model, backend, logs / f"{backend}.log")
    try:
        entry["start_s"] = round(server.wait_healthy(args.start_timeout), 1)
        served = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        info = httpx.get(server.url + "/info", timeout=10).json()
        entry.update(served_model=served, params=info["kv_backend_params"][backend],
                     kv_bytes_per_token=info["kv_bytes_per_token"][backend],
                     kv_quality=info.get("kv_quality", {}).get(backend))
        start = time.time()
        entry.update(evaluate(server.url, served, model, args.limit, args.num_concurrent))
        entry["eval_s"] = round(time.time() - start, 1)
    except Exception as exc:  # noqa: BLE001 - recorded, and the next backend runs
        entry["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        entry["server_warnings"] = server.warnings()
        server.stop()
    return entry


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(entries: list[dict]) -> str:
    """The markdown table: backend, the server's settings, bytes/token, acc, acc_norm (each +- stderr),
    delta acc vs ``full``."""
    from cache_backends.spec import format_options

    rows = ["| backend | settings (/info kv_backend_params) | KV bytes/token | acc | acc_norm | delta acc vs full |",
            "|---|---|---|---|---|---|"]
    for e in entries:
        if "error" in e:
            rows.append(f"| {e['backend']} | {e.get('params', '-')} | - | error: {e['error'][:120]} | - | - |")
            continue
        params = format_options(e["params"] or {}, ", ") or "-"
        rows.append(f"| {e['backend']} | {params} | {e['kv_bytes_per_token']:.0f} | "
                    f"{e['acc']:.3f} ± {e['acc_stderr']:.3f} | {e['acc_norm']:.3f} ± {e['acc_norm_stderr']:.3f} | "
                    f"{_fmt(e.get('delta_acc_vs_full'), '+.3f')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lm_eval_backends", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"), help="a model folder")
    ap.add_argument("--backends", nargs="+", default=BACKENDS, help="KV_BACKEND values, each served alone")
    ap.add_argument("--limit", type=int, help="score only the first N items (a smoke run)")
    ap.add_argument("--num-concurrent", type=int, default=1, help="lm-eval's concurrent requests")
    ap.add_argument("--start-timeout", type=float, default=1800, help="seconds a server may take to be healthy")
    ap.add_argument("--out", default=str(REPO / "docs" / "bench" / "lm_eval_real.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    model = str(Path(args.model).resolve())
    if not (Path(model) / "config.json").is_file():
        ap.error(f"--model {args.model}: not a model folder (no config.json); `kvserve fetch-model` makes one")

    entries = []
    with tempfile.TemporaryDirectory(prefix="kvserve-lm-eval-") as logs:
        for backend in args.backends:
            entry = run_backend(model, backend, args, Path(logs))
            entries.append(entry)
            print(f"{backend}: " + (entry["error"] if "error" in entry else
                                    f"acc {entry['acc']:.3f} acc_norm {entry['acc_norm']:.3f} "
                                    f"(start {entry['start_s']} s, eval {entry['eval_s']} s)"), file=sys.stderr)
    full = next((e for e in entries if e["backend"] == "full" and "error" not in e), None)
    for e in entries:
        if full is not None and "error" not in e:
            e["delta_acc_vs_full"] = e["acc"] - full["acc"]
            e["delta_acc_norm_vs_full"] = e["acc_norm"] - full["acc_norm"]

    result = {"task": TASK, "task_dir": str(TASK_DIR.relative_to(REPO)), "model": Path(model).name,
              "limit": args.limit, "client": "lm-eval local-completions", "lm_eval_version": _lm_eval_version(),
              "kv_quality_budget": os.environ.get("KV_QUALITY_BUDGET", "default"),
              "command": "python -m bench.lm_eval_backends " + " ".join(argv if argv is not None else sys.argv[1:]),
              "backends": entries}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(entries))
    return 0 if all("error" not in e for e in entries) else 1


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


if __name__ == "__main__":
    sys.exit(main())
