"""TGI's wire format for ``/generate`` and ``/generate_stream`` (request, response, stream events)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from server.api.types import Int


class TGIParameters(BaseModel):
    """``parameters`` of a TGI request. Unknown keys are ignored, as TGI's clients send many ``null``s."""

    model_config = ConfigDict(strict=True, extra="ignore")

    max_new_tokens: Int | None = Field(None, ge=1, description="Tokens to generate (default 100, capped by "
                                       "MAX_TOTAL_TOKENS - prompt tokens).")
    temperature: float | None = Field(None, ge=0.0, description="0 means greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=0, description="0 disables.")
    do_sample: bool = False
    seed: Int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[str] = Field(default_factory=list)
    repetition_penalty: float | None = Field(None, gt=0.0)
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool = False
    kv_backend: str | None = Field(None, description="KV backend for this request (one of KV_BACKENDS).")


class TGIRequest(BaseModel):
    """Body of ``POST /generate`` and ``POST /generate_stream``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    inputs: str = Field(min_length=1, description="The prompt.")
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


class TGIDetails(BaseModel):
    finish_reason: str
    generated_tokens: int
    seed: int | None = None
    prefill: list[TGIPrefillToken] = Field(default_factory=list)
    tokens: list[TGIToken] = Field(default_factory=list)


class TGIResponse(BaseModel):
    generated_text: str
    details: TGIDetails | None = None


class TGIStreamDetails(BaseModel):
    finish_reason: str
    generated_tokens: int
    seed: int | None = None
    input_length: int


class TGIStreamEvent(BaseModel):
    index: int
    token: TGIToken
    generated_text: str | None = None
    details: TGIStreamDetails | None = None


class ErrorBody(BaseModel):
    """TGI's error object."""

    error: str
    error_type: str
