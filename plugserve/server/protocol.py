"""OpenAI-compatible request and response bodies (the subset plugserve serves, plus SGLang's extensions
`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)
from pydantic_core import PydanticCustomError

from plugserve.runtime.sampling import SamplingParams

SEED_LIMIT = 2**63  # int64, as OpenAI's; n samples take seed + i, which stays below a torch generator's 2^64
MAX_N = 64
MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
# The error type of a string UTF-8 cannot encode; its ctx `at` is where inside the field (indices, field names).
INVALID_UNICODE = "invalid_unicode"
# JSON types are strict: "0.5", "hot" or true where a number belongs is refused, never coerced (a strict float
# takes JSON integers: temperature 1 is 1.0); so are NaN and Infinity, which Python's JSON parser accepts.
Number = Annotated[StrictFloat, Field(allow_inf_nan=False)]
Seed = Annotated[StrictInt, Field(ge=0, lt=SEED_LIMIT)]
TokenId = Annotated[StrictInt, Field(ge=0)]  # the vocabulary's upper bound is checked against the model
Penalty = Annotated[Number, Field(ge=-2, le=2)]
StopString = Annotated[StrictStr, Field(min_length=1)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOPS)]
Bias = Annotated[Number, Field(ge=-100, le=100)]
MAX_LOGIT_BIAS = 1024  # tokens one request may bias (OpenAI takes 300)


def _bias_map(bias: object) -> object:
    """OpenAI's `logit_bias`: JSON object keys are strings, token ids written in decimal."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must be an object of token id -> bias")
    if not all(isinstance(k, str) and k.isascii() and k.isdigit() for k in bias):
        raise ValueError("logit_bias keys must be token ids (decimal integers)")
    return {int(k): v for k, v in bias.items()}


LogitBias = Annotated[dict[StrictInt, Bias], Field(max_length=MAX_LOGIT_BIAS),
                      BeforeValidator(_bias_map, json_schema_input_type=dict[str, Bias] | None)]


def _stop_list(stop: object) -> object:
    """OpenAI's `stop`: one string is one stop string (not its characters)."""
    if stop is None:
        return []
    if not isinstance(stop, (str, list)):
        raise ValueError("stop must be a string or a list of strings")
    return [stop] if isinstance(stop, str) else stop


# Typed as a list; the schema states what clients may send: a string, a list of strings, or null.
Stop = Annotated[StopList, BeforeValidator(_stop_list, json_schema_input_type=StopString | StopList | None)]


def _unencodable_at(value: object) -> list[str | int] | None:
    """Where in a field's value (nested lists and models) a string UTF-8 cannot encode lies, or None if none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return []
        return None
    if isinstance(value, BaseModel):
        items: Any = ((name, getattr(value, name)) for name in type(value).model_fields)
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        at = _unencodable_at(item)
        if at is not None:
            return [key, *at]
    return None


class RequestBody(BaseModel):
    """A request's whole body: every string in it, at any depth, is valid Unicode. JSON's `\\ud800` escapes parse to
    lone surrogates, which UTF-8 cannot encode: the tokenizer, or the response that echoes them, would fail deep
    inside (a 500), so one check here refuses them with a 400 that names where they are."""

    @field_validator("*")
    @classmethod
    def check_unicode(cls, value: Any) -> Any:
        """Every field's value, at any depth: one check for all the body's strings, whatever fields come."""
        at = _unencodable_at(value)
        if at is not None:
            raise PydanticCustomError(INVALID_UNICODE, "not valid Unicode: a lone surrogate (\\ud800-\\udfff), "
                                      "which UTF-8 cannot encode", {"at": at})
        return value


class SamplingFields(BaseModel):
    """The sampling parameters of every generating endpoint, one model: /generate takes them as its
    `sampling_params` (with `max_new_tokens`), the OpenAI endpoints at the top level of their bodies. Every field
    is typed strictly and bounded as SamplingParams.validate bounds it, in the OpenAPI schema too (clients and
    the API fuzzer read the ranges there): nothing reaches SamplingParams unchecked. Stop token ids are checked
    against the model's vocabulary in app._validate."""

    temperature: Number = Field(1.0, ge=0)
    top_p: Number = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(-1, ge=-1)
    min_p: Number = Field(0.0, ge=0, le=1)
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: Number = Field(1.0, gt=0)
    stop: Stop = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: StrictBool = False
    seed: Seed | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    skip_special_tokens: StrictBool = True
    logit_bias: LogitBias = Field(default_factory=dict)

    def sampling_params(self, max_new_tokens: int, logprobs: bool = False, top_logprobs: int = 0
                        ) -> SamplingParams:
        """These fields, with what the endpoint names its own way (OpenAI's max_tokens and logprobs)."""
        return SamplingParams(**self.model_dump(include=set(SamplingFields.model_fields)),
                              max_new_tokens=max_new_tokens, logprobs=logprobs, top_logprobs=top_logprobs)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class OpenAIRequest(SamplingFields, RequestBody):
    """What completions and chat completions share. Unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None


class CompletionRequest(OpenAIRequest):
    prompt: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class GenerateSamplingParams(SamplingFields):
    """/generate's `sampling_params`: the shared fields under SGLang's names, and `max_new_tokens`. Unknown keys
    are refused (a misspelt parameter would otherwise be silently ignored)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: StrictInt = Field(128, ge=1)

    def to_params(self) -> SamplingParams:
        return self.sampling_params(self.max_new_tokens)


class GenerateRequest(RequestBody):
    """plugserve's native endpoint, shaped like SGLang's /generate."""

    model_config = ConfigDict(extra="forbid")

    text: StrictStr | None = None
    input_ids: list[TokenId] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: StrictBool = False
    rid: StrictStr | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details={"cached_tokens": cached_tokens})


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = None) -> dict[str, Any]:
    """OpenAI's error object. What UTF-8 cannot encode in the message (a lone surrogate in an exception's text) is
    escaped: the error must serialize, never become another 500 itself."""
    encodable = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": encodable, "type": kind, "param": param, "code": code}}
