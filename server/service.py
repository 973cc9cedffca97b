"""The bridge between the HTTP edge and the engine: validated fields in, a stream of TokenEvents out."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from server.engine.engine import Engine
from server.engine.sampling import SamplingParams
from server.engine.sequence import Sequence, TokenEvent

DEFAULT_MAX_NEW_TOKENS = 100


class InvalidRequest(ValueError):
    """The request is well-formed JSON but cannot be served (422 on TGI routes, 400 on OpenAI routes).

    Args:
        message: what is wrong, naming the field.
        param: the request field at fault (OpenAI's error ``param``), if one is.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Limits:
    """Token limits (tokens) and stop-sequence count in force."""

    max_input_tokens: int
    max_total_tokens: int
    max_stop_sequences: int


@dataclass
class GenerationRequest:
    """What every route turns its body into before it reaches the engine."""

    prompt: str | list[int]
    max_new_tokens: int | None
    params: SamplingParams
    stop: list[str]
    backend: str
    want_prompt_logprobs: bool = False
    truncate: int | None = None
    """Keep only the last ``truncate`` prompt tokens (TGI's ``truncate``)."""
    fields: dict[str, str] | None = None
    """The route's names for ``inputs``, ``max_new_tokens``, ``stop`` and ``kv_backend`` in error messages."""
    add_special_tokens: bool = True
    """Let the tokenizer add its special tokens (BOS) to a string prompt. False for a prompt rendered from a
    chat template, which writes them itself (vLLM's rule for chat): encoding it with them again would start
    a Llama-style prompt with two BOS tokens."""


class GenerationService:
    """Validates requests against the limits and runs them on the engine.

    Args:
        engine: the running engine.
        tokenizer: the model's tokenizer.
        limits: token limits.
        default_backend: backend name used when a request names none.
    """

    def __init__(self, engine: Engine, tokenizer, limits: Limits, default_backend: str):
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.default_backend = default_backend

    @staticmethod
    def sampling(do_sample: bool, temperature: float | None, top_p: float | None, top_k: int | None,
                 repetition_penalty: float | None, seed: int | None) -> SamplingParams:
        """Build :class:`SamplingParams`; a missing seed becomes a random one. Temperature 0 means greedy."""
        if temperature == 0:
            do_sample = False
        return SamplingParams(
            do_sample=do_sample, temperature=temperature or 1.0, top_k=top_k or 0,
            top_p=top_p if top_p is not None else 1.0,
            repetition_penalty=repetition_penalty if repetition_penalty is not None else 1.0,
            seed=seed if seed is not None else secrets.randbits(63),
        )

    def build_sequence(self, req: GenerationRequest, emit: Callable[[TokenEvent], None]) -> Sequence:
        """Tokenize and check limits.

        Raises:
            InvalidRequest: empty prompt, token ids outside the vocabulary, too many stop sequences,
                prompt (after ``truncate``) over MAX_INPUT_TOKENS, or prompt + max_new_tokens over
                MAX_TOTAL_TOKENS; its ``param`` names the field in the route's words.
        """
        lim = self.limits
        f = {"inputs": "inputs", "max_new_tokens": "max_new_tokens", "stop": "stop", "kv_backend": "kv_backend",
             **(req.fields or {})}
        inputs, max_field = f["inputs"], f["max_new_tokens"]
        if req.backend not in self.engine.backends:
            raise InvalidRequest(f"`{f['kv_backend']}` {req.backend!r} is not served here; allowed: "
                                 f"{', '.join(self.engine.backends)}", f["kv_backend"])
        if not req.prompt:
            raise InvalidRequest(f"`{inputs}` must not be empty", inputs)
        if len(req.stop) > lim.max_stop_sequences:
            raise InvalidRequest(f"`{f['stop']}` supports up to {lim.max_stop_sequences} stop sequences. "
                                 f"Given: {len(req.stop)}", f["stop"])
        if any(not s for s in req.stop):
            raise InvalidRequest(f"`{f['stop']}` sequences must not be empty strings", f["stop"])
        if isinstance(req.prompt, str):
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            vocab = len(self.tokenizer)
            if any(not 0 <= i < vocab for i in req.prompt):
                raise InvalidRequest(f"`{inputs}` token ids must be in [0, {vocab})", inputs)
            ids = list(req.prompt)
        if req.truncate is not None:
            ids = ids[-req.truncate:]
        if not ids:
            raise InvalidRequest(f"`{inputs}` tokenizes to no tokens", inputs)
        if len(ids) > lim.max_input_tokens:
            raise InvalidRequest(f"`{inputs}` must have less than {lim.max_input_tokens + 1} tokens. "
                                 f"Given: {len(ids)}", inputs)
        room = lim.max_total_tokens - len(ids)
        max_new = req.max_new_tokens
        if max_new is None:
            max_new = min(DEFAULT_MAX_NEW_TOKENS, room)
        elif len(ids) + max_new > lim.max_total_tokens:
            raise InvalidRequest(f"`{inputs}` tokens + `{max_field}` must be <= {lim.max_total_tokens}. "
                                 f"Given: {len(ids)} `{inputs}` tokens and {max_new} `{max_field}`", max_field)
        if max_new < 1:
            raise InvalidRequest(f"the prompt leaves no room for new tokens (MAX_TOTAL_TOKENS="
                                 f"{lim.max_total_tokens}, prompt {len(ids)} tokens)", inputs)
        return Sequence(request_id=uuid.uuid4().hex, prompt_ids=ids, max_new_tokens=max_new, params=req.params,
                        stop=list(req.stop), emit=emit, backend_name=req.backend,
                        want_prompt_logprobs=req.want_prompt_logprobs)

    async def run(self, req: GenerationRequest, receive: Callable[[], Awaitable[dict]] | None = None
                  ) -> tuple[Sequence, AsyncIterator[TokenEvent]]:
        """Submit ``req``; return its sequence and an async iterator over its events.

        The iterator ends after the event that carries ``finish_reason``. The sequence is cancelled (the
        engine drops it, and frees its KV, at the end of the decode step under way) as soon as the
        client leaves: when ``receive`` (the request's ASGI receive channel, read after the body) yields
        ``http.disconnect``, whether or not anyone is iterating the events at that moment, or when the
        consumer stops iterating early.

        Raises:
            InvalidRequest: see :meth:`build_sequence`, or the request can never fit the KV budget.
            server.engine.engine.Overloaded: the queue is full.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def emit(event: TokenEvent) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                seq.cancel()

        seq = self.build_sequence(req, emit)
        try:
            self.engine.submit(seq)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        watcher = asyncio.create_task(self._cancel_on_disconnect(seq, receive)) if receive is not None else None

        async def events() -> AsyncIterator[TokenEvent]:
            try:
                while True:
                    event = await queue.get()
                    yield event
                    if event.finish_reason is not None:
                        return
            finally:
                if watcher is not None:
                    watcher.cancel()
                self._cancel(seq)

        return seq, events()

    async def _cancel_on_disconnect(self, seq: Sequence, receive: Callable[[], Awaitable[dict]]) -> None:
        await self.cancel_on_disconnect([seq], receive)

    async def cancel_on_disconnect(self, seqs: list[Sequence], receive: Callable[[], Awaitable[dict]]) -> None:
        """Wait for ``http.disconnect`` on ``receive``, then cancel every sequence of ``seqs`` still going."""
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except (OSError, RuntimeError):  # the channel itself broke: the client is gone just the same
            pass
        for seq in seqs:
            self._cancel(seq)

    def _cancel(self, seq: Sequence) -> None:
        if seq.finish_reason is None and not seq.cancelled:
            seq.cancel()
            self.engine.wake()
