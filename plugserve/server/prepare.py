"""What the endpoints do with a request body before the engine sees it: the model checked, the prompts tokenized,
the sampling parameters checked against the model (a 400 names the field as the request does), the grammar compiled,
the tools planned, n samples expanded into jobs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from plugserve.runtime.engine import Engine
from plugserve.runtime.grammar import GrammarError
from plugserve.runtime.sampling import SamplingParams
from plugserve.server.protocol import ChatCompletionRequest, OpenAIRequest
from plugserve.server.tool_calls import ToolChoiceError, ToolPlan, plan_tools

# What a request calls a SamplingParams field, for error messages: OpenAI's names at the top level of the body,
# SGLang's inside /generate's sampling_params.
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "top_logprobs": "logprobs"}


def openai_name(field: str) -> str:
    return OPENAI_NAMES.get(field, field)


def generate_name(field: str) -> str:
    return f"sampling_params.{field}"


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


Job = tuple[int, list[int], SamplingParams]  # choice index, prompt ids, one sample's params


def check_model(engine: Engine, model: str | None) -> None:
    """OpenAI answers an unknown model with 404 model_not_found; a missing one means the served model."""
    if model is not None and model not in engine.model_names:
        raise BadRequest(f"the model `{model}` does not exist; this server serves `{engine.model_name}`", "model",
                         status=404, code="model_not_found")


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def tokenize(engine: Engine, prompt: str | Sequence[int], field: str) -> list[int]:
    """The prompt's token ids; a 400 names the request's own `field` (/generate has no `prompt`, only `text` or
    `input_ids`; chat's prompt is its `messages`), as the engine's message cannot."""
    try:
        return engine.tokenize(prompt)
    except ValueError as exc:
        raise BadRequest(f"{field}: {exc}", field) from None


def validate(params: SamplingParams, prompt_len: int, engine: Engine,
             name: Callable[[str], str] = openai_name) -> None:
    """What the model bounds: stop token ids in its vocabulary, prompt and output within its context (and
    SamplingParams.validate's ranges, which the request's schema states already). A 400 names the field as the
    request does (`name`)."""
    try:
        params.validate()
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise BadRequest(str(exc).replace(field, name(field), 1), name(field)) from None
    vocab = engine.runner.config.vocab_size
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise BadRequest(f"{name('stop_token_ids')} must lie in [0, {vocab}), the model's vocabulary, got "
                         f"{params.stop_token_ids}", name("stop_token_ids"))
    if any(not 0 <= t < vocab for t in params.logit_bias):
        raise BadRequest(f"{name('logit_bias')} keys must be token ids in [0, {vocab}), the model's vocabulary, "
                         f"got {sorted(t for t in params.logit_bias if not 0 <= t < vocab)}", name("logit_bias"))
    context = engine.runner.context_length
    if prompt_len + params.max_new_tokens > context:
        raise BadRequest(f"this model's context length is {context} tokens; the prompt has {prompt_len} and "
                         f"{name('max_new_tokens')} asks for {params.max_new_tokens} more", name("max_new_tokens"))
    pool = engine.runner.max_total_tokens
    if prompt_len + params.max_new_tokens > pool:  # else the scheduler would stop it short, finish_reason "length"
        raise BadRequest(f"the KV cache holds {pool} tokens (--max-total-tokens); the prompt has {prompt_len} and "
                         f"{name('max_new_tokens')} asks for {params.max_new_tokens} more, which could never fit "
                         "(refused by the maximum, even where EOS or a stop might end it sooner)",
                         name("max_new_tokens"))


def check_fan_out(engine: Engine, num_prompts: int, n: int) -> None:
    """Bound the sequences one request makes: each is held, and aborted one by one, by the scheduler."""
    limit = engine.args.max_sequences_per_request
    if num_prompts * n > limit:
        raise BadRequest(f"the request asks for {num_prompts} prompt(s) x n = {n}, {num_prompts * n} sequences; "
                         f"this server takes at most {limit} per request (--max-sequences-per-request)",
                         "n" if num_prompts == 1 else "prompt")


def make_jobs(engine: Engine, prompts: Sequence[str | Sequence[int]], field: str, body: OpenAIRequest,
          max_tokens: int | None, logprobs: bool, top_logprobs: int, overrides: dict[str, Any] | None = None,
          grammar_field: str | None = None) -> list[Job]:
    """The sequences of an OpenAI request, n per prompt, prompt-major; checked before any prompt is tokenized, their
    grammar compiled (run in a worker thread: both take a while). `field`: where the prompts came from, for a 400's
    name; `overrides`: SamplingParams fields the endpoint sets itself (a tools grammar: `grammar_field` names it)."""
    check_fan_out(engine, len(prompts), body.n)
    jobs: list[Job] = []
    room = min(engine.runner.context_length, engine.runner.max_total_tokens)
    response_format = body.response_format is not None and body.response_format.type != "text"
    for prompt in prompts:
        ids = tokenize(engine, prompt, field)
        budget = max_tokens if max_tokens is not None else room - len(ids)
        try:
            params = dataclasses.replace(body.sampling_params(budget, logprobs, top_logprobs), **(overrides or {}))
        except ValueError as exc:
            raise BadRequest(str(exc), "response_format") from None
        validate(params, len(ids), engine)
        compile_grammar(engine, params, openai_name, grammar_field or ("response_format" if response_format else None))
        jobs += [(len(jobs) + i, ids, p) for i, p in enumerate(Engine.expand(params))]
    return jobs


def compile_grammar(engine: Engine, params: SamplingParams, name: Callable[[str], str],
                     field: str | None = None) -> None:
    """Compile the request's grammar now (cached for its submission); a 400 names `field`, or the grammar's own."""
    try:
        engine.compile_grammar(params)
    except GrammarError as exc:
        param = field or name(exc.field)
        raise BadRequest(f"{param}: {exc}" if field else str(exc).replace(exc.field, param, 1), param) from None


def check_supported(body: OpenAIRequest) -> None:
    """A 400 naming a field this server does not honour, rather than an answer as if it had not been sent."""
    if (unsupported := body.unsupported_field()) is not None:
        raise BadRequest(f"{unsupported} is not supported by this server", unsupported)


def tool_plan(engine: Engine, body: ChatCompletionRequest) -> ToolPlan:
    if body.tools and body.response_format is not None and body.response_format.type != "text":
        raise BadRequest("give tools or response_format, not both", "response_format")
    try:
        return plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, engine.args.tool_call_parser)
    except ToolChoiceError as exc:
        raise BadRequest(str(exc), exc.field) from None
