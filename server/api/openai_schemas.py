"""OpenAI's wire format for ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer, model_validator

from server.api.request_model import RequestModel
from server.api.types import KV_COMPRESSED_FRACTION, Int, drop_unset_extensions
from server.service import MAX_CACHE_SALT_CHARS

MAX_CHOICES = 16
"""Most choices per prompt (``n``, ``best_of``)."""
MAX_LOGPROBS = 20
"""Most top log-probabilities per position."""
CACHE_SALT = (f"vLLM extension: a non-empty string (at most {MAX_CACHE_SALT_CHARS} characters) mixed into the prefix "
              "cache's block keys: only requests with the same salt share cached blocks. Refused when the server "
              "runs without its prefix cache (KV_PREFIX_CACHING=false).")


class StreamOptions(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    include_usage: bool = Field(False, description="End the stream with a chunk carrying `usage`.")
    continuous_usage_stats: bool = Field(False, description="vLLM extension: every chunk carries the usage so far.")


class JsonSchemaFormat(RequestModel):
    """``response_format.json_schema``: the schema the output follows."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, description="The schema's name (informational, as in OpenAI).")
    description: str | None = Field(None, description="What the output is for (informational, as in OpenAI).")
    schema_: dict[str, Any] = Field(alias="schema", description="A JSON schema; the output validates against it.")
    strict: bool | None = Field(None, description="Accepted for OpenAI's clients; the output always follows the "
                                "schema exactly (as `strict: true` asks).")


class ResponseFormat(RequestModel):
    """``response_format``: ``text`` (no constraint), ``json_object`` (a JSON object) or ``json_schema``."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="Required with `type: json_schema`.")


class StructuredOutputs(RequestModel):
    """vLLM's ``structured_outputs``: one constraint of ``json`` (a schema), ``regex``, ``choice`` or
    ``json_object``."""

    model_config = ConfigDict(strict=True, extra="allow")

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema (or its JSON text).")
    regex: str | None = Field(None, min_length=1, description="A regular expression the output matches.")
    choice: list[str] | None = Field(None, min_length=1, description="The output is one of these strings.")
    json_object: bool | None = Field(None, description="The output is a JSON object.")


class _Sampling(RequestModel):
    """Fields shared by both OpenAI routes. A key this server does not implement is refused (400, naming
    it) unless its value is ``null``, ``false``, ``[]`` or ``{}``; non-finite numbers are refused."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: Int | None = Field(None, ge=0, description="New tokens (0 only with `echo` on completions).")
    max_completion_tokens: Int | None = Field(None, ge=0, description="Alias of `max_tokens` (wins when both).")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Default 1.0; 0 means greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=-1, le=2**63 - 1, description="vLLM extension: keep the k most likely "
                              "tokens; 0 or -1 disables.")
    n: Int = Field(1, ge=1, le=MAX_CHOICES, description="Choices per prompt.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int | None = Field(None, ge=0, le=2**63 - 1, description="Choice j of n uses seed + j.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, description="vLLM extension (CTRL-style).")
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    ignore_eos: bool = Field(False, description="vLLM extension: never stop at end-of-text.")
    min_tokens: Int = Field(0, ge=0, le=2**63 - 1, description="vLLM extension: end-of-text is masked until this "
                            "many tokens.")
    user: str | None = Field(None, description="End-user id (informational only, as in OpenAI).")
    kv_backend: str | None = Field(None, min_length=1, description="KV backend for this request (one of KV_BACKENDS).")
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS, description=CACHE_SALT)
    response_format: ResponseFormat | None = Field(None, description="Constrain the output: a JSON object, or JSON "
                                                   "that validates against a schema (docs/http-api.md).")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extension: constrain the output to "
                                                         "a schema, a regular expression or a choice.")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM extension (older name of "
                                                     "`structured_outputs.json`).")
    guided_regex: str | None = Field(None, min_length=1, description="vLLM extension (`structured_outputs.regex`).")
    guided_choice: list[str] | None = Field(None, min_length=1, description="vLLM extension "
                                            "(`structured_outputs.choice`).")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Prompt = str | list[str] | list[Int] | list[list[Int]]


class CompletionRequest(_Sampling):
    prompt: Prompt = Field(description="A string, a list of strings, token ids, or a list of token-id lists; "
                           "each prompt gets `n` choices.")
    echo: bool = Field(False, description="Prepend the prompt to the text (and to `logprobs`).")
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Return the log-probabilities of the "
                                 "tokens and of this many most likely ones at each position.")
    best_of: Int | None = Field(None, ge=1, le=MAX_CHOICES, description="Generate this many per prompt and "
                                "return the `n` with the highest log-probability (not with `stream`).")


class TextPart(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str = Field(description="Only `text` is supported.")
    text: str | None = None


class FunctionCall(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: str = Field(min_length=1)
    arguments: str = Field(description="The arguments as JSON text (an object).")


class ToolCall(RequestModel):
    """A tool call of an assistant turn (as the server answered it)."""

    model_config = ConfigDict(strict=True, extra="allow")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    # Required for every role; null only in an assistant turn (nullable in OpenAI's schema, an empty turn as vLLM
    # reads it): a client replaying a history sends one.
    content: str | list[TextPart] | None = Field(description="The turn's text (or its text parts); null (empty) "
                                                 "only for an assistant turn.")

    tool_calls: list[ToolCall] | None = Field(None, description="An assistant turn's tool calls (its `content` may "
                                              "then be left out).")
    tool_call_id: str | None = Field(None, description="A `tool` turn: the call it answers.")

    @model_validator(mode="before")
    @classmethod
    def _content_optional_with_tool_calls(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") == "assistant" and data.get("tool_calls") \
                and "content" not in data:
            return {**data, "content": None}
        return data

    @field_validator("content")
    @classmethod
    def _null_only_for_assistant(cls, v, info: ValidationInfo):
        if v is None and info.data.get("role") != "assistant":
            raise ValueError("is required (null only in an assistant turn)")
        return v

    def text(self) -> str:
        """The turn's text: ``content``, its text parts joined, or ``""`` for an assistant's null."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class FunctionDefinition(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = Field(None, description="Rendered into the prompt with the tool.")
    parameters: dict[str, Any] | None = Field(None, description="The arguments' JSON schema (default: any object).")
    strict: bool | None = Field(None, description="Accepted for OpenAI's clients; constrained calls always follow "
                                "the schema.")


class Tool(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: str = Field(min_length=1)


class NamedToolChoice(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, description="Functions the model may call: rendered into the prompt by "
                                     "the chat template (docs/http-api.md, Tool calls).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | str | None = Field(
        None, description="`auto` (the default with tools): the output is parsed for calls; `required` or a named "
        "function: the output is constrained to a call; `none`: no call. Another string names a function of "
        "`tools`, as TGI takes it (its client sends the name).")
    parallel_tool_calls: bool | None = Field(None, description="With `tool_choice: required`: false allows one "
                                             "call only (default: one or more).")
    logprobs: bool = Field(False, description="Return each generated token's log-probability.")
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="With `logprobs`: this many most "
                                     "likely tokens at each position.")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens served from the prefix cache (not prefilled).")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    kv_compressed_fraction: float | None = Field(None, description=KV_COMPRESSED_FRACTION + " Over the "
                                                 "request's choices, weighted by their cached tokens.")

    @model_serializer(mode="wrap")
    def _drop_extensions(self, handler):
        return drop_unset_extensions(handler(self), ("kv_compressed_fraction",))


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    """An answer's message: ``tool_calls`` only when the model called a tool (``content`` is then null, or the
    text beside the calls)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        out = handler(self)
        if "tool_calls" not in self.model_fields_set:
            out.pop("tool_calls", None)
        return out


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


SYSTEM_FINGERPRINT = ("The configuration that served the request, `kvserve-<version>-<KV backend>`: the same "
                      "fingerprint and seed give the same tokens.")


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str = Field(description=SYSTEM_FINGERPRINT)
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(BaseModel):
    """A part of a streamed call: ``name`` in its first delta, ``arguments`` text in pieces (they add up)."""

    name: str | None = None
    arguments: str = ""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if k != "name" or v is not None}


class DeltaToolCall(BaseModel):
    """OpenAI's streamed tool call: ``index`` names the call; ``id`` and ``type`` come in its first delta."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class TgiDeltaFunction(BaseModel):
    """TGI's streamed function: ``name`` (null after the call's first delta) and ``arguments`` always present."""

    name: str | None = None
    arguments: str = ""


class TgiDeltaToolCall(BaseModel):
    """TGI's streamed tool call: one object per delta, not a list, with every key its client
    (``text-generation``'s ``ChoiceDeltaToolCall``) requires: ``id`` is ``""`` after the call's first delta."""

    index: int
    id: str = ""
    type: Literal["function"] = "function"
    function: TgiDeltaFunction

    @classmethod
    def of(cls, call: DeltaToolCall) -> "TgiDeltaToolCall":
        return cls(index=call.index, id=call.id or "",
                   function=TgiDeltaFunction(name=call.function.name, arguments=call.function.arguments))


class ChatDelta(BaseModel):
    """A stream chunk's delta; keys not set are left out (the last chunk's delta is ``{}``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | TgiDeltaToolCall | None = Field(
        None, description="Tool calls in pieces (OpenAI's stream shape); in a stream asked for with `model: \"tgi\"`, "
        "one call object per delta (TGI's shape), null on deltas without one (TGI's client needs the key).")

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str = Field(description=SYSTEM_FINGERPRINT)
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail
