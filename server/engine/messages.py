"""The plain messages between the HTTP process and the engine core process (:mod:`server.engine.core`).

msgspec Structs, msgpack-encoded, over ZMQ sockets (as vLLM v1). Nothing here imports torch: the HTTP
process builds and reads these without the model's libraries.

HTTP process -> core: :class:`AddRequest`, :class:`Abort`, :class:`Drain` (one :data:`CoreInput`).
Core -> HTTP process: :class:`Ready` once the model is loaded (or :class:`Failed` when it cannot be), then one
:class:`StepOutput` per engine step, and one after the inputs read between two steps were accepted or refused.

Log-probabilities are natural logs; times are ``time.perf_counter`` seconds (CLOCK_MONOTONIC on Linux, the same
clock in both processes); bytes are bytes.
"""

from __future__ import annotations

from typing import Union

import msgspec


SETTINGS_ENV = "KVSERVE_CORE_SETTINGS"
"""The environment variable that carries the server's settings to a core process: JSON of the fields that were
given (environment, flags, arguments), so that the core tells a given option from a default as the server does."""
PARENT_ENV = "KVSERVE_CORE_PARENT"
"""The environment variable that names the server process (its pid) the engine core process serves."""


class Sampling(msgspec.Struct, frozen=True):
    """The plain fields of :class:`server.engine.sampling.SamplingParams` (same names and meanings; ``logit_bias``
    as a list of ``(token_id, bias)`` pairs; ``min_tokens`` and ``ignore_eos`` are the end-of-text handling)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    frequency_over_all: bool = False
    logit_bias: list[tuple[int, float]] = []
    min_tokens: int = 0
    ignore_eos: bool = False
    top_n: int = 0
    seed: int = 0
    grammar_kind: str = ""
    grammar: str = ""


class AddRequest(msgspec.Struct, tag=True, frozen=True):
    """Queue one generation (one engine sequence).

    Attributes:
        request_id: unique id; every later message about it names it.
        prompt_ids: prompt token ids (already checked against the vocabulary and the limits).
        max_new_tokens: generation budget (tokens); the core ends it with ``length`` there.
        sampling: decoding parameters (``top_n``: top log-probabilities to report per token).
        backend: the KV backend it uses.
        group: the HTTP request it belongs to (fair share), or ``None``.
        cache_salt: prefix-cache salt, or ``None``.
        want_prompt_logprobs: report every prompt position's log-probability in its :class:`Finished`.
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    backend: str
    group: str | None = None
    cache_salt: str | None = None
    want_prompt_logprobs: bool = False


class Abort(msgspec.Struct, tag=True, frozen=True):
    """Drop these requests at the start of the next step, freeing their KV (each gets a ``cancelled``
    :class:`Finished`; ids the core does not know are ignored)."""

    request_ids: list[str]


class Drain(msgspec.Struct, tag=True, frozen=True):
    """Refuse new requests, finish the ones queued or running, then exit (status 0)."""


CoreInput = Union[AddRequest, Abort, Drain]


class NewToken(msgspec.Struct, array_like=True, frozen=True):
    """One generated token: ``(request_id, token_id, logprob, top)``; ``top``: the ``top_n`` most likely
    ``(token_id, logprob)`` pairs at this position."""

    request_id: str
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class Timings(msgspec.Struct, frozen=True):
    """The core's timestamps of one request (``perf_counter`` seconds, ``None`` when it never got there)."""

    prefill_start: float | None = None
    first_token: float | None = None
    last_token: float | None = None


class Finished(msgspec.Struct, frozen=True):
    """A request the core has ended and whose KV it has freed.

    Attributes:
        request_id: its id.
        reason: a :class:`server.engine.sequence.FinishReason` value (``length``, ``eos_token``, ``cancelled``,
            ``error``; never ``stop_sequence``: stop strings are the HTTP process's).
        error: the message when ``reason`` is ``error``.
        cached_tokens: prompt tokens served from the prefix cache.
        kv_stored_bytes: bytes of its cached tokens in their stored form at its last measurement.
        peak_kv_stored_bytes: the largest such measurement.
        kv_stats: its store's statistics (plain numbers).
        prompt_logprobs: each prompt position's log-probability (``None`` for the first), when asked for.
        prompt_top_logprobs: each position's top ``(token_id, logprob)`` pairs, when asked for.
        preemptions: times the core preempted it.
        timings: the core's timestamps.
    """

    request_id: str
    reason: str
    error: str | None = None
    cached_tokens: int = 0
    kv_stored_bytes: int = 0
    peak_kv_stored_bytes: int = 0
    kv_stats: dict = {}
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    preemptions: int = 0
    timings: Timings = Timings()


class Rejected(msgspec.Struct, frozen=True):
    """An :class:`AddRequest` the core refused. ``kind``: ``overloaded`` (the queue is full), ``invalid`` (it can
    never fit the KV budget, or names a backend not served) or ``draining``."""

    request_id: str
    kind: str
    message: str


class CoreStats(msgspec.Struct, frozen=True):
    """Plain numbers for the HTTP process's gauges, measured after the step.

    Attributes:
        running: sequences in the batch.
        waiting: sequences queued.
        kv_held_bytes: bytes of the pool's pages in use (held).
        kv_stored_bytes: bytes of the live sequences' cached tokens (<= ``kv_held_bytes``).
        kv_usage: fraction of the pool's pages in use (0-1), or ``None`` without a pool.
        evictable_blocks: cached blocks no sequence holds (the prefix cache's, reusable).
        rows: by backend, ``[sequences with a store, bytes of their cached tokens, tokens, bytes allocated]``
            (:func:`server.metrics.live_rows`).
        tiers: ``(backend, tier, tokens)`` the running sequences hold.
        generated: tokens the running sequences have generated so far, by backend.
        waiting_by_backend: queued sequences by backend.
        own: by backend, its own gauges (its declaration's :attr:`~cache_backends.declaration.BackendDecl.metrics`)
            as ``{metric name: value}``.
    """

    running: int = 0
    waiting: int = 0
    kv_held_bytes: int = 0
    kv_stored_bytes: int = 0
    kv_usage: float | None = None
    evictable_blocks: int = 0
    rows: dict[str, list[int]] = {}
    tiers: list[tuple[str, str, int]] = []
    generated: dict[str, int] = {}
    waiting_by_backend: dict[str, int] = {}
    own: dict[str, dict[str, float]] = {}


class Counter(msgspec.Struct, array_like=True, frozen=True):
    """One event the engine counted during the step, for the HTTP process's Prometheus counters: ``kind`` one of
    ``prefix_cache`` (``value``: context tokens looked up, ``hit``: of them cached), ``preempted``, or a figure a
    backend's own counters read (``compressed_blocks``, ``preemptions_avoided``: :meth:`server.metrics.Recorder.
    count`); ``backend``: the sequence's KV backend."""

    kind: str
    backend: str
    value: int = 0
    hit: int = 0


class StepOutput(msgspec.Struct, tag=True, frozen=True):
    """What one engine step produced (``counters``, ``prefilled`` and ``stats`` feed the metrics), in order: ``new`` holds each request's token of this step (a finished
    request's last token comes before its :class:`Finished`); ``accepted`` and ``rejected`` answer the
    :class:`AddRequest` read since the last output."""

    new: list[NewToken] = []
    finished: list[Finished] = []
    accepted: list[str] = []
    rejected: list[Rejected] = []
    stats: CoreStats | None = None
    counters: list[Counter] = []
    prefilled: list[tuple[str, float]] = []
    """``(request_id, prefill_start)`` of the requests whose prompt was written this step (first time only)."""


class Ready(msgspec.Struct, tag=True, frozen=True):
    """The core has loaded the model and runs its loop.

    Attributes:
        eos_token_ids: ids that end generation with ``eos_token``.
        backends: the served KV backends' names.
        max_position_embeddings: the model's context length (tokens), for the HTTP side's limits.
        info: plain facts for ``/info`` (JSON-compatible).
        model_config: the model's config as a JSON object (``config.json``'s fields).
    """

    eos_token_ids: list[int]
    backends: list[str]
    max_position_embeddings: int
    info: dict = {}
    model_config: dict = {}


class Loading(msgspec.Struct, tag=True, frozen=True):
    """Start-up progress before ``Ready``: ``stage`` is what the core is doing now, in the words ``/health``'s 503
    answer gives (e.g. the model loaded, the KV backends being calibrated and priced)."""

    stage: str


class Failed(msgspec.Struct, tag=True, frozen=True):
    """The core could not start (the model, a backend or a setting): ``error`` says why, in one line;
    ``invalid_setting``: the cause is a setting this model cannot take (a ``ValueError``)."""

    error: str
    invalid_setting: bool = False


CoreOutput = Union[StepOutput, Ready, Loading, Failed]

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(CoreInput)
_output_decoder = msgspec.msgpack.Decoder(CoreOutput)


def encode(message: CoreInput | CoreOutput) -> bytes:
    """msgpack bytes of ``message``."""
    return _encoder.encode(message)


def decode_input(data: bytes) -> CoreInput:
    """The :data:`CoreInput` in ``data``.

    Raises:
        msgspec.DecodeError: ``data`` is not one (wrong type, missing field, bad msgpack).
    """
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> CoreOutput:
    """The :data:`CoreOutput` in ``data``.

    Raises:
        msgspec.DecodeError: ``data`` is not one.
    """
    return _output_decoder.decode(data)
