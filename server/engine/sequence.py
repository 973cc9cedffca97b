"""One request's state inside the engine: tokens, sampling parameters and status; its KV is the KV cache manager's
(no torch import: the scheduler reads it)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the scheduler reads sequences and stays torch-free
    import torch

    from server.engine.sampling import SamplingParams

_ids = itertools.count()


class FinishReason(str, enum.Enum):
    """Why a sequence stopped (TGI's names)."""

    LENGTH = "length"
    EOS = "eos_token"
    STOP = "stop_sequence"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class TokenEvent:
    """What the engine hands a request's queue for each generated token.

    Attributes:
        index: 0-based position of this token in the output.
        token_id: the sampled id.
        text: the text this token releases ('' if held back; see ``IncrementalDetokenizer``).
        logprob: log-probability of the token under the model.
        special: whether the token is a special token (e.g. end-of-text).
        top: the most likely ``(token_id, logprob)`` pairs at this step (``params.top_n`` of them).
        finish_reason: set on the last event only.
        generated_text: the whole output text, on the last event only.
        error: an error message when the sequence failed.
    """

    index: int
    token_id: int
    text: str
    logprob: float
    special: bool
    top: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    generated_text: str | None = None
    error: str | None = None


@dataclass
class RequestTimes:
    """Monotonic timestamps (seconds, ``time.perf_counter``) of one request's life."""

    arrival: float = field(default_factory=time.perf_counter)
    prefill_start: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass
class RequestSpec:
    """What a request asks for: the fields the engine's :class:`Sequence` and the HTTP side's
    :class:`server.engine.request_state.RequestState` both begin with.

    Attributes:
        request_id: unique id.
        prompt_ids: prompt token ids.
        max_new_tokens: generation budget (tokens).
        params: sampling parameters.
        stop: stop sequences.
        backend_name: the KV backend the request uses.
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    stop: list[str]
    backend_name: str


@dataclass
class Sequence(RequestSpec):
    """A request in the engine (its first fields: :class:`RequestSpec`).

    The engine's step returns each sequence's events (:meth:`server.engine.engine.Engine.step`); the HTTP side
    keeps its own record of the request (:class:`server.engine.request_state.RequestState`).
    """

    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    detok: Any = None
    cancelled: bool = False
    finish_reason: FinishReason | None = None
    times: RequestTimes = field(default_factory=RequestTimes)
    kv_stored_bytes: int = 0  # bytes of its tokens in their stored form when the engine last measured it (a step)
    kv_held_bytes: int = 0  # bytes of the pages it held at that measurement
    peak_kv_stored_bytes: int = 0  # the largest stored bytes measured (int8-family sequences shrink when they drain)
    kv_stats: dict = field(default_factory=dict)
    prefilled: int = 0  # tokens of context_ids written to the KV cache (chunked prefill; decode adds one a step)
    preemptions: int = 0  # times the engine preempted it (its KV freed, recomputed at readmission)
    group: str | None = None  # the HTTP request it belongs to (n > 1, best_of, prompt lists); None: its own
    cache_salt: str | None = None  # mixed into its prefix-cache block hashes: only requests with the same salt share
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at its first admission (OpenAI cached_tokens)
    prefix_hit: list[int] = field(default_factory=list)  # cached pages admission found, taken at start
    kv_tiers: dict = field(default_factory=dict)  # tokens it holds per tier (exact, int8) at the last measurement
    grammar: Any = None  # server.engine.grammar.GrammarState of a structured output: advanced by each accepted token
    seq_id: int = field(default_factory=lambda: next(_ids))  # unique in the process (request ids may repeat)

    @property
    def request_group(self) -> str:
        """The key the scheduler's fair share counts by: its HTTP request."""
        return self.group or self.request_id
    want_prompt_logprobs: bool = False
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    @property
    def context_ids(self) -> list[int]:
        """Tokens whose KV must be cached before the next decode step: the prompt and every generated token but
        the newest (the next step's input). A preempted sequence recomputes exactly these when readmitted."""
        return self.prompt_ids + self.output_ids[:-1] if self.output_ids else self.prompt_ids

    @property
    def decoding(self) -> bool:
        """Its context is cached and it has a token to decode next."""
        return bool(self.output_ids) and self.prefilled == len(self.context_ids)

    @property
    def total_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    def cancel(self) -> None:
        """Ask the engine to drop this sequence at its next step (thread-safe: a plain flag)."""
        self.cancelled = True
