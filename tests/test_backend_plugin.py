"""A backend is one declaration: ``lastn`` (tests/plugin_backend/kvserve_lastn), a package kvserve's files never
name, installed through the ``kvserve.backends`` entry point, is served, configured, sized and listed everywhere a
built-in backend is: the spec parser, the registry and its compositions, the settings and ``kvserve serve``'s
flags, ``kvserve estimate``, ``kvserve advise``, an engine's greedy tokens (those of ``window`` with no sinks) and
its own Prometheus gauge."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "tests" / "plugin_backend"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder on ``PYTHONPATH`` holding the plug-in's distribution metadata (its entry point), as ``pip install``
    of a package declaring ``[project.entry-points."kvserve.backends"] lastn = "kvserve_lastn.spec"`` leaves."""
    root = tmp_path_factory.mktemp("site")
    info = root / "kvserve_lastn-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvserve-lastn\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvserve.backends]\nlastn = kvserve_lastn.spec\n")
    return root


def run(site: Path, code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(PLUGIN), str(REPO)]), **(env or {})}
    cmd = [sys.executable, "-c", textwrap.dedent(code)] if code else [sys.executable, *args]
    return subprocess.run(cmd, cwd=REPO, env=environ, capture_output=True, text=True, timeout=300)


def test_the_plugin_is_parsed_composed_and_configured_like_a_builtin(site):
    p = run(site, """
        import json
        from cache_backends import catalog, registry
        from cache_backends.spec import check_options, parse_spec
        from server.config import ConfigError, load_settings

        out = {"names": catalog.names(), "available": registry.available()}
        out["parsed"] = parse_spec("lastn:n=8")
        for bad in ("lastn:n=0", "lastn:n=x"):
            try:
                parse_spec(bad)
            except ValueError as exc:
                out[bad] = str(exc)
        for bad in ("lastn+mla", "lastn:sinks=2"):
            try:
                check_options(*parse_spec(bad))
            except ValueError as exc:
                out[bad] = str(exc)
        out["settings"] = load_settings(kv_backend="lastn+int8", kv_lastn_n="48").backend_options("lastn+int8")
        try:
            load_settings(kv_lastn_n="0")
        except ConfigError as exc:
            out["bad setting"] = str(exc)
        print(json.dumps(out))
    """)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert "lastn" in out["names"] and {"lastn", "lastn+int8"} <= set(out["available"])
    assert out["parsed"] == ["lastn", {"n": 8}]
    assert out["lastn:n=0"] == "lastn:n=0: n must be >= 1, got 0"
    assert out["lastn:n=x"] == "lastn:n=x: n must be an integer, got 'x'"
    assert "unsupported combination 'lastn+mla'" in out["lastn+mla"]
    assert out["lastn:sinks=2"] == "lastn takes no option sinks"
    assert out["settings"] == {"n": 48, "group_size": 32, "residual": 32, "key_bits": 8, "value_bits": 8,
                               "rotate": False}
    assert out["bad setting"].startswith("invalid KV_LASTN_N='0'")


def test_the_plugin_has_its_flag_and_its_estimate_row(site):
    help_text = run(site, "", "-m", "server.cli", "serve", "--help").stdout
    assert "--kv-lastn-n N" in help_text and "lastn: newest tokens each query sees." in help_text
    p = run(site, "", "-m", "server.cli", "estimate", "--model", "llama-3-8b", "--seq-len", "8192", "--batch", "1",
            "--json")
    assert p.returncode == 0, p.stderr
    rows = {r["backend"]: r for r in json.loads(p.stdout)}
    assert rows["lastn"]["params"] == {"n": 64}
    # n=64 of 8192 tokens in fp16 on llama-3-8b (8 K/V heads of 128): 63 tokens held besides the next one's own
    assert rows["lastn"]["bytes_per_token_per_layer"] == pytest.approx(63 * 2 * 8 * 128 * 2 / 8192)
    named = run(site, "", "-m", "server.cli", "estimate", "--model", "llama-3-8b", "--seq-len", "8192", "--batch",
                "1", "--json", "lastn:n=64", "window:sinks=0,window=64")
    a, b = json.loads(named.stdout)
    assert a["bytes_per_token_per_layer"] == b["bytes_per_token_per_layer"]


def test_the_plugin_serves_the_tokens_of_a_window_without_sinks(site):
    """Greedy tokens through an engine (the paged pool, the kernel or torch path, pages freed as the window moves):
    ``lastn:n=24`` gives ``window:sinks=0,window=24``'s, on a prompt four times as long as the window. Its own
    gauge, ``kvserve_lastn_dropped_tokens`` (its declaration's, named by no kvserve file), follows each step."""
    p = run(site, """
        import json
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from server.metrics import Metrics, Recorder
        from tests.conftest import MODEL_DIR
        from tests.engine_helpers import make_engine, make_seq, on_events, run_all

        model = AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()
        tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
        prompt = "In the beginning God created the heaven and the earth. " * 12
        out = {}
        for name, options in (("lastn", {"n": 24}), ("window", {"sinks": 0, "window": 24})):
            engine = make_engine(model, tokenizer, name, **options)
            metrics = Metrics()
            engine.recorder = Recorder(metrics, "m", [name])
            seq = make_seq(tokenizer, prompt, 24, backend=name)
            dropped = []
            on_events(seq, lambda event: dropped.append(metrics.registry.get_sample_value(
                "kvserve_lastn_dropped_tokens", {"model": "m", "backend": name})))
            run_all(engine, [seq])
            out[name] = {"ids": seq.output_ids, "prompt": len(seq.prompt_ids), "dropped": dropped}
        print(json.dumps(out))
    """)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    prompt = out["lastn"]["prompt"]
    assert prompt >= 4 * 24 and len(out["lastn"]["ids"]) == 24
    assert out["lastn"]["ids"] == out["window"]["ids"]
    # each token's event comes after its step's report: k tokens cached past the prompt, n = 24 of them kept
    assert out["lastn"]["dropped"][:-1] == [prompt + k - 24 for k in range(23)]
    assert out["lastn"]["dropped"][-1] == 0  # the last event: the request is off the gauges
    assert out["window"]["dropped"] == [None] * 24  # window declares no such gauge


def test_a_plugin_whose_name_is_taken_is_refused(site, tmp_path):
    info = tmp_path / "twin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: twin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvserve.backends]\nfull = cache_backends.full.spec\n")
    p = run(site, "from cache_backends import catalog; catalog.names()", env={"PYTHONPATH": os.pathsep.join(
        [str(tmp_path), str(REPO)])})
    assert p.returncode != 0
    assert "backend 'full' is declared twice (cache_backends/full and entry point 'full')" in p.stderr


def test_a_plugin_that_cannot_be_imported_ends_any_command_with_one_line(tmp_path):
    """A broken plug-in (its spec raises) used to end `kvserve --help` with a traceback and exit 1."""
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("")
    (tmp_path / "brokenpkg" / "spec.py").write_text("raise RuntimeError('half written')\n")
    info = tmp_path / "brokenpkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenpkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvserve.backends]\nbroken = brokenpkg.spec\n")
    p = run(tmp_path, "", "-m", "server.cli", "--help", env={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])})
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr == ("kvserve: backend plug-in entry point 'broken': cannot import brokenpkg.spec (RuntimeError: "
                        "half written)\n")


def make_plugin(root: Path, package: str, spec: str, backend: str = "") -> dict:
    """A plug-in distribution ``package`` under ``root`` (its ``spec.py``: ``spec``; its ``backend.py``:
    ``backend``), found through the entry point; the environment that puts it (and kvserve) on the path."""
    (root / package).mkdir()
    (root / package / "__init__.py").write_text("")
    (root / package / "spec.py").write_text(textwrap.dedent(spec))
    if backend:
        (root / package / "backend.py").write_text(textwrap.dedent(backend))
    info = root / f"{package}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kvserve.backends]\n{package} = {package}.spec\n")
    return {"PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}


@pytest.mark.parametrize("setting, first", [
    ("port", "kvserve's settings"),
    ("kv_window_size", "cache_backends/window"),
    ("KV_INT8_GROUP_SIZE", "cache_backends/elastic"),  # the first of the two built-ins reading it
])
def test_a_plugin_option_taking_over_another_setting_is_refused(tmp_path, setting, first):
    """A plug-in's ``Option(setting="port")`` used to take PORT over silently (its default, its bound, its help)."""
    env = make_plugin(tmp_path, "grabber", f"""
        from cache_backends.declaration import BackendDecl, Option
        DECLARATIONS = (BackendDecl(name="grab", backend="cache_backends.full.backend:FullBackend",
                                    options=(Option("n", int, 7, low=1, setting={setting!r}),)),)
    """)
    for args in (("serve", "--help"), ("estimate", "--model", "llama-3-8b")):
        p = run(tmp_path, "", "-m", "server.cli", *args, env=env)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr == (f"kvserve: setting {setting.upper()} is declared twice ({first} and entry point "
                            "'grabber', option grab:n)\n")


def test_backends_of_one_plugin_may_share_a_setting(tmp_path):
    """As elastic reads int8's KV_INT8_GROUP_SIZE, two backends of one package may read one variable."""
    env = make_plugin(tmp_path, "pair", """
        from cache_backends.declaration import BackendDecl, Option
        N = Option("n", int, 7, low=1, setting="kv_pair_n", help="pair: n.")
        DECLARATIONS = (BackendDecl(name="one", backend="cache_backends.full.backend:FullBackend", options=(N,)),
                        BackendDecl(name="two", backend="cache_backends.full.backend:FullBackend", options=(N,)))
    """)
    p = run(tmp_path, """
        from server.config import load_settings
        s = load_settings(kv_pair_n="9")
        print(s.backend_options("one"), s.backend_options("two"))
    """, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "{'n': 9} {'n': 9}"


@pytest.mark.parametrize("args", [("estimate", "--model", "llama-3-8b"),
                                  ("advise", "--model", "llama-3-8b", "--context", "4096", "--memory-budget", "10GB"),
                                  ("serve", "--kv-backend", "nocls")])
def test_a_plugin_whose_class_is_missing_ends_the_command_with_one_line(tmp_path, args):
    """A declaration whose ``backend`` names a module that does not exist ended estimate and advise (where the
    plug-in is among the default rows, named or not) and serve with ModuleNotFoundError's traceback, exit 1."""
    env = make_plugin(tmp_path, "nocls", """
        from cache_backends.declaration import BackendDecl
        DECLARATIONS = (BackendDecl(name="nocls", backend="nocls.backend:Missing", order=60),)
    """)
    p = run(tmp_path, "", "-m", "server.cli", *args, env={**env, "MODEL_ID": str(REPO / "models" / "kjv-llama-mha")})
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr == (f"kvserve {args[0]}: backend 'nocls' (entry point 'nocls'): cannot load its class "
                        "nocls.backend:Missing (ModuleNotFoundError: No module named 'nocls.backend')\n")


def test_a_refusal_of_the_plugin_names_the_plugin_and_its_option(site):
    """``lastn+int8:n=8`` was refused as "window+int8: window=8 ...": a backend and an option the user never wrote."""
    p = run(site, "", "-m", "server.cli", "estimate", "--model", "llama-3-8b", "lastn+int8:n=8")
    assert p.returncode == 2
    assert p.stderr == ("kvserve estimate: lastn+int8: n=8 must be >= residual + group_size = 64 (the tokens the "
                        "quantized tier reads exact must lie inside the window)\n")
    p = run(site, """
        from cache_backends.geometry import ModelGeometry
        from cache_backends.registry import create
        try:
            create("lastn", ModelGeometry(num_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                                          dtype_bytes=4), n=True)
        except ValueError as exc:
            print(exc)
    """)
    assert p.stdout == "lastn: n must be an integer >= 1, got True\n", p.stderr
