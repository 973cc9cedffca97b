"""Shared fixtures: the shipped reference model (fp32, and in each precision under test), and a real server
on a free port."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads sleep, not spin (#26)

import httpx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tests.precision import Precision, selected

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = Path(os.environ.get("KVSERVE_TEST_MODEL", REPO / "models" / "kjv-llama-mha"))
PRECISIONS: list[Precision] = []
"""The device and dtypes of the value tests (``DEVICE``, ``DTYPE``: :mod:`tests.precision`)."""

if "OMP_NUM_THREADS" not in os.environ:  # an explicit thread count wins (1 on a shared machine: two spinning
    # intra-op threads on a loaded CPU ran the value tests 20x slower); at most 2, shared by the xdist workers
    WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: a test on the real pretrained model (SmolLM2-135M-Instruct, "
                                       "`kvserve fetch-model`); `pytest -m real_model` runs the group")
    config.addinivalue_line("markers", "value: a value test, run once per selected precision (DEVICE, DTYPE); "
                                       "`make test-gpu` runs these on CUDA")
    config.addinivalue_line("markers", "server: starts a `kvserve serve` process that loads the model, or uses a "
                                       "fixture that does (tests/conftest.py marks them); `make test-server` runs them")
    config.addinivalue_line("markers", "external: drives a third-party tool or environment (client venvs, Docker, "
                                       "Compose, Prometheus, Kubernetes schemas, Chromium, mkdocs, schemathesis, "
                                       "lm-eval, aiperf, inference-perf, guidellm); tests/conftest.py marks them")
    config.addinivalue_line("markers", "slow: takes more than about 5 s on two CPU cores (tests/conftest.py lists "
                                       "them); `make test-fast` leaves them out")
    try:
        PRECISIONS[:] = selected(os.environ.get("DEVICE"), os.environ.get("DTYPE"))
    except ValueError as exc:  # e.g. DEVICE=cuda without a CUDA device: one line, exit status 4
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config):
    return f"value tests in: {', '.join(map(str, PRECISIONS))} (DEVICE, DTYPE)"


def pytest_generate_tests(metafunc):
    """A test that takes ``precision`` (itself or through a fixture) runs once per selected precision."""
    if "precision" in metafunc.fixturenames:
        metafunc.parametrize("precision", PRECISIONS, ids=str, scope="session")


SERVER_TESTS = (
    "tests/test_calibration_cache.py::test_calibrate_fills_the_cache_and_the_server_starts_from_it",
    "tests/test_cli_serve.py::test_ctrl_c_exits_130_with_no_traceback",
    "tests/test_engine_core_thread.py::test_a_core_thread_that_fails_makes_the_server_exit_1_saying_why",
    "tests/test_engine_process_server.py::",
    "tests/test_long_price.py::test_the_server_warns_at_start_up_and_in_info",
    "tests/test_quality_budget.py::test_the_server_reports_its_choice_and_a_setting_over_the_budget",
    "tests/test_shutdown.py::",
    "tests/test_startup_failure.py::test_backend_that_cannot_calibrate_exits_1_with_one_line",
)
"""Tests that start ``kvserve serve`` themselves (node id prefixes: a module or one test); a test that gets its
server from a fixture is marked through that fixture (:func:`starts_server`)."""

EXTERNAL_TESTS = (
    "tests/test_aiperf.py::",
    "tests/test_compose.py::",
    "tests/test_docker.py::",
    "tests/test_docs.py::test_docs_build_strict",
    "tests/test_inference_perf.py::",
    "tests/test_k8s.py::test_manifest_validates",
    "tests/test_lm_eval.py::",
    "tests/test_lm_eval_task.py::",
    "tests/test_prometheus.py::test_promtool_checks_the_shipped_config",
    "tests/test_prometheus.py::test_dashboard_queries_return_data",
    "tests/test_real_clients.py::",
    "tests/test_schemathesis.py::",
    "tests/test_ui_browser.py::",
)
"""Tests that drive a third-party tool, a client in its own virtual environment, a container or a browser."""

SLOW_TESTS = (
    "tests/test_backends.py::test_bytes_are_the_tensors_and_match_the_formula_at_1024[dca+int4-{'threshold': 0.5}]",
    "tests/test_backends.py::test_bytes_are_the_tensors_and_match_the_formula_at_1024[dca+int8-{'threshold': 0.5}]",
    "tests/test_backends.py::test_bytes_are_the_tensors_and_match_the_formula_at_1024"
    "[dca+mla-{'threshold': 0.5, 'rank': 64}]",
    "tests/test_backends.py::test_int8_perplexity_gate",
    "tests/test_backends.py::test_lossless_setting_matches_full[dca-{'threshold': 1.01}]",
    "tests/test_backends.py::test_lossless_setting_matches_full[dca+mla-{'threshold': 1.01, 'rank': 512}]",
    "tests/test_bench_report.py::test_the_command_refuses_a_bad_argument_in_one_line",
    "tests/test_calibration_cache.py::test_calibrate_refuses_a_bad_backend_with_one_line",
    "tests/test_calibration_cache.py::test_the_key_follows_what_changes_the_fit",
    "tests/test_cli_serve.py::test_a_host_that_does_not_resolve_exits_2_naming_host",
    "tests/test_config.py::test_a_model_folder_without_config_json_is_named_in_one_line",
    "tests/test_config.py::test_serve_bad_flag_exits_2_with_one_line_and_help_lists_the_flags",
    "tests/test_config.py::test_serve_exits_nonzero_with_one_line",
    "tests/test_dca.py::test_a_quantized_inner_is_not_priced_above_dca_for_a_request_to_fit_alone",
    "tests/test_dca.py::test_a_reuse_layer_holds_only_its_window_in_the_pool",
    "tests/test_dca.py::test_admission_charges_dca_what_its_prefill_keeps_and_the_step_the_rest",
    "tests/test_dca.py::test_calibration_figures_match_what_is_served",
    "tests/test_dca.py::test_calibration_similarity_reported",
    "tests/test_dca.py::test_maps_predict_in_fp32_whatever_the_cache_dtype",
    "tests/test_dca.py::test_reuse_layer_attends_the_source_cache_through_folded_maps_exactly",
    "tests/test_dca.py::test_reuse_layers_store_nothing_and_skip_projections",
    "tests/test_dca.py::test_the_pool_serves_what_a_per_sequence_store_serves",
    "tests/test_dca.py::test_threshold_above_one_is_identical_to_full",
    "tests/test_dca.py::test_thresholds_are_calibrated_per_layer_and_span_on_what_the_inner_backend_stores",
    "tests/test_elastic.py::test_the_compressed_share_is_reported_for_elastic_only",
    "tests/test_elastic.py::test_under_pressure_it_compresses_instead_of_preempting",
    "tests/test_elastic.py::test_whole_prompt_prefills_beside_running_streams_are_not_readmitted_in_a_loop",
    "tests/test_engine.py::test_a_cancellation_in_the_step_that_admits_a_per_sequence_store",
    "tests/test_backend_plugin.py::",  # each test starts Python processes with the plug-in installed
    "tests/test_engine.py::test_kv_budget_is_a_hard_cap_for_every_backend",
    "tests/test_engine.py::test_reserved_store_never_allocates_past_its_reservation",
    "tests/test_engine_process.py::test_the_core_exits_when_the_server_process_is_killed",
    "tests/test_k8s.py::test_each_picker_spec_selects_one_series_of_a_live_scrape",  # an in-process server
    "tests/test_k8s.py::test_prefix_scorer_block_size_is_kvserves",
    "tests/test_mha2mla.py::test_shipped_mla_model_is_4x_smaller_and_reproduces_its_card",
    "tests/test_paged.py::test_a_mixed_step_of_several_backends",
    "tests/test_paged.py::test_two_long_single_requests_do_not_evict_each_other_in_turn",
    "tests/test_paged.py::test_two_wide_requests_on_a_full_pool_cannot_make_a_later_one_wait",
    "tests/test_precision.py::test_cuda_without_a_device_stops_pytest_with_one_line",
    "tests/test_quality_budget.py::test_dca_reuses_the_most_layers_its_budget_allows",
    "tests/test_quality_budget.py::test_the_agreement_bound_rejects_a_rank_and_the_search_takes_a_larger_one",
    "tests/test_quality_budget.py::test_the_search_takes_the_most_compressive_rank_within_the_budget",
    "tests/test_reference_model.py::test_heldout_perplexity_reproduces_the_model_card",
    "tests/test_robustness.py::test_tokenizing_runs_off_the_event_loop",
    "tests/test_robustness.py::test_truncate_tokenizes_only_the_tail_it_keeps",
    "tests/test_startup_failure.py::test_settings_found_wrong_before_the_load_exit_2_with_one_line",
    "tests/test_vllm_compat.py::test_served_model_name_aliases",
)
"""Tests over about 5 s on two busy CPU cores (``pytest --durations``; most start a Python process, an in-process
server or a calibration), besides those of :data:`SLOW_FIXTURES`. An entry with parameters (``[...]``, the precision
left out) is that case alone. Not listed: the modules whose one slow set-up (test_kv_sums.py's calibration, about
20 s; test_cache_salt.py's two in-process servers) serves dozens of quick tests."""

SLOW_FIXTURES = {"quick_report"}
"""Fixtures that take over about 5 s (``kvserve bench --quick``: about a minute); a test using one is ``slow``."""


def _listed(item, nodeid: str, entries: tuple[str, ...]) -> bool:
    """Whether an entry names the test's module (``path::``), its function, or this case of it (``name[id]``, the
    precision left out of the id)."""
    name = nodeid.split("[")[0]
    case = name
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        ids = f"-{callspec.id}-"
        if "precision" in callspec.params:
            ids = ids.replace(f"-{callspec.params['precision']}-", "-", 1)
        case = f"{name}[{ids.strip('-')}]"
    return any(nodeid.startswith(e) if e.endswith("::") else e in (name, case) for e in entries)


def pytest_collection_modifyitems(config, items):
    """Markers by what a test uses: ``value`` (it takes ``precision``), ``server`` (a server fixture, or listed),
    ``external`` and ``slow`` (listed, or through a slow fixture). The tiers in docs/development.md select by them."""
    for item in items:
        nodeid = "tests/" + item.nodeid.split("tests/", 1)[-1]  # the same id from the repository root or tests/
        if "precision" in item.fixturenames:
            item.add_marker(pytest.mark.value)
        if "starts_server" in item.fixturenames or _listed(item, nodeid, SERVER_TESTS):
            item.add_marker(pytest.mark.server)
        if _listed(item, nodeid, EXTERNAL_TESTS):
            item.add_marker(pytest.mark.external)
        if SLOW_FIXTURES & set(item.fixturenames) or _listed(item, nodeid, SLOW_TESTS):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def starts_server() -> None:
    """Requested by every fixture that starts a ``kvserve serve`` process: a test that uses such a fixture, directly
    or through another, has ``starts_server`` among its fixture names and gets the ``server`` marker."""


@pytest.fixture(scope="session", autouse=True)
def calibration_cache_dir(tmp_path_factory) -> Path:
    """Every server and ``kvserve calibrate`` the tests start keep their calibration cache here (one per
    run, shared by the tests), never in the user's home."""
    path = tmp_path_factory.mktemp("calibration-cache")
    before = os.environ.get("KV_CALIBRATION_CACHE_DIR")
    os.environ["KV_CALIBRATION_CACHE_DIR"] = str(path)
    yield path
    if before is None:
        os.environ.pop("KV_CALIBRATION_CACHE_DIR", None)
    else:
        os.environ["KV_CALIBRATION_CACHE_DIR"] = before


FITS_DIR: list[Path] = []
"""Where :func:`fits` keeps the run's calibration entries (set by :func:`in_process_fits`)."""


@pytest.fixture(scope="session", autouse=True)
def in_process_fits(tmp_path_factory) -> Path:
    """The folder of :func:`fits`: one per run, shared by the xdist workers of a run (entries are written
    atomically, so two workers fitting one entry at once each leave a valid one)."""
    base = tmp_path_factory.getbasetemp()
    path = base.parent / "fits" if os.environ.get("PYTEST_XDIST_WORKER") else base / "fits"
    path.mkdir(exist_ok=True)
    FITS_DIR[:] = [path]
    yield path
    FITS_DIR.clear()


def fits(model):
    """A calibration cache for a backend a test prepares in this process (``backend.prepare(model, ids,
    fits(model))``): the gqa codecs, mla bases and dca maps of a model, parameters and calibration slice are
    fitted once a run, not once a test (the same dca maps were fitted 46 times). A fit and its cached entry serve
    bit-identical artefacts (tests/test_calibration_cache.py); one folder per dtype, since the key leaves the
    dtype out (a bf16 test keeps its bf16 fit). Without a pytest session: no cache (every call fits)."""
    from cache_backends.calibration_cache import CalibrationCache

    if not FITS_DIR:
        return CalibrationCache(None)
    return CalibrationCache(FITS_DIR[0] / str(next(model.parameters()).dtype).removeprefix("torch."))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return MODEL_DIR


@pytest.fixture(scope="session")
def ref_model():
    """The shipped reference model and tokenizer (fp32, CPU, eval mode)."""
    from server.model_loading import load_model

    return load_model(str(MODEL_DIR), torch.device("cpu"), torch.float32)


@functools.cache
def _model_in(precision: Precision):
    from server.model_loading import load_model

    return load_model(str(MODEL_DIR), precision.device, precision.dtype)


@pytest.fixture(scope="session")
def value_model(precision):
    """The shipped reference model and tokenizer on the device and in the dtype under test (eval mode;
    loaded through the server's loader; each kept for the session, so no two share an ``id``)."""
    return _model_in(precision)


@pytest.fixture
def held_pricing(monkeypatch):
    """``(entered, release)``: the engine core's loading waits where the KV backends are calibrated and priced
    (:func:`server.engine_loading.prepare_backends`) until ``release`` is set; ``entered`` is set when it gets
    there. A core in a thread of this process (``ENGINE_PROCESS=false``) loads through the patch."""
    import threading

    import server.engine_loading

    entered, release = threading.Event(), threading.Event()
    prepare = server.engine_loading.prepare_backends

    def held(*args, **kwargs):
        entered.set()
        release.wait(120)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(server.engine_loading, "prepare_backends", held)
    yield entered, release
    release.set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_DEFAULTS = {"ENGINE_PROCESS": "false"}
"""What a test's server runs with unless the environment or the test says otherwise: the engine core in a thread
of the server's process (the same core and messages as in its own process, which costs seconds more per start;
tests/test_engine_process_server.py, tests/test_shutdown.py and tests/test_engine_process.py run the process)."""


class RunningServer:
    """A real ``kvserve serve`` process on 127.0.0.1 (stopped by the fixture).

    Args:
        env: its settings, over :data:`SERVER_DEFAULTS` and this process's environment; ``None`` unsets one.
        argv: the command (default ``python -m server.cli serve``).
    """

    def __init__(self, env: dict[str, str | None], argv: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**SERVER_DEFAULTS, **os.environ, "HOST": "127.0.0.1", "PORT": str(self.port),
                    "MODEL_ID": str(MODEL_DIR), "LOG_LEVEL": "warning", **env}
        full_env = {k: v for k, v in full_env.items() if v is not None}
        self.proc = subprocess.Popen(argv or [sys.executable, "-m", "server.cli", "serve"], env=full_env, cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 300  # calibration at start-up; slow when the machine is shared
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not become healthy in 300 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def metrics(self) -> dict[str, float]:
        """Scrape /metrics into {'name{k="v",...}' (labels sorted): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=5).text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
        return out


def server_with(env: dict[str, str], scope: str = "module"):
    """A fixture running ``kvserve serve`` with ``env``, stopped at the end of its ``scope`` (the module: a server
    with settings of its own, or one whose tests change what later tests would see)."""

    @pytest.fixture(scope=scope)
    def fixture(starts_server):
        srv = RunningServer(env)
        yield srv
        srv.stop()

    return fixture


server = server_with({"MAX_BATCH_SIZE": "8"}, scope="session")
"""The default server, one for the whole run: every module that uses it sends requests that leave it as it found
them (measured as differences of its metrics); a test that stops it, fills its KV or needs other settings takes a
:func:`server_with` fixture of its own."""
