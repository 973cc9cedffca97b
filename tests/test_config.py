"""Start-up configuration: bad values stop the server with one line naming the variable."""

import os
import subprocess
import sys

import pytest

from server.config import ConfigError, load_settings
from tests.conftest import MODEL_DIR, REPO


@pytest.mark.parametrize("env,var", [({"KV_BACKEND": "nope"}, "KV_BACKEND"), ({"DEVICE": "tpu"}, "DEVICE"),
                                     ({"PORT": "http"}, "PORT"), ({"MAX_BATCH_SIZE": "0"}, "MAX_BATCH_SIZE"),
                                     ({"DTYPE": "float8"}, "DTYPE"), ({"KV_DCA_WINDOW": "-1"}, "KV_DCA_WINDOW"),
                                     # nan/inf were accepted, then every GET /info failed to encode them (500)
                                     ({"KV_DCA_THRESHOLD": "nan"}, "KV_DCA_THRESHOLD"),
                                     ({"KV_DCA_THRESHOLD": "inf"}, "KV_DCA_THRESHOLD"),
                                     ({"KV_INT8_VALUE_BITS": "3"}, "KV_INT8_VALUE_BITS"),
                                     ({"KV_INT4_KEY_BITS": "four"}, "KV_INT4_KEY_BITS"),
                                     ({"KV_INT4_ROTATE": "maybe"}, "KV_INT4_ROTATE"),
                                     ({"KV_INT4_RESIDUAL": "-1"}, "KV_INT4_RESIDUAL")])
def test_bad_value_names_the_variable(monkeypatch, env, var):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=var):
        load_settings()


HUGE = "99999999999999999999"


@pytest.mark.parametrize("var, why", [
    # passed validation, then the engine core died on msgspec's int64 limit (exit 1, tracebacks)
    ("KV_WINDOW_SIZE", "less than or equal to 16777216"), ("KV_INT8_RESIDUAL", "less than or equal to 16777216"),
    ("KV_DCA_PROBE_INTERVAL", "less than or equal to 9223372036854775807"),
    ("MAX_BATCH_SIZE", "at most 9223372036854775807"), ("KV_CACHE_BUDGET_BYTES", "at most 9223372036854775807"),
    ("MAX_TOTAL_TOKENS", "at most 9223372036854775807")])
def test_a_huge_integer_is_refused_naming_the_variable(monkeypatch, var, why):
    monkeypatch.setenv(var, HUGE)
    with pytest.raises(ConfigError, match=f"invalid {var}='{HUGE}': .*{why}"):
        load_settings()


def test_a_quantization_group_larger_than_a_block_is_refused_at_once(monkeypatch):
    """A huge KV_INT8_GROUP_SIZE ended start-up (exit 1) blaming KV_CACHE_BUDGET_BYTES: a block is rounded up to
    whole groups, so no budget held a page."""
    monkeypatch.setenv("KV_INT8_GROUP_SIZE", "99999999")
    with pytest.raises(ConfigError, match="invalid KV_INT8_GROUP_SIZE='99999999': .*less than or equal to 1024"):
        load_settings()
    monkeypatch.setenv("KV_INT8_GROUP_SIZE", "1024")
    assert load_settings().kv_int8_group_size == 1024


@pytest.mark.parametrize("spec, why", [
    (f"window:window={HUGE}", f"window must be <= 16777216, got {HUGE}"),
    ("int8:group_size=2048", "group_size must be <= 1024, got 2048"),
    (f"dca:probe_interval={HUGE}", f"probe_interval must be <= 9223372036854775807, got {HUGE}")])
def test_a_spec_option_above_its_bound_is_refused(spec, why):
    from cache_backends.spec import check_options, parse_spec

    with pytest.raises(ValueError, match=f"^{spec}: {why}$"):
        parse_spec(spec)
    with pytest.raises(ValueError, match=why):
        check_options(spec.split(":")[0], {spec.split(":")[1].split("=")[0]: int(spec.split("=")[1])})


def test_serve_refuses_a_huge_window_with_one_line():
    p = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--kv-backend", "window"], cwd=REPO,
                       env={**os.environ, "KV_WINDOW_SIZE": HUGE}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith(f"kvserve: invalid KV_WINDOW_SIZE='{HUGE}'")
    assert len(p.stderr.strip().splitlines()) == 1


def test_unknown_backend_lists_allowed_values(monkeypatch):
    monkeypatch.setenv("KV_BACKEND", "nope")
    with pytest.raises(ConfigError, match="allowed: .*full"):
        load_settings()


def test_a_bench_budget_name_as_a_served_backend_says_whose_it_is(monkeypatch):
    monkeypatch.setenv("KV_BACKENDS", "full,gqa@budget")
    with pytest.raises(ConfigError, match="unknown backend 'gqa@budget'.*'@budget' is kvserve bench's alone.*give "
                                          "the backend, 'gqa', whose setting the budget chooses at start-up"):
        load_settings()


@pytest.mark.parametrize("variable,value,says", [
    ("KV_BACKEND", "snapkv:capacity=64,window=8", "snapkv with KV_SNAPKV_CAPACITY=64 KV_SNAPKV_WINDOW=8"),
    ("KV_BACKEND", "window:sinks=4,window=64", "window with KV_WINDOW_SINKS=4 KV_WINDOW_SIZE=64"),
    ("KV_BACKENDS", "full,int8:value_bits=4", "int8 with KV_INT8_VALUE_BITS=4"),
])
def test_a_spec_as_a_served_backend_names_the_settings_that_take_its_options(monkeypatch, variable, value, says):
    """The docs write settings as specs (``snapkv:capacity=64``), which estimate, advise and bench take; the server
    said only "unknown backend", though each option has its setting."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match="takes its options from settings: " + says.replace("+", r"\+")):
        load_settings()


def test_serve_exits_nonzero_with_one_line():
    env = {**os.environ, "KV_BACKEND": "nope"}
    p = subprocess.run([sys.executable, "-m", "server.cli", "serve"], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "KV_BACKEND" in lines[0] and "full" in lines[0]


def test_a_model_folder_without_config_json_is_named_in_one_line(tmp_path):
    """A folder with no config.json got transformers' "Unrecognized model ... Should have a `model_type` key in
    its config.json", a missing path "Repo id must be in the form ...": the line names the folder and what is
    missing, and the flag when the folder came from one."""
    (tmp_path / "notes.txt").write_text("not a model")
    p = subprocess.run([sys.executable, "-m", "server.cli", "calibrate", "--model", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"kvserve: invalid --model={str(tmp_path)!r}: the folder has no config.json (a model folder holds "
        "config.json, the tokenizer files and the weights)"], p.stderr
    from server.backend_check import check_backend

    with pytest.raises(ConfigError, match=f"^invalid MODEL_ID={str(tmp_path)!r}: the folder has no config.json"):
        check_backend(load_settings(model_id=str(tmp_path)))
    with pytest.raises(ConfigError, match=f"^invalid MODEL_ID='{tmp_path}/nothing': no such folder$"):
        check_backend(load_settings(model_id=str(tmp_path / "nothing")))


def test_bit_widths_from_the_environment_are_numbers(monkeypatch):
    """KV_*_BITS arrive as strings: "4" is 4 (a Literal[4, 8] field refused it: the k8v4 server did not start)."""
    monkeypatch.setenv("KV_INT8_VALUE_BITS", "4")
    monkeypatch.setenv("KV_INT4_KEY_BITS", "8")
    s = load_settings()
    assert s.backend_options("int8")["value_bits"] == 4 and s.backend_options("int4")["key_bits"] == 8


def test_defaults_derive_token_limits_from_the_model():
    s = load_settings()
    assert s.kv_backend == "full" and s.port == 8000
    assert s.token_limits(1024) == (1023, 1024)


def test_the_engine_core_runs_in_its_own_process_by_default(monkeypatch):
    monkeypatch.delenv("ENGINE_PROCESS", raising=False)
    assert load_settings().engine_process is True
    monkeypatch.setenv("ENGINE_PROCESS", "false")  # the same engine core in a thread of the server's process
    assert load_settings().engine_process is False


def test_default_serves_full_and_int8_per_request(monkeypatch):
    """Out of the box a request (and the built-in page) can compare `full` and `int8`: neither needs
    calibration, so they are served besides KV_BACKEND while KV_BACKENDS is unset."""
    monkeypatch.delenv("KV_BACKENDS", raising=False)
    assert load_settings().served_backends() == ["full", "int8"]
    monkeypatch.setenv("KV_BACKEND", "mla")
    s = load_settings()
    assert s.served_backends() == ["mla", "full", "int8"] and s.optional_backends() == {"full", "int8"}
    monkeypatch.setenv("KV_BACKENDS", "")  # empty: KV_BACKEND alone
    assert load_settings().served_backends() == ["mla"] and load_settings().optional_backends() == set()
    monkeypatch.setenv("KV_BACKENDS", "int8,dca")
    assert load_settings().served_backends() == ["mla", "int8", "dca"]


def test_default_extras_the_model_cannot_take_are_left_out(monkeypatch):
    """On a native-MLA model int8 is refused: from the default it is dropped, asked for it stops start-up."""
    from cache_backends.geometry import ModelGeometry
    from server.engine_loading import create_backends

    import transformers

    config = transformers.AutoConfig.from_pretrained(REPO / "models" / "kjv-llama-mla")
    geometry = ModelGeometry.from_config(config, __import__("torch").float32)
    monkeypatch.setenv("KV_BACKEND", "mla")
    monkeypatch.delenv("KV_BACKENDS", raising=False)
    assert list(create_backends(load_settings(), geometry)) == ["mla", "full"]
    monkeypatch.setenv("KV_BACKENDS", "int8")
    with pytest.raises(ValueError):
        create_backends(load_settings(), geometry)


def serve_settings(*flags: str):
    """The settings `kvserve serve FLAGS...` starts with (parsed by the real parser, not started)."""
    from server.cli import build_parser
    from server.serve_flags import flag, overrides

    given = overrides(build_parser().parse_args(["serve", *flags]))
    return load_settings(flags={name: flag(name) for name in given}, **given)


def test_serve_flags_set_the_settings(monkeypatch):
    """vLLM and TGI users pass settings as flags: `kvserve serve --port 18309` was "unrecognized arguments"."""
    monkeypatch.delenv("PORT", raising=False)
    s = serve_settings("--port", "18309", "--host", "0.0.0.0", "--kv-backend", "int8", "--model", "/m",
                       "--kv-prefix-caching", "false", "--kv-int8-value-bits", "4", "--kv-dca-threshold", "0.9")
    assert (s.port, s.host, s.kv_backend, s.model_id) == (18309, "0.0.0.0", "int8", "/m")
    assert s.kv_prefix_caching is False and s.kv_int8_value_bits == 4 and s.kv_dca_threshold == 0.9
    assert serve_settings("--model-id", "/n").model_id == "/n"
    assert serve_settings("--kv-int4-rotate").kv_int4_rotate is True  # a bare boolean flag: true
    assert serve_settings().port == 8000  # no flag: the default


def test_serve_flag_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("PORT", "9000")
    monkeypatch.setenv("KV_BACKEND", "int8")
    s = serve_settings("--port", "18309")
    assert s.port == 18309 and s.kv_backend == "int8"  # the variable still sets what no flag gives
    monkeypatch.setenv("PORT", "http")  # a bad variable a flag replaces is not read
    assert serve_settings("--port", "18309").port == 18309


def test_every_setting_has_a_flag():
    from server.cli import build_parser
    from server.config import Settings

    from server.serve_flags import overrides

    parser = build_parser()
    for name in Settings.model_fields:  # generated from the fields: one added later gets its flag too
        assert overrides(parser.parse_args(["serve", "--" + name.replace("_", "-"), "1"])) == {name: "1"}


@pytest.mark.parametrize("flags, name", [(["--port", "http"], "--port"), (["--kv-backend", "nope"], "--kv-backend"),
                                         (["--max-batch-size", "0"], "--max-batch-size"),
                                         (["--kv-prefix-caching", "maybe"], "--kv-prefix-caching")])
def test_bad_flag_value_names_the_flag(flags, name):
    with pytest.raises(ConfigError, match=f"invalid {name}="):
        serve_settings(*flags)


def test_serve_bad_flag_exits_2_with_one_line_and_help_lists_the_flags():
    p = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "http"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--port='http'" in lines[0] and "integer" in lines[0]
    p = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0
    assert "--port N" in p.stdout and "TCP port to listen on" in p.stdout and "--kv-dca-window" in p.stdout
    assert "25% of the memory" in p.stdout  # argparse's %-formatting of help text is escaped


def test_serve_help_states_defaults_and_statuses_as_they_are():
    """``--served-model-name`` said "[default: '']" beside "Default: MODEL_ID as given"; ``--payload-limit`` said
    "larger gets 422", but the OpenAI routes answer 400."""
    from server.cli import build_parser

    serve = build_parser().parse_known_args(["serve"])[0].subparser
    text = " ".join(serve.format_help().split())
    assert "MODEL_ID as given (as vLLM names it), and a local model folder's name as well. [env SERVED_MODEL_NAME]" \
        in text
    assert "default: ''" not in text
    assert "larger gets 422 (400 on the OpenAI routes). [env PAYLOAD_LIMIT; default: 2000000]" in text
    assert "Default: MAX_TOTAL_TOKENS - 1. [env MAX_INPUT_TOKENS]" in text


def test_serve_help_states_the_defaults_the_docs_and_the_budget_give():
    """``--kv-quality-long-context`` said "default: unset" where the docs say `auto`; the options the quality budget
    chooses when left unset said their static default (``KV_DCA_THRESHOLD``'s 0.95, ``KV_INT4_ROTATE``'s False);
    booleans were Python's (True, False)."""
    from server.cli import build_parser

    serve = build_parser().parse_known_args(["serve"])[0].subparser
    text = " ".join(serve.format_help().split())
    assert "[env KV_QUALITY_LONG_CONTEXT; default: auto]" in text
    for var, without in [("KV_GQA_GROUPS", "from the model"), ("KV_MLA_RANK", "from the model"),
                         ("KV_DCA_THRESHOLD", "0.95"), ("KV_INT4_ROTATE", "false")]:
        assert f"[env {var}; default: chosen by the quality budget (KV_QUALITY_BUDGET=off: {without})]" in text
    # int8's is not the budget's to choose; a boolean as the variable takes it (true/false, not Python's False)
    assert "[env KV_INT8_ROTATE; default: false]" in text and "[env KV_PREFIX_CACHING; default: true]" in text


@pytest.mark.parametrize("cpu_max,want", [(None, 63), ("max 100000", 63), ("200000 100000", 1), ("350000 100000", 3)])
def test_default_torch_threads_leave_one_usable_cpu_to_the_http_side(monkeypatch, tmp_path, cpu_max, want):
    """TORCH_NUM_THREADS=0: the CPUs the process may use (its affinity, capped by a cgroup v2 quota: a container's
    ``--cpus 2`` on a 64-CPU host is 2) less one, and never more than torch's own default."""
    import torch

    import server.engine_loading as loading

    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max + "\n")
    monkeypatch.setattr(loading, "CGROUP_CPU_MAX", path)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    assert loading.default_torch_threads() == want
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert loading.default_torch_threads() == min(want, 2)


@pytest.mark.parametrize("given,want", [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
                                        ({"GOMP_SPINCOUNT": "10000"}, None)])
def test_kvserve_makes_idle_threads_sleep_unless_told_how_they_wait(monkeypatch, given, want):
    """``kvserve`` sets OMP_WAIT_POLICY=PASSIVE, except when it or libgomp's GOMP_SPINCOUNT (a bounded spin, which
    PASSIVE would override: libgomp then never spins) is given."""
    from server.cli import passive_threads

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    passive_threads()
    assert os.environ.get("OMP_WAIT_POLICY") == want


def test_the_api_key_comes_from_a_file(tmp_path, monkeypatch):
    """``--api-key K`` is readable in the process list by every local user: ``--api-key-file`` (``API_KEY_FILE``)
    reads it from a file (a mounted secret), its one line without the white space around it."""
    from fastapi.testclient import TestClient

    from server.app import create_app

    monkeypatch.delenv("API_KEY", raising=False)
    key = tmp_path / "key"
    key.write_text("  s3cret \n")
    s = serve_settings("--api-key-file", str(key))
    assert s.api_key == "s3cret"
    client = TestClient(create_app(s))  # no lifespan: the model never loads
    assert client.get("/info").status_code == 401
    assert client.get("/info", headers={"Authorization": "Bearer s3cret"}).status_code == 503  # past the key: loading
    monkeypatch.setenv("API_KEY_FILE", str(key))
    assert load_settings().api_key == "s3cret"


@pytest.mark.parametrize("content, why", [(None, "cannot be read (No such file or directory)"), ("\n", "is empty"),
                                          ("a\nb\n", "holds more than one line"), ("k" * 5000, "is longer than 4096")])
def test_a_key_file_that_holds_no_key_names_the_flag_and_why(tmp_path, content, why):
    key = tmp_path / "key"
    if content is not None:
        key.write_text(content)
    with pytest.raises(ConfigError) as err:
        serve_settings("--api-key-file", str(key))
    assert str(err.value).startswith(f"invalid --api-key-file='{key}': {why}")


def test_a_key_and_a_key_file_are_refused_together(tmp_path, monkeypatch):
    key = tmp_path / "key"
    key.write_text("s3cret")
    monkeypatch.setenv("API_KEY", "other")
    with pytest.raises(ConfigError, match="API_KEY and API_KEY_FILE are both set: set one") as err:
        serve_settings("--api-key-file", str(key))
    assert "s3cret" not in str(err.value) and "other" not in str(err.value)


def test_a_key_on_the_command_line_is_served_with_a_warning():
    """vLLM and TGI take ``--api-key`` too: refusing it would break their users' commands, so it is served, and the
    warning says where the key is better given (the key itself is never printed)."""
    env = {**os.environ, "MODEL_ID": str(MODEL_DIR)}
    env.pop("API_KEY", None)
    p = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--api-key", "s3cret", "--host", "256.1.1.1"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2  # the host stops it before the model loads
    warning, host = p.stderr.strip().splitlines()
    assert warning == ("kvserve: warning: --api-key puts the key in the process list, where every local user can read "
                       "it; give it with --api-key-file PATH or the API_KEY environment variable")
    assert "HOST (--host)" in host and "s3cret" not in p.stderr


def test_chat_template_is_text_or_a_regular_file_and_must_parse(tmp_path, monkeypatch):
    """``CHAT_TEMPLATE`` takes the template or a file holding it (as vLLM's ``--chat-template``), checked at start:
    a missing file, a FIFO (whose open would block the start) and a Jinja syntax error are one-line errors."""
    import os

    from server.config import Settings

    text = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(text)
    assert Settings(chat_template=text).chat_template == text
    assert Settings(chat_template=str(tmp_path / "t.jinja")).chat_template == text
    odd = tmp_path / "a{{b}}"  # a path holding "{{" is still a path
    odd.mkdir()
    (odd / "t.jinja").write_text(text)
    assert Settings(chat_template=str(odd / "t.jinja")).chat_template == text
    loops = "{% for m in messages %}{% break %}{% endfor %}{% generation %}x{% endgeneration %}"
    assert Settings(chat_template=loops).chat_template == loops  # transformers' extensions, as it compiles them
    (tmp_path / "big.jinja").write_text("{#" + "x" * (1 << 20) + "#}" + text)
    os.mkfifo(tmp_path / "fifo")
    for bad, why in [(str(tmp_path / "missing.jinja"), "regular file"), (str(tmp_path / "fifo"), "regular file"),
                     ("{% for m in messages %}", "not a valid Jinja template"),
                     (str(tmp_path / "big.jinja"), "a chat template has at most 1048576"),
                     (str(tmp_path / "miss{{ing}}.jinja"), "regular file")]:  # a path, though it holds "{{"
        monkeypatch.setenv("CHAT_TEMPLATE", bad)
        with pytest.raises(ConfigError, match=f"invalid CHAT_TEMPLATE=.*{why}"):
            load_settings()
