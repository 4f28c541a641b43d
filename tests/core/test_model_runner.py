import logging

import pytest

from plugserve.core.model_runner import ModelRunner
from plugserve.core.server_args import ServerArgs
from plugserve.registry import SelectionError


def test_backends_are_chosen_through_the_registry_with_reasons():
    runner = ModelRunner(ServerArgs(max_total_tokens=256))
    chosen = {(c.kind, c.phase): c for c in runner.chosen}
    assert set(chosen) == {("attention", "decode"), ("attention", "prefill"), ("moe", "decode")}
    assert all(c.name == "torch_ref" and "priority" in c.reason for c in chosen.values())
    assert runner.page_size == 1 and runner.max_total_tokens == 256


def test_fp8_quantization_selects_a_gemm_backend_and_page_size_is_honoured():
    runner = ModelRunner(ServerArgs(quantization="fp8", page_size=16, max_total_tokens=512))
    assert ("gemm", "decode") in {(c.kind, c.phase) for c in runner.chosen}
    assert runner.page_size == 16 and runner.pool.num_pages == 32


def test_an_fp8_kv_cache_no_backend_supports_is_an_error_naming_the_flag():
    with pytest.raises(SelectionError, match=r"--attention-backend: .*kv cache dtype float8_e4m3fn is not supported"):
        ModelRunner(ServerArgs(kv_cache_dtype="fp8_e4m3"))


def test_gpu_only_flags_say_they_do_nothing_on_the_cpu(caplog):
    with caplog.at_level(logging.WARNING):
        ModelRunner(ServerArgs(enable_torch_compile=True, cuda_graph_max_bs=8, max_total_tokens=64))
    assert "--enable-torch-compile does nothing on the CPU" in caplog.text
    assert "--cuda-graph-max-bs does nothing on the CPU" in caplog.text


def test_a_pool_too_small_to_hold_anything_is_refused():
    with pytest.raises(ValueError, match="--max-total-tokens"):
        ModelRunner(ServerArgs(max_total_tokens=1))
