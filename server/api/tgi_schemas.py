"""TGI's wire format for ``/generate`` and ``/generate_stream`` (request, response, stream events)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer
from pydantic_core import PydanticCustomError

from server.api.request_model import RequestModel
from server.api.openai_schemas import CACHE_SALT
from server.api.types import KV_COMPRESSED_FRACTION, Int, drop_unset_extensions
from server.service import MAX_CACHE_SALT_CHARS

MAX_BEST_OF = 4
MAX_TOP_N_TOKENS = 10


class TGIGrammar(RequestModel):
    """TGI's ``parameters.grammar``: ``json`` with a JSON schema (an object or its JSON text) or ``regex`` with a
    regular expression; the output follows it."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["json", "regex"]
    value: dict[str, Any] | str


class TGIParameters(RequestModel):
    """``parameters`` of a TGI request. A key this server does not implement (e.g. ``watermark``, ``adapter_id``) is refused (422, naming it) unless it is ``null``, ``false``, ``[]`` or
    ``{}``, since TGI's clients send many of those; non-finite numbers are refused."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    max_new_tokens: Int | None = Field(None, ge=1, description="Tokens to generate (default 100, capped by "
                                       "MAX_TOTAL_TOKENS - prompt tokens).")
    temperature: float | None = Field(None, ge=0.0, description="0 means greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=0, le=2**63 - 1, description="0 disables.")
    typical_p: float | None = Field(None, gt=0.0, le=1.0, description="Locally typical sampling; 1 disables.")
    do_sample: bool = Field(False, description="Sampling is also on whenever temperature != 1, top_k > 0, "
                            "top_p < 1 or typical_p < 1 (TGI's rule); temperature 0 is greedy.")
    seed: Int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[str] = Field(default_factory=list)
    repetition_penalty: float | None = Field(None, gt=0.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="TGI's: subtracts penalty x "
                                            "(occurrences / length) over prompt and output.")
    truncate: Int | None = Field(None, ge=1, description="Keep only the last N prompt tokens.")
    top_n_tokens: Int | None = Field(None, ge=0, le=MAX_TOP_N_TOKENS, description="Also return the N most likely "
                                     "tokens at each step (`top_tokens`).")
    best_of: Int | None = Field(None, ge=1, le=MAX_BEST_OF, description="Sample this many and answer the one with "
                                "the highest log-probability (needs sampling, no seed, no stream).")
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool = False
    kv_backend: str | None = Field(None, min_length=1, description="KV backend for this request (one of KV_BACKENDS).")
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS, description=CACHE_SALT)
    grammar: TGIGrammar | None = Field(None, description="Constrain the output to a JSON schema or a regular "
                                       "expression (docs/http-api.md).")


class TGIRequest(RequestModel):
    """Body of ``POST /generate``, ``POST /generate_stream`` and ``POST /``."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    inputs: str = Field(description="The prompt.", json_schema_extra={"minLength": 1})

    @field_validator("inputs")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        """pydantic's ``min_length`` check, by hand: pydantic-core's own reads the text as UTF-8 and refuses text
        with a lone surrogate (``"\\ud800"``, which JSON escapes can carry) with a message that names neither the
        character nor where it is; this leaves it to the service's check, which does (as for ``stop`` and
        ``prompt``)."""
        if not value:
            raise PydanticCustomError("string_too_short", "String should have at least {min_length} character",
                                      {"min_length": 1})
        return value
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False


class TGIToken(BaseModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class TGIPrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None = None


class TGISequenceDetails(BaseModel):
    """What TGI reports of one generated sequence (the response's details, and each best_of sequence)."""
    finish_reason: str
    generated_tokens: int
    seed: int | None = None
    prefill: list[TGIPrefillToken] = Field(default_factory=list)
    tokens: list[TGIToken] = Field(default_factory=list)
    top_tokens: list[list[TGIToken]] | None = None
    kv_compressed_fraction: float | None = Field(None, description=KV_COMPRESSED_FRACTION)

    @model_serializer(mode="wrap")
    def _drop_extensions(self, handler):
        return drop_unset_extensions(handler(self), ("kv_compressed_fraction",))


class TGIBestOfSequence(TGISequenceDetails):
    generated_text: str


class TGIDetails(TGISequenceDetails):
    best_of_sequences: list[TGIBestOfSequence] | None = None


class TGIResponse(BaseModel):
    generated_text: str
    details: TGIDetails | None = None


class TGIStreamDetails(BaseModel):
    finish_reason: str
    generated_tokens: int
    seed: int | None = None
    input_length: int
    kv_compressed_fraction: float | None = Field(None, description=KV_COMPRESSED_FRACTION)

    @model_serializer(mode="wrap")
    def _drop_extensions(self, handler):
        return drop_unset_extensions(handler(self), ("kv_compressed_fraction",))


class TGIStreamEvent(BaseModel):
    index: int
    token: TGIToken
    top_tokens: list[TGIToken] | None = None
    generated_text: str | None = None
    details: TGIStreamDetails | None = None


class ErrorBody(BaseModel):
    """TGI's error object."""

    error: str
    error_type: str
