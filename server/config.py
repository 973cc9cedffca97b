"""Server settings: one pydantic-settings object, read from environment variables once at start-up.

Nothing else in kvserve reads the environment. A bad value raises :class:`ConfigError` with a one-line
message naming the variable and what is allowed; ``kvserve serve`` prints it and exits with status 2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, create_model, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cache_backends import catalog
from cache_backends.declaration import INT64_MAX, Option
from server.long_context import parse_long_context


REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = str(REPO_ROOT / "models" / "kjv-llama-mha")


BACKEND_OPTIONS = {name: {o.name: o.setting for o in decl.options if o.setting}
                   for name, decl in catalog.declarations().items() if any(o.setting for o in decl.options)}
"""Backend name -> {constructor option: settings field}, from the backends' declarations
(:attr:`cache_backends.declaration.Option.setting`)."""


# Served besides KV_BACKEND when KV_BACKENDS is unset, so that a request (and the built-in page) can compare
# against the exact cache out of the box: neither needs calibration, so they cost nothing at start-up.
DEFAULT_EXTRA_BACKENDS = ("full", "int8")


def default_calibration_cache_dir() -> str:
    """``$XDG_CACHE_HOME/kvserve/calibration``, else ``~/.cache/kvserve/calibration`` (where huggingface_hub
    puts its own cache, by the same rule)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "kvserve" / "calibration")


def _is_file(text: str) -> bool:
    """Whether ``text`` names a regular file (False for a name the system refuses: too long, a NUL in it)."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False


MAX_CHAT_TEMPLATE_BYTES = 1 << 20
"""Largest ``CHAT_TEMPLATE`` file read (bytes): the largest templates published are about 20 KB."""


class ConfigError(ValueError):
    """A setting is invalid; the message is one line naming the variable and the allowed values."""


class _GeneralSettings(BaseSettings):
    """kvserve configuration but the backends' options (environment variables, case-insensitive)."""

    model_config = SettingsConfigDict(env_prefix="", case_sensitive=False, extra="ignore")

    model_id: str = Field(DEFAULT_MODEL, description="Local model folder or hub id.")
    kv_backend: str = Field("full", description="KV-cache backend (the default for requests).")
    kv_backends: str | None = Field(None, description="Comma list of backends a request may ask for besides "
                                    "KV_BACKEND; unset: full and int8 (neither needs calibration), where the "
                                    "model takes them; empty: KV_BACKEND alone.")
    host: str = Field("127.0.0.1", description="Address to listen on (0.0.0.0: every interface).")
    port: int = Field(8000, ge=1, le=65535, description="TCP port to listen on.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the model runs (auto: cuda when "
                                                   "available, else cpu).")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field("auto", description="Weights' and KV's "
                                                                     "dtype (auto: float32 on cpu, bfloat16 on cuda).")
    max_batch_size: int = Field(16, ge=1, description="Most sequences decoding at once.")
    max_concurrent_requests: int = Field(128, ge=1, description="Generation requests in flight (queued, running or "
                                         "sending their answer; a request counts once whatever its `n`); more "
                                         "get 429.")
    max_input_tokens: int | None = Field(None, ge=1, description="Default: MAX_TOTAL_TOKENS - 1.")
    max_total_tokens: int | None = Field(None, ge=2, description="Default: the model's max_position_embeddings.")
    max_stop_sequences: int = Field(16, ge=0, description="Most stop sequences per request (each is checked "
                                    "against the text's tail after every token).")
    served_model_name: str = Field("", description="Comma list of the names the OpenAI routes accept in `model` "
                                   "(vLLM's --served-model-name); the first is the one answers carry. Default: "
                                   "MODEL_ID as given (as vLLM names it), and a local model folder's name as well.")
    tool_call_parser: Literal["hermes", "none"] = Field("hermes", description="How `tool_choice: auto` (the "
                                                        "default with `tools`) finds calls in a chat answer: `hermes` "
                                                        "(`<tool_call>` JSON, or a bare JSON call); `none` refuses "
                                                        "`auto` with a 400 (vLLM's --tool-call-parser).")
    chat_template: str | None = Field(None, description="A Jinja chat template, or a file holding one, used in "
                                                        "place of the tokenizer's (vLLM's --chat-template).")
    shutdown_grace_seconds: float = Field(30.0, ge=0, allow_inf_nan=False, description="On SIGTERM: seconds the "
                                          "requests in flight have to finish before the rest are ended.")
    max_header_bytes: int = Field(16384, ge=1024, description="Largest request head (request line + headers, "
                                  "bytes); larger gets 431 and the connection is closed.")
    max_headers: int = Field(100, ge=8, description="Most request header fields; more get 431.")
    request_head_timeout: float = Field(10.0, gt=0, allow_inf_nan=False, description="Seconds a connection has "
                                        "to send a whole request head (request line + headers), from its opening "
                                        "or a kept-alive one's next request; later: 408 and closed. Bodies: "
                                        "REQUEST_BODY_TIMEOUT.")
    request_body_timeout: float = Field(30.0, gt=0, allow_inf_nan=False, description="Seconds a request body may "
                                        "go without new bytes (between reads, from the head on); later: 408 and "
                                        "closed.")
    max_connections: int = Field(1000, ge=1, description="Most HTTP connections open at once (idle kept-alive "
                                 "ones included); one more gets 503 with Retry-After: 1 and is closed.")
    torch_num_threads: int = Field(0, ge=0, description="torch intra-op threads of the engine (0: one per CPU the "
                                   "process may use, less one left to the HTTP side; at least 1, at most torch's "
                                   "default); idle threads "
                                   "wait passively (OMP_WAIT_POLICY=PASSIVE, set by `kvserve` unless it or "
                                   "GOMP_SPINCOUNT is given).")
    kv_attention: Literal["auto", "kernel", "torch"] = Field("auto", description="What attends a step over the KV "
                                                             "pool: kernel (kvserve's C++ op, reading every stored "
                                                             "form in place; CPU), torch (the torch reference path, "
                                                             "gathering the pages), auto (the kernel where it builds "
                                                             "and the device is the CPU, else torch).")
    kv_cache_budget_bytes: int | None = Field(None, ge=1, description="Bytes of the KV pool, preallocated at "
                                              "start-up (default: the pages MAX_BATCH_SIZE sequences of "
                                              "MAX_TOTAL_TOKENS tokens of the costliest served backend hold, at "
                                              "most 25% of the memory free at start-up).")
    kv_block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block (int8-family backends: rounded "
                               "up to whole quantization groups).")
    kv_prefix_caching: bool = Field(True, description="Automatic prefix caching: full KV blocks stay cached after "
                                    "their request and a prompt that starts with cached blocks prefills only the "
                                    "rest (paged backends; not dca).")
    kv_sliding_window_pool: bool = Field(True, description="On a model with sliding-window layers (Gemma 3), "
                                         "full, int8 and int4 keep only each sliding layer's window in the KV pool (its "
                                         "older pages go back as decode proceeds); false: every layer keeps every token (the "
                                         "attention still sees only the window).")
    engine_process: bool = Field(True, description="Run the engine core (scheduler, KV cache, model) in its own "
                                 "process; false: in a thread of the server's process. Either way it is fed over ZMQ "
                                 "with plain messages, detokenization, stop sequences and streaming stay in the "
                                 "server's process, and if the core ends unasked the server exits 1.")
    engine_step_timeout_s: float = Field(120.0, ge=0, allow_inf_nan=False, description="A busy engine core that "
                                         "sends nothing for this many seconds (no step finished) is hung: it is "
                                         "killed, its requests end with an error, /health answers 503 and the server "
                                         "exits 1, as when the core dies. A core process stopped by a signal "
                                         "(SIGSTOP) is so after 5 s whatever this is. 0: never.")
    max_num_batched_tokens: int = Field(256, ge=0, description="Tokens one engine step processes: each decoding "
                                        "sequence's one, prompt chunks the rest (chunked prefill); 0 prefills "
                                        "whole prompts.")
    prefill_itl_ratio: float = Field(2.0, ge=0, allow_inf_nan=False,
                                     description="While sequences decode, or a step writes a short prompt whole "
                                     "beside a long one, a step that also prefills prompt chunks costs at most "
                                     "this many decode steps (both measured as the engine runs): the running "
                                     "streams' inter-token latency and a short prompt's first token stay within "
                                     "it when long prompts arrive, and those prompts' first tokens come later; "
                                     "0: chunks of MAX_NUM_BATCHED_TOKENS alone.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log and access-log level.")
    payload_limit: int = Field(2_000_000, ge=1, description="Largest request body (bytes); larger gets 422 (400 on "
                               "the OpenAI routes).")
    api_key: str | None = Field(None, description="When set, routes but /health and /metrics need a Bearer token. "
                                "Given as a flag, the key is readable in the process list by every local user: "
                                "prefer API_KEY_FILE (--api-key-file) or this variable.")
    api_key_file: str | None = Field(None, description="A file holding the API key (its one line; surrounding "
                                     "white space is dropped), e.g. a mounted secret: the key is then neither on "
                                     "the command line nor in the environment. Not with API_KEY.")
    # backend parameters (see each backend's module docstring)
    kv_calibration_file: str | None = Field(None, description="gqa/mla/dca: calibration text (plain, chapters "
                                            "split by blank lines, or .jsonl of {\"text\": ...}); default: the "
                                            "model folder's calib_slice.txt, else the packaged KJV text.")
    kv_calibration_cache_dir: str | None = Field(default_factory=default_calibration_cache_dir,
                                                 description="gqa/mla/dca: where fitted codecs, bases and maps "
                                                 "are saved and reused at the next start (see `kvserve "
                                                 "calibrate`); empty: fit at every start, save nothing.")
    kv_quality_budget: float | None = Field(1.0, ge=0, allow_inf_nan=False, description="Bound on each served "
                                            "backend's price, percent perplexity increase vs full on the "
                                            "calibration text (from the mean KL divergence per token): gqa, mla, "
                                            "dca and int4 left at their defaults choose their most compressive "
                                            "setting within it; an explicit setting over it is served with a "
                                            "warning. `off`: no pricing, no search (the fixed defaults).")
    kv_quality_min_agreement: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, description="A second "
                                                   "bound of the quality budget: the least share (0-1] of the "
                                                   "calibration text's positions where a backend's most likely next "
                                                   "token is full's (teacher forced); the search keeps only settings "
                                                   "within both bounds, and an explicit setting under it is served "
                                                   "with a warning. Unset: no bound (the agreement is still "
                                                   "reported). Needs KV_QUALITY_BUDGET.")
    kv_quality_long_context: Annotated[int | None, BeforeValidator(parse_long_context)] = Field(
        None, description="The quality budget's long input, tokens: a backend that can drop far tokens (window, "
        "window+int8/int4) is also priced on one input this long (perplexity on its last 256 tokens and 4 needles "
        "to retrieve), and a warning says when it loses what full keeps. Unset or `auto`: 8192, capped by the "
        "model's positions and MAX_TOTAL_TOKENS; `off` or 0: none; else at least 1024.")

    @field_validator("kv_backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        from cache_backends.spec import budget_hint, check_composition, served_spec_hint

        available = catalog.available

        if _declares_refusals(v):
            check_composition(v)  # a composition a part declares it cannot make names why
        if v not in available():
            raise ValueError(f"unknown backend {v!r}; allowed: {', '.join(available())}{budget_hint(v)}"
                             f"{served_spec_hint(v)}")
        return v

    @field_validator("kv_backends")
    @classmethod
    def _known_backends(cls, v: str | None) -> str | None:
        from cache_backends.spec import budget_hint, check_composition, served_spec_hint

        available = catalog.available

        for name in filter(None, (x.strip() for x in (v or "").split(","))):
            if _declares_refusals(name):
                check_composition(name)  # a composition a part declares it cannot make names why
            if name not in available():
                raise ValueError(f"unknown backend {name!r}; allowed: {', '.join(available())}{budget_hint(name)}"
                                 f"{served_spec_hint(name)}")
        return v

    @field_validator("*")
    @classmethod
    def _int64(cls, v):
        """Any integer setting is at most :data:`INT64_MAX`: a larger one passed validation, then ended the engine
        core at start-up (its messages carry int64) with a traceback and exit 1."""
        if isinstance(v, int) and not isinstance(v, bool) and v > INT64_MAX:
            raise ValueError(f"must be at most {INT64_MAX}")
        return v

    @field_validator("kv_quality_budget", "kv_quality_min_agreement", mode="before")
    @classmethod
    def _budget_off(cls, v):
        return None if isinstance(v, str) and v.strip().lower() in ("", "off", "none") else v

    @field_validator("kv_cache_budget_bytes", "max_input_tokens", "max_total_tokens",
                     "kv_calibration_file", "kv_calibration_cache_dir", mode="before")
    @classmethod
    def _empty_is_none(cls, v):
        return None if v == "" else v

    @field_validator("api_key_file")
    @classmethod
    def _key_file_readable(cls, v: str | None) -> str | None:
        if v:
            read_api_key(v)
        return v

    @model_validator(mode="after")
    def _key_from_file(self) -> "Settings":
        if self.api_key_file:
            if self.api_key:
                raise ValueError("API_KEY and API_KEY_FILE are both set: set one")
            self.api_key = read_api_key(self.api_key_file)
        return self

    @model_validator(mode="after")
    def _agreement_needs_budget(self) -> "Settings":
        if self.kv_quality_min_agreement is not None and self.kv_quality_budget is None:
            raise ValueError("KV_QUALITY_MIN_AGREEMENT bounds the quality budget's prices, and KV_QUALITY_BUDGET "
                             "is off: set a budget, or unset KV_QUALITY_MIN_AGREEMENT")
        return self

    @model_validator(mode="after")
    def _limits(self) -> "Settings":
        if self.max_total_tokens and self.max_input_tokens and self.max_total_tokens <= self.max_input_tokens:
            raise ValueError(f"MAX_TOTAL_TOKENS ({self.max_total_tokens}) must be greater than "
                             f"MAX_INPUT_TOKENS ({self.max_input_tokens})")
        return self

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, v: str | None) -> str | None:
        """The template itself: read from the file ``v`` names when it holds no Jinja, then parsed (a syntax error
        fails the start, not the first chat request)."""
        if not v:
            return None
        path_like = "\n" not in v and v.startswith(("/", "./", "../", "~"))  # no template starts so
        if _is_file(v) or path_like or ("{{" not in v and "{%" not in v):  # a path (even holding "{{"), else text
            path = Path(v).expanduser()
            if not _is_file(str(path)):  # a FIFO or a device would block the start
                raise ValueError("is neither a Jinja template nor a regular file holding one")
            if (size := path.stat().st_size) > MAX_CHAT_TEMPLATE_BYTES:
                raise ValueError(f"names a file of {size} bytes; a chat template has at most {MAX_CHAT_TEMPLATE_BYTES}")
            try:
                v = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"is neither a Jinja template nor a readable template file ({exc})") from None
        import jinja2
        from transformers.utils import chat_template_utils

        try:  # as transformers compiles it: its sandbox, loop controls and {% generation %} tag
            chat_template_utils._compile_jinja_template(v)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"is not a valid Jinja template: {exc.message} (line {exc.lineno})") from None
        return v

    @field_validator("prefill_itl_ratio")
    @classmethod
    def _itl_ratio(cls, v: float) -> float:
        if 0 < v <= 1:
            raise ValueError("must be 0 (off) or more than 1 (a step with a prefill chunk costs more than a decode step)")
        return v

    @field_validator("served_model_name")
    @classmethod
    def _model_names(cls, v: str) -> str:
        if v.strip() and not [x for x in v.split(",") if x.strip()]:
            raise ValueError("must name at least one model")
        return v

    def model_names(self, *defaults: str) -> list[str]:
        """The names the OpenAI routes accept in ``model``: ``SERVED_MODEL_NAME``'s (the first is the one answers
        carry), or ``defaults`` (``MODEL_ID`` as given, then the model folder's name) when it is unset."""
        names = [x.strip() for x in self.served_model_name.split(",") if x.strip()]
        return list(dict.fromkeys(names or defaults))

    def served_backends(self) -> list[str]:
        """``KV_BACKEND`` first, then the other ``KV_BACKENDS`` (no duplicates); with ``KV_BACKENDS`` unset,
        :data:`DEFAULT_EXTRA_BACKENDS` (which a caller drops where the model cannot take them: see
        :meth:`optional_backends`)."""
        extra = DEFAULT_EXTRA_BACKENDS if self.kv_backends is None else self.kv_backends.split(",")
        names = [self.kv_backend] + [x.strip() for x in extra if x.strip()]
        return list(dict.fromkeys(names))

    def optional_backends(self) -> set[str]:
        """Served backends that come from the default of ``KV_BACKENDS`` rather than from a setting: one the
        model cannot take (``int8`` on a native-MLA model) is left out with a log line instead of stopping
        start-up."""
        return set() if self.kv_backends is not None else set(DEFAULT_EXTRA_BACKENDS) - {self.kv_backend}

    def backend_options(self, name: str) -> dict:
        """Options of backend ``name`` (or of each part of a composition such as ``mla+int8``) from the
        ``KV_<PART>_*`` variables; unset ones are omitted."""
        values = {opt: getattr(self, field) for part in name.split("+")
                  for opt, field in BACKEND_OPTIONS.get(part, {}).items()}
        return {k: v for k, v in values.items() if v is not None}

    def explicit_options(self, name: str) -> set[str]:
        """The options of backend ``name`` whose ``KV_<PART>_*`` variable was set (environment or argument), as
        opposed to left at its default: the quality budget searches only options left at their defaults."""
        return {opt for part in name.split("+") for opt, field in BACKEND_OPTIONS.get(part, {}).items()
                if field in self.model_fields_set}

    def token_limits(self, model_max_positions: int) -> tuple[int, int]:
        """``(max_input_tokens, max_total_tokens)`` with unset values derived from the model's context."""
        total = self.max_total_tokens or model_max_positions
        return self.max_input_tokens or total - 1, total


def _declares_refusals(name: str) -> bool:
    return "+" in name and any((d := catalog.get(p)) is not None and d.refusals for p in name.split("+"))


def _empty_is_none(v):
    return None if v == "" else v


def _one_of(choices: tuple):
    def check(v):
        if v not in choices:
            raise ValueError(f"must be {' or '.join(map(str, choices))}")
        return v
    return check


def _setting_field(option: Option) -> tuple[Any, Any]:
    """The settings field of a backend option: its type (a ``str`` option's words as a ``Literal``; an ``int``
    option's allowed values checked after parsing, since a ``Literal`` of ints refuses the string ``"4"`` an
    environment variable gives), its bound, its default (``None``: unset, and an empty variable is unset too)."""
    kind: Any = Literal[option.choices] if option.kind is str and option.choices else option.kind
    checks: list = [AfterValidator(_one_of(option.choices))] if option.kind is int and option.choices else []
    if option.default is None:
        kind, checks = kind | None, [BeforeValidator(_empty_is_none), *checks]
    bounds: dict = {"ge": option.low} if option.low is not None and option.kind in (int, float) else {}
    if (high := option.highest()) is not None:
        bounds["le"] = high
    if option.kind is float:
        bounds["allow_inf_nan"] = False
    annotation = Annotated[kind, *checks] if checks else kind
    return annotation, Field(option.default, description=option.help, **bounds)


def _backend_settings() -> dict[str, tuple[Any, Any]]:
    """One field per setting a backend declares (the first declaration of a shared setting gives its field).

    Raises:
        ValueError: a backend's setting is one of kvserve's own (a plug-in's ``setting="port"``), naming both.
    """
    fields: dict[str, tuple[Any, Any]] = {}
    for decl in catalog.declarations().values():
        for option in decl.options:
            if option.setting and option.setting.lower() in _GeneralSettings.model_fields:
                origin = catalog.setting_origins()[option.setting.lower()]
                raise ValueError(f"setting {option.setting.upper()} is declared twice (kvserve's settings and "
                                 f"{origin}, option {decl.name}:{option.name})")
            if option.setting and option.setting not in fields:
                fields[option.setting] = _setting_field(option)
    return fields


Settings = create_model("Settings", __base__=_GeneralSettings, __module__=__name__,
                        __doc__="kvserve configuration (environment variables, case-insensitive): the general settings "
                                "and one ``KV_<BACKEND>_<OPTION>`` per option a backend declares.",
                        **_backend_settings())


API_KEY_FILE_MAX_BYTES = 4096
"""Longest API key file read (bytes)."""


def read_api_key(path: str) -> str:
    """The key ``path`` holds: its one line, without the white space around it.

    Raises:
        ValueError: it cannot be read, is empty, longer than :data:`API_KEY_FILE_MAX_BYTES` or more than one line.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(API_KEY_FILE_MAX_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot be read ({exc.strerror or exc})") from None
    if len(data) > API_KEY_FILE_MAX_BYTES:
        raise ValueError(f"is longer than {API_KEY_FILE_MAX_BYTES} bytes; it should hold the key alone")
    try:
        key = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError("is not UTF-8 text") from None
    if not key:
        raise ValueError("is empty")
    if "\n" in key or "\r" in key:
        raise ValueError("holds more than one line; it should hold the key alone")
    return key


def load_settings(flags: dict[str, str] | None = None, **overrides) -> Settings:
    """Read and validate the settings: ``overrides`` (field name -> value) win over the environment.

    ``flags`` (field name -> command-line flag, e.g. ``{"port": "--port"}``) names an override's source in the
    message when that override is the invalid one; otherwise the message names the variable.

    Raises:
        ConfigError: naming the first invalid variable (or flag) and its allowed values.
    """
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else ""
        var = (flags or {}).get(field) or field.upper() or "configuration"
        msg = err["msg"].removeprefix("Value error, ")
        if err["loc"]:
            raise ConfigError(f"invalid {var}={err.get('input')!r}: {msg}") from None
        raise ConfigError(f"invalid configuration: {msg}") from None
