"""OpenAI-compatible request and response bodies (the subset plugserve serves, plus SGLang's extensions
`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`, `json_schema`,
`regex`, `ebnf`, `chat_template_kwargs`, `continue_final_message`). OpenAI fields plugserve does not honour are
declared too, so that setting one is a 400 naming it rather than a request served as if it had not been set."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

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
    model_validator,
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
    against the model's vocabulary in prepare.validate."""

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
    # Structured output, SGLang's way (at most one): a JSON schema as a string, a regular expression, an EBNF grammar.
    json_schema: StrictStr | None = None
    regex: StrictStr | None = None
    ebnf: StrictStr | None = None

    def sampling_params(self, max_new_tokens: int, logprobs: bool = False, top_logprobs: int = 0
                        ) -> SamplingParams:
        """These fields, with what the endpoint names its own way (OpenAI's max_tokens and logprobs)."""
        return SamplingParams(**self.model_dump(include=set(SamplingFields.model_fields)),
                              max_new_tokens=max_new_tokens, logprobs=logprobs, top_logprobs=top_logprobs)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    name: StrictStr
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required with type json_schema")
        return self


def _unset(value: object, default: object) -> bool:
    return value is None or value == default


class OpenAIRequest(SamplingFields, RequestBody):
    """What completions and chat completions share. Unknown fields are ignored, as OpenAI does (kept in
    `model_extra`, where `unsupported_field` looks for the ones plugserve knows it does not honour)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    response_format: ResponseFormat | None = None

    # Fields OpenAI defines and plugserve does not honour, with the value that asks nothing of it.
    UNSUPPORTED: ClassVar[dict[str, object]] = {}

    def unsupported_field(self) -> str | None:
        """The first field this request sets that plugserve does not honour (None: none)."""
        extra = self.model_extra or {}
        for name, default in self.UNSUPPORTED.items():
            if name in extra and not _unset(extra[name], default):
                return name
        return None

    def grammar_json_schema(self) -> str | None:
        """response_format as a JSON schema string (None: text). json_object is any JSON object, as in SGLang."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return '{"type": "object"}'
        assert fmt.json_schema is not None
        return json.dumps(fmt.json_schema.schema_)

    def sampling_params(self, max_new_tokens: int, logprobs: bool = False, top_logprobs: int = 0
                        ) -> SamplingParams:
        """As SamplingFields', with response_format as the json_schema (ValueError: it came with another grammar)."""
        params = super().sampling_params(max_new_tokens, logprobs, top_logprobs)
        schema = self.grammar_json_schema()
        if schema is not None:
            if any(g is not None for g in params.grammar):
                raise ValueError("response_format must be alone: give one of response_format, json_schema, regex "
                                 "and ebnf")
            params.json_schema = schema
        return params


class CompletionRequest(OpenAIRequest):
    UNSUPPORTED: ClassVar[dict[str, object]] = {"suffix": "", "best_of": 1}

    prompt: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    name: StrictStr
    arguments: StrictStr


class ToolCall(BaseModel):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool's answer: the call it answers
    reasoning_content: StrictStr | None = None


class FunctionDefinition(BaseModel):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(OpenAIRequest):
    UNSUPPORTED: ClassVar[dict[str, object]] = {
        "reasoning_effort": None, "functions": None, "function_call": None, "audio": None, "prediction": None,
        "web_search_options": None, "modalities": ["text"]}

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    # Passed to the chat template: extra variables, and (continue_final_message) the last assistant message
    # continued rather than a new one started.
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    continue_final_message: StrictBool = False


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
