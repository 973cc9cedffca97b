"""OpenAI request bodies to engine requests, and engine results to OpenAI's ``logprobs`` objects."""

from __future__ import annotations

import secrets

from server.api.openai_schemas import (ChatLogprobs, ChatMessage, ChatRequest, CompletionLogprobs, CompletionRequest,
                                       TokenLogprob, TopLogprob, _Sampling)
from server.api.structured import NO_GRAMMAR, request_grammar
from server.api.tools import ToolPlan, check_turns, plan, tool_dicts, turns, with_tools_system
from server.api.validation import refuse_unimplemented
from server.engine.sampling import SamplingParams
from server.engine.request_state import RequestState
from server.engine.sequence import FinishReason, TokenEvent
from server.service import (MAX_SEQUENCES_PER_REQUEST, GenerationRequest, GenerationService, InvalidRequest,
                            utf8_error)

COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_SEQUENCES = MAX_SEQUENCES_PER_REQUEST
MAX_LOGIT_BIAS = 300
"""Most ``logit_bias`` entries per request (each costs work at every sampling step)."""
"""Most generations one request may start (prompts x ``best_of`` or ``n``)."""
ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
FIELDS = {"inputs": "prompt", "max_new_tokens": "max_tokens", "stop": "stop", "kv_backend": "kv_backend"}
CHAT_FIELDS = {**FIELDS, "inputs": "messages"}


def finish(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == FinishReason.LENGTH else "stop"


def _logit_bias(body: _Sampling, vocab: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as ``((token id, bias), ...)``, one entry per token.

    Raises:
        InvalidRequest: more than :data:`MAX_LOGIT_BIAS` entries, a key that is not a token id of the
            vocabulary, two keys naming the same token (``"433"`` and ``"+433"``: their biases would add up), or
            a bias outside [-100, 100].
    """
    entries = body.logit_bias or {}
    if len(entries) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"`logit_bias` has {len(entries)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
    out: dict[int, float] = {}
    keys: dict[int, str] = {}
    for key, bias in entries.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"`logit_bias` keys must be token ids; got {key!r}", "logit_bias") from None
        if not 0 <= token < vocab:
            raise InvalidRequest(f"`logit_bias` token id {token} is outside the vocabulary [0, {vocab})", "logit_bias")
        if token in out:
            raise InvalidRequest(f"`logit_bias` keys {keys[token]!r} and {key!r} name the same token {token}",
                                 "logit_bias")
        if not -100.0 <= bias <= 100.0:
            raise InvalidRequest(f"`logit_bias` values must be in [-100, 100]; got {bias}", "logit_bias")
        out[token], keys[token] = float(bias), key
    return tuple(out.items())


def sampling_params(body: _Sampling, vocab: int, top_n: int, grammar: tuple[str, str] = NO_GRAMMAR
                    ) -> list[SamplingParams]:
    """One :class:`SamplingParams` per choice (``n``, or ``best_of`` when larger): choice j gets seed + j; each
    with ``grammar`` (``(kind, grammar)``: :mod:`server.api.structured`), which the engine follows per choice."""
    temperature = 1.0 if body.temperature is None else body.temperature
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    count = max(body.n, getattr(body, "best_of", None) or 0)
    common = dict(do_sample=temperature > 0, temperature=temperature if temperature > 0 else 1.0,
                  top_k=body.top_k if body.top_k and body.top_k > 0 else 0,
                  top_p=1.0 if body.top_p is None else body.top_p,
                  repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                  frequency_penalty=body.frequency_penalty or 0.0, presence_penalty=body.presence_penalty or 0.0,
                  logit_bias=_logit_bias(body, vocab), min_tokens=body.min_tokens, ignore_eos=body.ignore_eos,
                  top_n=top_n, grammar_kind=grammar[0], grammar=grammar[1])
    return [SamplingParams(**common, seed=(seed + j) % 2**63) for j in range(count)]


def _check_common(body: _Sampling, max_tokens: int | None) -> None:
    refuse_unimplemented(body)
    options = body.stream_options
    if not body.stream and options is not None and (options.include_usage or options.continuous_usage_stats):
        raise InvalidRequest("`stream_options` applies to a streamed response only: set `stream` to true, or leave "
                             "it out (as OpenAI's and vLLM's servers refuse it)", "stream_options")
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and body.min_tokens > max(max_tokens, 1):
        raise InvalidRequest(f"`min_tokens` ({body.min_tokens}) must not exceed `{field}` ({max_tokens})",
                             "min_tokens")


def _with_grammar(body: _Sampling, grammar: tuple[str, str]) -> tuple[str, str]:
    """``grammar``, once the fields a grammar would override are not set: the grammar ends the output where it can
    only end, so ``min_tokens`` and ``ignore_eos`` could not be honoured.

    Raises:
        InvalidRequest: naming ``min_tokens`` or ``ignore_eos``.
    """
    if grammar != NO_GRAMMAR:
        for field, given in (("min_tokens", body.min_tokens > 0), ("ignore_eos", body.ignore_eos)):
            if given:
                raise InvalidRequest(f"`{field}` cannot go with a structured output or a required tool call: the "
                                     "grammar ends the output where it can only end", field)
    return grammar


def prompts_of(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: a string, strings, token ids, or lists of token ids."""
    p = body.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise InvalidRequest("`prompt` must not be an empty list", "prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    if all(isinstance(x, (str, list)) for x in p):
        return [x if isinstance(x, str) else list(x) for x in p]
    raise InvalidRequest("`prompt` must be a string, a list of strings, a list of token ids or a list of "
                         "token-id lists", "prompt")


def completion_requests(body: CompletionRequest, service: GenerationService
                        ) -> tuple[list[str | list[int]], list[GenerationRequest], bool]:
    """The engine requests for a completion body: for each prompt, ``best_of`` (or ``n``) of them.

    Returns:
        ``(prompts, requests, echo_only)``; ``echo_only`` when ``max_tokens`` is 0 (with ``echo``):
        one token is generated for the prompt's log-probabilities and then left out of the answer.

    Raises:
        InvalidRequest: naming the field.
    """
    max_tokens = body.new_tokens()
    _check_common(body, max_tokens)
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    sent = max_tokens is not None
    if not sent:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    echo_only = max_tokens == 0
    if echo_only and not body.echo:
        raise InvalidRequest(f"`{field}` 0 is only allowed with `echo`", field)
    best_of = body.best_of or body.n
    if best_of < body.n:
        raise InvalidRequest(f"`best_of` ({best_of}) must be >= `n` ({body.n})", "best_of")
    if body.stream and best_of != body.n:
        raise InvalidRequest("`best_of` other than `n` is not supported with `stream`", "best_of")
    prompts = prompts_of(body)
    if len(prompts) * best_of > MAX_SEQUENCES:
        raise InvalidRequest(f"{len(prompts)} prompts x {best_of} choices is over {MAX_SEQUENCES} generations "
                             "per request", "prompt")
    params = sampling_params(body, len(service.tokenizer), body.logprobs or 0, _with_grammar(body, request_grammar(body)))
    backend = body.kv_backend or service.default_backend
    fields = {**FIELDS, "max_new_tokens": field}
    reqs = [GenerationRequest(prompt=p, max_new_tokens=1 if echo_only else max_tokens, params=params[j],
                              stop=body.stop_list(), backend=backend,
                              want_prompt_logprobs=body.echo and body.logprobs is not None, fields=fields,
                              cache_salt=body.cache_salt, max_new_tokens_sent=sent)
            for p in prompts for j in range(best_of)]
    return prompts, reqs, echo_only


def check_parts(messages: list[ChatMessage], field: str = "messages") -> None:
    """Refuse content parts other than text, text parts without their text, and text that is not valid Unicode,
    naming the part or the message (before a template renders it: its position in the message, and a template's
    error that quotes it is not a 500).

    Raises:
        InvalidRequest: ``messages[i].content[j].type`` not ``text``, or its ``text`` missing or null (required
            in OpenAI's schema); ``messages[i].content`` holding a lone surrogate.
    """
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type != "text":
                raise InvalidRequest(f"`{field}[{i}].content[{j}].type` {part.type!r} is not supported; only "
                                     "'text'", f"{field}[{i}].content[{j}].type")
            if part.text is None:
                raise InvalidRequest(f"`{field}[{i}].content[{j}].text` is required in a 'text' part",
                                     f"{field}[{i}].content[{j}].text")
        if (err := utf8_error(m.text(), f"{field}[{i}].content")) is not None:
            raise err


def chat_prompt(tokenizer, body: ChatRequest | list[ChatMessage], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, field: str = "messages") -> tuple[str, bool]:
    """The prompt for a chat (a request or its messages) and whether the tokenizer should add its special tokens
    when encoding it.

    With the tokenizer's chat template: the rendered text, ``False`` (the template writes BOS and any other
    special tokens itself; vLLM encodes it the same way). Without one: the plain template
    ``System: ...\nUser: ...\nAssistant:``, ``True`` (it writes none, so it is encoded as a completion is).
    The bundled models carry that plain template as their chat template (their tokenizer adds no BOS, and the
    template writes none), so both ways, and a client applying the template itself, give the same token ids.

    ``tools`` (OpenAI's tool objects) go to the template (``apply_chat_template(tools=...)``); a template that does not
    render them (the same text without them), and the plain template, get them as a system turn and earlier calls
    as ``<tool_call>`` text (:mod:`server.api.tools`); so do earlier calls in ``messages`` without ``tools`` when the
    template ignores them.

    Raises:
        InvalidRequest: naming ``field``: the template failed (its ``raise_exception`` included) or rendered nothing.
    """
    messages = body.messages if isinstance(body, ChatRequest) else body
    if getattr(tokenizer, "chat_template", None):
        def render(chat: list[dict], with_tools: list[dict] | None) -> str:
            try:
                text = tokenizer.apply_chat_template(chat, tools=with_tools, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
            except Exception as exc:  # noqa: BLE001 - the template's own checks (raise_exception) and its faults
                why = (str(exc).strip() or type(exc).__name__).encode("utf-8", "backslashreplace").decode()
                raise InvalidRequest(f"the chat template cannot render `{field}`: {why}", field) from None
            if not isinstance(text, str) or not text:
                raise InvalidRequest(f"the chat template rendered `{field}` as an empty prompt", field)
            return text

        def same(text: str, chat: list[dict]) -> bool:  # a comparison render that fails differs: `text` stands
            try:
                return text == render(chat, None)
            except InvalidRequest:
                return False

        if not tools:
            text = render(turns(messages), None)
            if any(m.tool_calls for m in messages) and same(text, turns(messages, drop_calls=True)):
                return render(turns(messages, calls_as_text=True), None), False  # it ignores calls: written as text
            return text, False
        chat = turns(messages)
        text = render(chat, tools)
        if not same(text, chat):
            return text, False
        plain = turns(messages, calls_as_text=True)
        try:
            return render(with_tools_system(plain, tools), None), False
        except InvalidRequest:  # a template that takes no system turn (roles must alternate): in the first user turn
            return render(with_tools_system(plain, tools, in_user_turn=True), None), False
    chat = turns(messages, calls_as_text=True)
    chat = with_tools_system(chat, tools) if tools else chat
    text = "".join(f"{ROLE_NAMES[t['role']]}: {t['content']}\n" for t in chat)
    return text + ("Assistant:" if add_generation_prompt else ""), True


def chat_requests(body: ChatRequest, service: GenerationService,
                  messages_field: str = "messages") -> tuple[list[GenerationRequest], ToolPlan]:
    """The engine requests for a chat body, one per choice, and what its tools ask for (the answer's parsing);
    ``messages_field`` names the request's messages in errors of the chat template (``input`` on ``/v1/responses``).

    Raises:
        InvalidRequest: naming the field.
    """
    check_parts(body.messages, messages_field)
    max_tokens = body.new_tokens()
    _check_common(body, max_tokens)
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if max_tokens == 0:
        raise InvalidRequest(f"`{field}` must be at least 1", field)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    check_turns(body.messages)
    grammar = request_grammar(body)
    tools = plan(body, constrained=grammar != NO_GRAMMAR, parser=service.tool_call_parser)
    _with_grammar(body, tools.grammar if tools.grammar != NO_GRAMMAR else grammar)
    prompt, special = chat_prompt(service.tokenizer, body, tools=tool_dicts(body) or None,
                                  field=messages_field)
    params = sampling_params(body, len(service.tokenizer), (body.top_logprobs or 0) if body.logprobs else 0,
                             tools.grammar if tools.grammar != NO_GRAMMAR else grammar)
    backend = body.kv_backend or service.default_backend
    reqs = [GenerationRequest(prompt=prompt, max_new_tokens=max_tokens, params=p, stop=body.stop_list(),
                              backend=backend, fields={**CHAT_FIELDS, "max_new_tokens": field},
                              add_special_tokens=special, cache_salt=body.cache_salt) for p in params]
    return reqs, tools


class TokenText:
    """Each token id's own text (``tokenizer.decode([id])``), cached per request."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if token_id not in self.cache:
            self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False,
                                                         clean_up_tokenization_spaces=False)
        return self.cache[token_id]


Entry = tuple[int, float | None, list[tuple[int, float]] | None]
"""One position: token id, its log-probability (None for a prompt's first token), top alternatives."""


def prompt_entries(seq: RequestState) -> list[Entry]:
    tops = seq.prompt_top_logprobs or [None] * len(seq.prompt_ids)
    return list(zip(seq.prompt_ids, seq.prompt_logprobs or [None] * len(seq.prompt_ids), tops))


def token_entries(events: list[TokenEvent]) -> list[Entry]:
    return [(ev.token_id, ev.logprob, ev.top) for ev in events if ev.token_id >= 0]


def completion_logprobs(entries: list[Entry], text: TokenText, offset: int = 0) -> CompletionLogprobs:
    """OpenAI's completion ``logprobs``: tokens, their log-probabilities, the top alternatives (with the
    chosen token) and each token's character offset in the choice's text, from ``offset`` on."""
    out = CompletionLogprobs()
    for token_id, logprob, top in entries:
        tok = text(token_id)
        out.tokens.append(tok)
        out.token_logprobs.append(logprob)
        if top is None or logprob is None:
            out.top_logprobs.append(None)
        else:
            alternatives = {text(t): lp for t, lp in top}
            alternatives.setdefault(tok, logprob)
            out.top_logprobs.append(alternatives)
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def chat_logprobs(entries: list[Entry], text: TokenText) -> ChatLogprobs:
    """OpenAI's chat ``logprobs``: one entry per generated token with its ``top_logprobs``."""
    def top(token_id: int, logprob: float) -> TopLogprob:
        tok = text(token_id)
        return TopLogprob(token=tok, logprob=logprob, bytes=list(tok.encode("utf-8")))

    return ChatLogprobs(content=[TokenLogprob(**top(t, lp).model_dump(), top_logprobs=[top(a, b) for a, b in alts or []])
                                 for t, lp, alts in entries])
