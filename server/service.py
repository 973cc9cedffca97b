"""The bridge between the HTTP edge and the engine: validated fields in, a stream of TokenEvents out."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from server.engine.grammar import use_vocabulary
from server.engine.request_state import RequestState
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason, TokenEvent
from server.prompt_tail import tail_ids

if TYPE_CHECKING:  # annotation only: the client imports the engine core, which imports this module's limits
    from server.engine.core_client import CoreClient

DEFAULT_MAX_NEW_TOKENS = 100
MAX_SEQUENCES_PER_REQUEST = 64
"""Most generations one HTTP request may start (OpenAI's prompts x ``best_of`` or ``n``; TGI's ``best_of``)."""
TOKENIZER_THREADS = 2
"""Worker threads that tokenize prompts, off the event loop (as vLLM's async tokenizer pool)."""
SHUTDOWN_FINISH_REASON = "abort"
"""The finish reason of a generation ended by a shutdown's grace period (vLLM's name for an aborted request)."""
MAX_CACHE_SALT_CHARS = 256
"""Longest ``cache_salt`` (characters): it is hashed into every block key of the request's prompt."""


def utf8_error(text: str, field: str) -> "InvalidRequest | None":
    """The error for text that cannot be encoded as UTF-8 (a lone surrogate such as ``"\\ud800"``, which JSON's
    ``\\u`` escapes can carry and tokenizers refuse), or ``None``. It names the first such character and its
    position, and how many follow it in the same run, never the run itself: a body of surrogates would otherwise
    come back whole, and larger (``\\udc80`` escaped)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        run = exc.end - exc.start
        return InvalidRequest(f"`{field}` is not valid Unicode text: {exc.reason} at character {exc.start} "
                              f"({text[exc.start].encode('utf-8', 'backslashreplace').decode()}"
                              + (f", the first of {run} in a row" if run > 1 else "") + ")", field)
    return None


def _parts(component: dict | None) -> list[dict]:
    """A tokenizer.json component (normalizer, pre-tokenizer) as its list of steps (a ``Sequence``'s, or itself)."""
    if not component:
        return []
    key = {"normalizer": "normalizers", "pre_tokenizer": "pretokenizers"}
    for name in key.values():
        if component.get("type") == "Sequence" and name in component:
            return [p for part in component[name] for p in _parts(part)]
    return [component]


def _deletes_no_text(state: dict) -> bool:
    """Whether a tokenizer (its ``tokenizer.json`` as a dict) writes every byte of its input into some token:
    a BPE model that cannot answer ``unk`` for a run of text (byte-level, or with byte fall-back), a normalizer
    that only prepends or replaces with text at least as long, and pre-tokenizers that split without removing."""
    model = state.get("model") or {}
    pre = _parts(state.get("pre_tokenizer"))
    if model.get("type") != "BPE" or not (model.get("byte_fallback") or any(p.get("type") == "ByteLevel" for p in pre)):
        return False
    for step in _parts(state.get("normalizer")):
        pattern = (step.get("pattern") or {}).get("String")
        grows = step.get("type") == "Replace" and pattern is not None and len(step.get("content", "").encode()) >= len(
            pattern.encode())
        if step.get("type") != "Prepend" and not grows:
            return False
    return all(p.get("type") in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts")
               or (p.get("type") in ("Split", "Punctuation") and p.get("behavior") != "Removed") for p in pre)


def max_bytes_per_token(tokenizer) -> int | None:
    """The most UTF-8 bytes of input text one token can stand for, or ``None`` when it cannot be bounded.

    Every token's string in the vocabulary is at least as long, in UTF-8 bytes, as the text it stands for
    (byte-level BPE writes one byte as one character of 1-2 bytes; SentencePiece's ``▁`` is 3 bytes for one
    space; a byte fall-back ``<0x41>`` 6 for one), so a text of ``b`` bytes needs at least ``b / max`` tokens.
    That holds for tokenizers that delete no text (:func:`_deletes_no_text`); for others (or a tokenizer
    without a fast backend) the answer is ``None`` and no such bound is used.
    """
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _deletes_no_text(json.loads(backend.to_str())):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return max((len(token.encode("utf-8")) for token in vocab), default=0) or None


class InvalidRequest(ValueError):
    """The request is well-formed JSON but cannot be served (422 on TGI routes, 400 on OpenAI routes).

    Args:
        message: what is wrong, naming the field.
        param: the request field at fault (OpenAI's error ``param``), if one is.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ClientGone(Exception):
    """The client disconnected before its request was wholly submitted (499 ``cancelled``; nobody reads it)."""


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
    group: str | None = None
    """The HTTP request this generation belongs to (one of its ``n`` / ``best_of`` / prompt-list generations):
    the scheduler caps one request's share of the batch while others wait."""
    """Let the tokenizer add its special tokens (BOS) to a string prompt. False for a prompt rendered from a
    chat template, which writes them itself (vLLM's rule for chat): encoding it with them again would start
    a Llama-style prompt with two BOS tokens."""
    cache_salt: str | None = None
    """vLLM's ``cache_salt``: the prefix cache shares blocks only between requests with the same salt."""
    max_new_tokens_sent: bool = True
    """False when ``max_new_tokens`` is the route's default (16 on ``/v1/completions``, as OpenAI and vLLM), not a
    value the client sent: a prompt that leaves no room for it is refused naming the prompt and the default as
    such, never as if the client had asked for it."""


class GenerationService:
    """Validates requests against the limits and runs them on the engine (through the engine core's client).

    Args:
        engine: the engine core's client, ready (:class:`server.engine.core_client.CoreClient`).
        tokenizer: the model's tokenizer.
        limits: token limits.
        default_backend: backend name used when a request names none.
        prefix_caching: whether the engine runs its prefix cache (``KV_PREFIX_CACHING``); without it a request's
            ``cache_salt`` would do nothing, and is refused.
        tool_call_parser: how ``tool_choice: auto`` finds calls (``TOOL_CALL_PARSER``: ``hermes``, or ``none``,
            which refuses ``auto``).
    """

    def __init__(self, engine: CoreClient, tokenizer, limits: Limits, default_backend: str,
                 prefix_caching: bool = True, tool_call_parser: str = "hermes"):
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.default_backend = default_backend
        self.prefix_caching = prefix_caching
        self.tool_call_parser = tool_call_parser
        self.max_token_bytes = max_bytes_per_token(tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        use_vocabulary(tokenizer, len(tokenizer), [] if eos is None else [eos])  # grammars checked on its tokens
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="kvserve-tokenize")
        self.shut_down = False
        """Set by :meth:`abort_all`: a cancelled generation was ended by the shutdown, not by its client."""

    async def off_loop(self, fn: Callable, *args):
        """``fn(*args)`` in the tokenizer threads, so that a long prompt does not stall the event loop (every
        stream, ``/health``)."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def check_length(self, text: str, field: str, limit: int | None = None) -> None:
        """Refuse ``text`` before tokenizing it when its UTF-8 byte length alone proves it longer than ``limit``
        tokens (default ``MAX_INPUT_TOKENS``; :func:`max_bytes_per_token`), or when it is not valid Unicode.

        Raises:
            InvalidRequest: naming ``field``.
        """
        if (err := utf8_error(text, field)) is not None:
            raise err
        limit = self.limits.max_input_tokens if limit is None else limit
        size, most = len(text.encode("utf-8")), self.max_token_bytes
        if most and size > limit * most:
            raise InvalidRequest(f"`{field}` must have less than {limit + 1} tokens. Given: at least "
                                 f"{-(-size // most)} ({size} bytes, at most {most} bytes a token)", field)

    def check_cache_salt(self, salt: str | None, field: str = "cache_salt") -> None:
        """Refuse a ``cache_salt`` that is not a non-empty string of at most :data:`MAX_CACHE_SALT_CHARS`
        characters of valid Unicode, or any salt when the server runs without its prefix cache (it would isolate
        nothing: an accepted field that does nothing). A salt for a backend whose blocks are never cached (``dca``,
        ``elastic``) is taken: such a request shares nothing, so the salt's promise holds, and a client that salts
        every request per tenant keeps working whatever backend it picks.

        Raises:
            InvalidRequest: naming ``field``.
        """
        if salt is None:
            return
        if not isinstance(salt, str) or not salt:
            raise InvalidRequest(f"`{field}` must be a non-empty string", field)
        if len(salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidRequest(f"`{field}` must have at most {MAX_CACHE_SALT_CHARS} characters. Given: {len(salt)}",
                                 field)
        if (err := utf8_error(salt, field)) is not None:
            raise err
        if not self.prefix_caching:
            raise InvalidRequest(f"`{field}` needs the prefix cache, and this server runs without it "
                                 "(KV_PREFIX_CACHING=false)", field)

    def is_shutdown_end(self, event: TokenEvent) -> bool:
        """Whether ``event`` ended its generation because the server shut down (:meth:`abort_all`)."""
        return event.finish_reason == FinishReason.CANCELLED and self.shut_down

    def core_end(self, event: TokenEvent) -> str | None:
        """Why the engine core ended ``event``'s generation (it died or hung, and every request with it), or
        ``None``: an error event of a request the core itself failed, or no error at all. A non-streamed answer
        to a core's end is 503 (the server is going; another replica can answer), not a generation failure."""
        if event.finish_reason != FinishReason.ERROR:
            return None
        return getattr(self.engine, "dead", None)

    def abort_all(self) -> int:
        """End every generation still queued or running (a shutdown's grace period is over): each gets its
        closing event, which :meth:`is_shutdown_end` recognizes. Returns how many were ended. Thread-safe (the
        drain calls it from its thread)."""
        self.shut_down = True
        live = self.engine.live_requests()
        for req in live:
            self._cancel(req)
        return len(live)

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

    def build_request(self, req: GenerationRequest) -> RequestState:
        """Tokenize and check limits (blocking: :meth:`run` calls it in the tokenizer threads); the HTTP side's state
        of the new generation.

        Raises:
            InvalidRequest: empty prompt, text that is not valid Unicode (a lone surrogate), token ids outside
                the vocabulary, too many stop sequences, prompt (after ``truncate``) over MAX_INPUT_TOKENS
                (refused from its byte length before tokenizing when that proves it), prompt +
                max_new_tokens over MAX_TOTAL_TOKENS (naming the prompt when max_new_tokens is a default the
                client did not send), or a ``cache_salt`` that is empty, too long, not valid
                Unicode, or sent to a server without its prefix cache; its ``param`` names the field in the
                route's words.
        """
        lim = self.limits
        f = {"inputs": "inputs", "max_new_tokens": "max_new_tokens", "stop": "stop", "kv_backend": "kv_backend",
             "cache_salt": "cache_salt", **(req.fields or {})}
        inputs, max_field = f["inputs"], f["max_new_tokens"]
        if req.backend not in self.engine.backends:
            base = req.backend.partition(":")[0].strip()
            hint = (f"; a request names a served backend alone, e.g. {base!r}: its options are the server's, set "
                    f"at start-up and shown in /info's kv_backend_params" if base in self.engine.backends else "")
            raise InvalidRequest(f"`{f['kv_backend']}` {req.backend!r} is not served here; allowed: "
                                 f"{', '.join(self.engine.backends)} (a server started with KV_BACKENDS=... "
                                 f"serves more){hint}", f["kv_backend"])
        self.check_cache_salt(req.cache_salt, f["cache_salt"])
        if not req.prompt:
            raise InvalidRequest(f"`{inputs}` must not be empty", inputs)
        if len(req.stop) > lim.max_stop_sequences:
            raise InvalidRequest(f"`{f['stop']}` supports up to {lim.max_stop_sequences} stop sequences. "
                                 f"Given: {len(req.stop)}", f["stop"])
        if any(not s for s in req.stop):
            raise InvalidRequest(f"`{f['stop']}` sequences must not be empty strings", f["stop"])
        for s in req.stop:
            if (err := utf8_error(s, f["stop"])) is not None:
                raise err
        if isinstance(req.prompt, str):
            if req.truncate is None:
                self.check_length(req.prompt, inputs)
            elif (err := utf8_error(req.prompt, inputs)) is not None:
                raise err
            if req.truncate is None:
                ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            else:  # the text's tail only, not what truncate drops
                ids = tail_ids(self.tokenizer, req.prompt, req.truncate, req.add_special_tokens, self.max_token_bytes)
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
        elif len(ids) + max_new > lim.max_total_tokens and not req.max_new_tokens_sent:
            fix = f"send `{max_field}` <= {room} or a shorter `{inputs}`" if room >= 1 else f"send a shorter `{inputs}`"
            raise InvalidRequest(f"`{inputs}` tokens + the default `{max_field}` ({max_new}; not sent) must be <= "
                                 f"{lim.max_total_tokens}. Given: {len(ids)} `{inputs}` tokens: {fix}", inputs)
        elif len(ids) + max_new > lim.max_total_tokens:
            raise InvalidRequest(f"`{inputs}` tokens + `{max_field}` must be <= {lim.max_total_tokens}. "
                                 f"Given: {len(ids)} `{inputs}` tokens and {max_new} `{max_field}`", max_field)
        if max_new < 1:
            raise InvalidRequest(f"the prompt leaves no room for new tokens (MAX_TOTAL_TOKENS="
                                 f"{lim.max_total_tokens}, prompt {len(ids)} tokens)", inputs)
        return RequestState(request_id=uuid.uuid4().hex, prompt_ids=ids, max_new_tokens=max_new, params=req.params,
                            stop=list(req.stop), backend_name=req.backend,
                            want_prompt_logprobs=req.want_prompt_logprobs, group=req.group, cache_salt=req.cache_salt)

    async def run(self, req: GenerationRequest, receive: Callable[[], Awaitable[dict]] | None = None
                  ) -> tuple[RequestState, AsyncIterator[TokenEvent]]:
        """Submit ``req``; return its state and an async iterator over its events.

        The returned :class:`~server.engine.request_state.RequestState` is the HTTP side's record of the request
        (tokens, times, the core's per-request stats once it finished); the engine core holds its own. The iterator
        reads its event queue (filled by the engine core's client on this event loop) and ends after the event that
        carries ``finish_reason``. The request is aborted (the engine core drops it, and frees its KV, at its next
        step) as soon as the client leaves: when ``receive`` (the request's ASGI receive channel, read after the body)
        yields ``http.disconnect``, whether or not anyone is iterating the events at that moment, or when the
        consumer stops iterating early.

        Raises:
            InvalidRequest: see :meth:`build_request`, or the request can never fit the KV budget.
            server.engine.engine.Overloaded: the queue is full.
            server.engine.core_client.CoreDied: the engine core has ended.
        """
        state = await self.off_loop(self.build_request, req)
        try:
            await self.engine.submit(state)  # the engine core answers whether it took the request
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        watcher = asyncio.create_task(self._cancel_on_disconnect(state, receive)) if receive is not None else None

        async def events() -> AsyncIterator[TokenEvent]:
            try:
                while True:
                    event = await state.events.get()
                    yield event
                    if event.finish_reason is not None:
                        return
            finally:
                if watcher is not None:
                    watcher.cancel()
                self._cancel(state)

        return state, events()

    async def _cancel_on_disconnect(self, req: RequestState, receive: Callable[[], Awaitable[dict]]) -> None:
        await self.cancel_on_disconnect([req], receive)

    async def cancel_on_disconnect(self, reqs: list[RequestState], receive: Callable[[], Awaitable[dict]]) -> None:
        """Wait for ``http.disconnect`` on ``receive``, then cancel every generation of ``reqs`` still going."""
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except (OSError, RuntimeError):  # the channel itself broke: the client is gone just the same
            pass
        for req in reqs:
            self._cancel(req)

    def _cancel(self, req: RequestState) -> None:
        if req.finish_reason is None and not req.cancelled:
            req.cancel()
            self.engine.wake()
