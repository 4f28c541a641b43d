"""OpenAI-compatible request and response bodies (the subset plugserve serves, plus SGLang's extensions
`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from plugserve.core.sampling import SamplingParams

SEED_LIMIT = 2**63  # seeds are int64 on the device
Seed = Annotated[StrictInt, Field(ge=0, lt=SEED_LIMIT)]
TokenId = Annotated[StrictInt, Field(ge=0)]  # the vocabulary's upper bound is checked against the model
Number = StrictFloat | StrictInt  # JSON numbers; "0.5" or "hot" are refused, not coerced
# SamplingParams.validate's ranges, stated in the schema too (clients and the API fuzzer read them there).
Penalty = Annotated[float, Field(ge=-2, le=2)]
MAX_N = 64
MAX_STOPS = 16


def stop_list(stop: str | list[str] | None) -> list[str]:
    """OpenAI's `stop`: one string is one stop string (not its characters)."""
    return [stop] if isinstance(stop, str) else list(stop or [])


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions. Unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: Seed | None = None
    user: str | None = None
    # extensions
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    skip_special_tokens: bool = True

    def sampling_params(self, max_new_tokens: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
        stop = stop_list(self.stop)
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, stop=stop, stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos, seed=self.seed, n=self.n, logprobs=logprobs, top_logprobs=top_logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class GenerateSamplingParams(BaseModel):
    """/generate's `sampling_params`, SGLang's names, every field typed: nothing reaches SamplingParams
    unchecked (ranges are SamplingParams.validate's; token ids are checked against the vocabulary)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: StrictInt = Field(128, ge=1)
    temperature: Number = Field(1.0, ge=0)
    top_p: Number = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(-1, ge=-1)
    min_p: Number = Field(0.0, ge=0, le=1)
    frequency_penalty: Number = Field(0.0, ge=-2, le=2)
    presence_penalty: Number = Field(0.0, ge=-2, le=2)
    repetition_penalty: Number = Field(1.0, gt=0)
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: StrictBool = False
    seed: Seed | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    skip_special_tokens: StrictBool = True

    def to_params(self) -> SamplingParams:
        return SamplingParams(**(self.model_dump() | {"stop": stop_list(self.stop)}))


class GenerateRequest(BaseModel):
    """plugserve's native endpoint, shaped like SGLang's /generate."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = None
    input_ids: list[TokenId] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: str | None = None


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
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
