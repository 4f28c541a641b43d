"""/metrics as exported: every sample labelled model_name, and SGLang's names beside plugserve's."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from plugserve.runtime.metrics import SGLANG_NAMES, Metrics
from plugserve.runtime.request import FinishReason, Request
from plugserve.runtime.sampling import SamplingParams


def _finished(reason: FinishReason, outputs: int) -> Request:
    request = Request("r", [1, 2, 3], SamplingParams(), lambda output: None, output_ids=[7] * outputs)
    request.first_token_time, request.finish_reason = request.arrival_time, reason
    return request


def test_every_sample_has_the_model_name_and_sglangs_name_repeats_ours():
    metrics = Metrics("deepseek-ai/DeepSeek-V3", max_total_tokens=4096)
    metrics.observe_scheduled(_finished(FinishReason.LENGTH, 0))
    metrics.observe_finish(_finished(FinishReason.LENGTH, 5))
    metrics.observe_finish(_finished(FinishReason.ABORT, 1))
    metrics.prompt_tokens.inc(3)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert {s.labels.get("model_name") for f in families.values() for s in f.samples} == {"deepseek-ai/DeepSeek-V3"}
    for ours, sglang in SGLANG_NAMES.items():
        assert [(s.name.replace(ours, sglang), s.labels, s.value) for s in families[ours].samples] == \
            [(s.name, s.labels, s.value) for s in families[sglang].samples], sglang

    def value(name: str, **labels: str) -> float:
        family = name.removesuffix("_total").removesuffix("_count")
        return next(s.value for s in families[family].samples
                    if s.name == name and labels.items() <= s.labels.items())

    assert value("sglang:max_total_num_tokens") == 4096
    assert value("sglang:num_aborted_requests_total") == 1
    assert value("sglang:num_requests_total", finish_reason="length") == 1
    assert value("sglang:prompt_tokens_total") == 3
    assert value("sglang:time_per_output_token_seconds_count") == 1  # one request with a token after its first
    assert value("sglang:queue_time_seconds_count") == 1
