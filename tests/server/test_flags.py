"""No silent flag: every flag of `plugserve serve --help` (and the hidden SGLang spellings refused there) has a row
saying what it does on this machine, a CPU without CUDA: it changes ServerArgs' or the model runner's observable
state (each row names what, and the default does not have it), or it is refused with a message naming it, or it
warns naming the value used. A flag added without a row fails `test_every_flag_has_a_row`.

The runner rows build the tiny preset with one layer and a 64-token pool (half a second each); nothing serves."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from plugserve.runtime.model_runner import ModelRunner, device_memory, graph_max_bs
from plugserve.runtime.server_args import ServerArgs
from plugserve.server.launch import add_server_args, server_args_from

BASE = ["--model-preset", "tiny", "--num-layers", "1", "--max-total-tokens", "64"]


@dataclass(frozen=True)
class Sets:
    """ServerArgs parsed from the flags have `what` (the defaults do not)."""

    what: Callable[[ServerArgs], bool]


@dataclass(frozen=True)
class Runs:
    """The model runner built from the flags (on BASE) has `what` (BASE's does not)."""

    what: Callable[[ModelRunner], bool]


@dataclass(frozen=True)
class Refused:
    """Parsing, ServerArgs or the runner refuses the flags: the message names the row's flag and holds `text`."""

    text: str


@dataclass(frozen=True)
class Warns:
    """The runner builds, and a warning (a logged one or a start-up notice) names the flag and holds `text`."""

    text: str


Row = tuple[list[str], Sets | Runs | Refused | Warns]


def _key_file(tmp_path: Path) -> str:
    path = tmp_path / "key"
    path.write_text("sk-from-file\n")
    return str(path)


def _chosen(kind: str, phase: str) -> Callable[[ModelRunner], bool]:
    return lambda r: any(c.kind == kind and c.phase == phase and c.reason == "requested" for c in r.backends.chosen)


def _batch_invariant(runner: ModelRunner) -> bool:
    """Every backend built for batch-invariant specs (and so one that declares it)."""
    backends = [b.backend for b in runner.backends.decode_buckets + runner.backends.prefill_buckets]
    model = runner.backends.model
    backends += [b for b in (model.moe, model.gemm) if b is not None]
    return all(b.spec.batch_invariant and b.capabilities.batch_invariant for b in backends)


_NOT_SUPPORTED = Refused("is not supported")

# flag -> (its argv, with {key_file} filled in; the outcome on this machine)
ROWS: dict[str, Row] = {
    # model
    "--model-path": (["--model-path", "/models/m"], Sets(lambda a: a.model_dir == "/models/m")),
    "--model-preset": (["--model-preset", "tiny"], Sets(lambda a: a.model_dir is None)),
    "--tokenizer-path": (["--tokenizer-path", "/tok"], Sets(lambda a: a.tokenizer_path == "/tok")),
    "--load-format": (["--load-format", "safetensors"], Refused("safetensors needs --model-path")),
    "--quantization": (["--quantization", "fp8"], Runs(lambda r: r.config.fp8_block == (128, 128)
                                                      and r.backends.model.gemm is not None)),
    "--num-layers": (["--num-layers", "2"], Runs(lambda r: r.config.num_hidden_layers == 2)),
    "--dtype": (["--dtype", "bfloat16"], Runs(lambda r: r.dtype == torch.bfloat16)),
    "--device": (["--device", "cuda"], Refused("torch sees no CUDA device here")),
    "--context-length": (["--context-length", "100"], Runs(lambda r: r.context_length == 100)),
    # HTTP
    "--host": (["--host", "0.0.0.0"], Sets(lambda a: a.host == "0.0.0.0")),
    "--port": (["--port", "8000"], Sets(lambda a: a.port == 8000)),
    "--api-key": (["--api-key", "sk-x"], Sets(lambda a: a.api_key == "sk-x")),
    "--api-key-file": (["--api-key-file", "{key_file}"], Sets(lambda a: a.api_key == "sk-from-file")),
    "--served-model-name": (["--served-model-name", "m"], Sets(lambda a: a.served_model_name == "m")),
    "--graceful-shutdown-timeout": (["--graceful-shutdown-timeout", "3"],
                                    Sets(lambda a: a.graceful_shutdown_timeout == 3)),
    "--max-request-body-bytes": (["--max-request-body-bytes", "1000"],
                                 Sets(lambda a: a.max_request_body_bytes == 1000)),
    "--allowed-origins": (["--allowed-origins", "a, b"], Sets(lambda a: a.origins == ["a", "b"])),
    "--chat-template": (["--chat-template", "{{ messages }}"],
                        Sets(lambda a: a.chat_template_text == "{{ messages }}")),
    "--stream-interval": (["--stream-interval", "4"], Sets(lambda a: a.stream_interval == 4)),
    "--enable-cache-report": (["--enable-cache-report"], Warns("cached_tokens is always reported")),
    "--enable-metrics": (["--enable-metrics"], Warns("always served at /metrics")),
    "--trust-remote-code": (["--trust-remote-code"], Warns("ignored")),
    "--max-sequences-per-request": (["--max-sequences-per-request", "8"],
                                    Sets(lambda a: a.max_sequences_per_request == 8)),
    # parallelism (a runner of several ranks needs the Engine's processes: ServerArgs' view of them)
    "--tp-size": (["--tp-size", "2"], Sets(lambda a: a.ranks_per_node == 2)),
    "--ep-size": (["--tp", "2", "--ep-size", "2"], Sets(lambda a: a.ep_size == 2)),
    "--enable-dp-attention": (["--tp", "2", "--dp", "2", "--enable-dp-attention"],
                              Sets(lambda a: a.dp_attention_size == 2)),
    "--dp-size": (["--dp-size", "2"], Refused("needs --enable-dp-attention")),
    "--nnodes": (["--tp", "2", "--nnodes", "2", "--dist-init-addr", "h:1"],
                 Sets(lambda a: a.nnodes == 2 and a.ranks_per_node == 1)),
    "--node-rank": (["--node-rank", "1"], Refused("1 must be below --nnodes 1")),
    "--dist-init-addr": (["--dist-init-addr", "h:1"], Refused("is for several ranks")),
    "--disable-custom-all-reduce": (["--disable-custom-all-reduce"], Refused("is for several ranks")),
    "--all-reduce-backend": (["--all-reduce-backend", "torch_ref"], Refused("is for several ranks")),
    # backends
    "--attention-backend": (["--attention-backend", "torch_ref"],
                            Runs(lambda r: _chosen("attention", "decode")(r) and _chosen("attention", "prefill")(r))),
    "--prefill-attention-backend": (["--prefill-attention-backend", "torch_ref"],
                                    Runs(_chosen("attention", "prefill"))),
    "--decode-attention-backend": (["--decode-attention-backend", "torch_ref"], Runs(_chosen("attention", "decode"))),
    "--fp8-gemm-backend": (["--fp8-gemm-backend", "triton"], Refused("triton: the model has no block-FP8 weights")),
    "--moe-runner-backend": (["--moe-runner-backend", "torch_ref"], Runs(_chosen("moe", "decode"))),
    # memory and scheduling
    "--page-size": (["--page-size", "4"], Runs(lambda r: r.page_size == 4)),
    "--kv-cache-dtype": (["--kv-cache-dtype", "float16"], Runs(lambda r: r.pool.dtype == torch.float16)),
    "--chunked-prefill-size": (["--chunked-prefill-size", "64"], Sets(lambda a: a.prefill_token_budget == 64)),
    "--chunked-prefix-cache-threshold": (["--chunked-prefix-cache-threshold", "16"],
                                         Sets(lambda a: a.chunked_prefix_cache_threshold == 16)),
    "--max-prefill-tokens": (["--max-prefill-tokens", "1024"], Sets(lambda a: a.prefill_token_budget == 1024)),
    "--schedule-policy": (["--schedule-policy", "lpm", "--disable-radix-cache"], Refused("lpm needs the prefix cache")),
    "--max-running-requests": (["--max-running-requests", "4"], Runs(lambda r: r.block_table.num_rows == 5)),
    "--max-total-tokens": (["--max-total-tokens", "128"], Runs(lambda r: r.max_total_tokens == 128)),
    "--mem-fraction-static": (["--mem-fraction-static", "0.5"],
                              Warns("--mem-fraction-static 0.5 is not used: --max-total-tokens 64 sizes the KV pool")),
    "--disable-radix-cache": (["--disable-radix-cache"], Sets(lambda a: a.disable_radix_cache)),
    "--disable-overlap-schedule": (["--disable-overlap-schedule"], Sets(lambda a: a.disable_overlap_schedule)),
    "--enable-mixed-chunk": (["--enable-mixed-chunk"], Sets(lambda a: a.enable_mixed_chunk)),
    "--enable-deterministic-inference": (["--enable-deterministic-inference"], Runs(_batch_invariant)),
    # GPU performance switches
    "--disable-cuda-graph": (["--disable-cuda-graph"], Refused("needs a CUDA device: there are no CUDA graphs on")),
    "--cuda-graph-max-bs": (["--cuda-graph-max-bs", "8"], Refused("needs a CUDA device: there are no CUDA graphs on")),
    "--enable-torch-compile": (["--enable-torch-compile"],
                               Runs(lambda r: r.model.layers[0].input_layernorm.ops.rms_norm.__name__
                                    == "compiled_rms_norm")),
    "--torch-compile-max-bs": (["--torch-compile-max-bs", "8"], Refused("needs --enable-torch-compile")),
    "--disable-shared-experts-overlap": (["--disable-shared-experts-overlap"], Refused("needs a CUDA device")),
    "--enable-shared-experts-fusion": (["--enable-shared-experts-fusion"], Refused("torch_ref does not fuse them")),
    # speculative decoding
    "--speculative-algorithm": (["--speculative-algo", "NEXTN"], Sets(lambda a: a.speculative is not None)),
    "--speculative-draft-model-path": (["--speculative-draft", "/d"], Refused("needs --speculative-algorithm")),
    "--speculative-num-steps": (["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"],
                                Sets(lambda a: a.speculative is not None and a.speculative.num_draft_tokens == 3)),
    "--speculative-eagle-topk": (["--speculative-algorithm", "NEXTN", "--speculative-eagle-topk", "2"],
                                 Sets(lambda a: a.speculative is not None and a.speculative.topk == 2)),
    "--speculative-num-draft-tokens": (["--speculative-algorithm", "NEXTN", "--speculative-num-draft-tokens", "3"],
                                       Sets(lambda a: a.speculative is not None and a.speculative.num_steps == 2)),
    # structured output, tools, reasoning
    "--grammar-backend": (["--grammar-backend", "none"], Sets(lambda a: a.grammar_backend == "none")),
    "--tool-call-parser": (["--tool-call-parser", "deepseekv3"], Sets(lambda a: a.tool_call_parser == "deepseekv3")),
    "--reasoning-parser": (["--reasoning-parser", "deepseek-r1"], Sets(lambda a: a.reasoning_parser == "deepseek-r1")),
    # start-up, logs, liveness
    "--skip-server-warmup": (["--skip-server-warmup"], Sets(lambda a: a.skip_server_warmup)),
    "--watchdog-timeout": (["--watchdog-timeout", "5"], Sets(lambda a: a.watchdog_timeout == 5)),
    "--log-requests": (["--log-requests"], Sets(lambda a: a.log_requests)),
    "--log-requests-level": (["--log-requests-level", "2"], Refused("2 needs --log-requests")),
    "--decode-log-interval": (["--decode-log-interval", "5"], Sets(lambda a: a.decode_log_interval == 5)),
    "--log-level": (["--log-level", "debug"], Sets(lambda a: a.log_level == "debug")),
    "--seed": (["--random-seed", "7"], Runs(lambda r: r.sampling_generator.initial_seed() == 7)),
    # SGLang's older switches, and its flags for what plugserve does not have
    "--enable-flashinfer-mla": (["--enable-flashinfer-mla"], Sets(lambda a: a.attention_backend == "flashinfer_mla")),
    "--enable-ep-moe": (["--enable-ep-moe"], Refused("is for several ranks: give --tp-size > 1")),
    "--enable-deepep-moe": (["--enable-deepep-moe"], _NOT_SUPPORTED),
    "--moe-a2a-backend": (["--moe-a2a-backend", "deepep"], _NOT_SUPPORTED),
    "--enable-two-batch-overlap": (["--enable-two-batch-overlap"], _NOT_SUPPORTED),
    "--disaggregation-mode": (["--disaggregation-mode", "prefill"], _NOT_SUPPORTED),
    "--revision": (["--revision", "main"], _NOT_SUPPORTED),
    "--download-dir": (["--download-dir", "/d"], _NOT_SUPPORTED),
    "--load-balance-method": (["--load-balance-method", "round_robin"], _NOT_SUPPORTED),
    "--enable-dp-lm-head": (["--enable-dp-lm-head"], _NOT_SUPPORTED),
    "--moe-dense-tp-size": (["--moe-dense-tp-size", "1"], _NOT_SUPPORTED),
    "--cuda-graph-bs": (["--cuda-graph-bs", "1", "2"], _NOT_SUPPORTED),
    "--is-embedding": (["--is-embedding"], _NOT_SUPPORTED),
}


class _Parser(argparse.ArgumentParser):
    """`plugserve serve`'s parser, its usage errors raised instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def _parser() -> _Parser:
    parser = _Parser(prog="plugserve serve")
    add_server_args(parser)
    return parser


def _args(argv: list[str]) -> ServerArgs:
    parser = _parser()
    return server_args_from(parser.parse_args(argv), parser)


def _flags() -> set[str]:
    return {a.option_strings[0] for a in _parser()._actions if a.option_strings and a.dest != "help"}


def test_every_flag_has_a_row():
    assert sorted(_flags() - set(ROWS)) == [], "flags without a row: say what each does here"
    assert sorted(set(ROWS) - _flags()) == [], "rows for flags that no longer exist"


@pytest.fixture(scope="module")
def base_runner() -> ModelRunner:
    return ModelRunner(_args(BASE))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rows say what each flag does on a machine without CUDA")
@pytest.mark.parametrize("name", sorted(ROWS))
def test_the_flag_does_what_its_row_says(name, tmp_path, caplog, base_runner):
    argv, outcome = ROWS[name]
    argv = [a.replace("{key_file}", _key_file(tmp_path)) for a in argv]
    if isinstance(outcome, Sets):
        assert outcome.what(_args(argv)) and not outcome.what(_args([]))
        return
    if isinstance(outcome, Refused):
        with pytest.raises(ValueError) as error:
            ModelRunner(_args(BASE + argv))
        assert name in str(error.value) and outcome.text in str(error.value), str(error.value)
        return
    with caplog.at_level(logging.WARNING):
        args = _args(BASE + argv)
        runner = ModelRunner(args)
    if isinstance(outcome, Runs):
        assert outcome.what(runner) and not outcome.what(base_runner)
        return
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] + args.notices()
    assert any(line.startswith(name) and outcome.text in line for line in warnings), warnings


def test_a_context_length_above_the_models_is_refused_naming_the_maximum():
    with pytest.raises(ValueError, match="--context-length 9000 is above the model's maximum, "
                                         "max_position_embeddings 8192: give at most 8192"):
        ModelRunner(_args([*BASE, "--context-length", "9000"]))


def test_cuda_graph_max_bs_above_max_running_requests_warns_naming_the_size_used(caplog):
    args = _args(["--cuda-graph-max-bs", "512", "--max-running-requests", "48"])
    with caplog.at_level(logging.WARNING):
        assert graph_max_bs(args, torch.device("cuda"), 48) == 48
    assert "--cuda-graph-max-bs 512 is above --max-running-requests (48): graphs are captured up to 48" in caplog.text
    assert graph_max_bs(_args(["--cuda-graph-max-bs", "16"]), torch.device("cuda"), 48) == 16
    assert graph_max_bs(_args(["--disable-cuda-graph"]), torch.device("cuda"), 48) == 0


def test_cuda_graph_max_bs_and_disable_cuda_graph_together_are_refused():
    with pytest.raises(ValueError, match="--cuda-graph-max-bs does not combine with --disable-cuda-graph"):
        _args(["--cuda-graph-max-bs", "8", "--disable-cuda-graph"])


def test_disable_shared_experts_overlap_under_fusion_is_refused():
    with pytest.raises(ValueError, match="--disable-shared-experts-overlap does not combine with "
                                         "--enable-shared-experts-fusion"):
        _args(["--disable-shared-experts-overlap", "--enable-shared-experts-fusion"])


def test_disable_shared_experts_overlap_on_a_model_without_shared_experts_is_refused(monkeypatch):
    import dataclasses

    import plugserve.runtime.model_runner as model_runner
    from plugserve.core.loader import read_config

    def without_shared(*args, **kwargs):
        config, layers = read_config(*args, **kwargs)
        return dataclasses.replace(config, n_shared_experts=0), layers

    monkeypatch.setattr(model_runner, "read_config", without_shared)
    with pytest.raises(ValueError, match="--disable-shared-experts-overlap: the model has no shared experts"):
        ModelRunner(_args([*BASE, "--disable-shared-experts-overlap"]))


def test_log_requests_below_the_log_level_is_refused():
    with pytest.raises(ValueError, match="--log-requests logs at info: with --log-level warning no line would show"):
        _args(["--log-requests", "--log-level", "warning"])
    assert _args(["--log-requests", "--log-level", "debug"]).log_requests


def test_torch_compile_max_bs_defaults_to_32_under_torch_compile():
    assert _args(["--enable-torch-compile"]).compile_max_bs == 32
    assert _args(["--enable-torch-compile", "--torch-compile-max-bs", "8"]).compile_max_bs == 8


def test_mem_fraction_static_sizes_the_cpu_pool_from_the_machines_memory(monkeypatch):
    """On the CPU, as on a GPU: the pool is what the fraction leaves of the machine's memory (its available
    memory less the share of the total kept free), not the fixed 512 MiB of a CPU launch without the flag."""
    import plugserve.runtime.model_runner as model_runner

    total = 4 << 30
    available = total // 4 + (8 << 20)  # 8 MiB more than the quarter kept free
    monkeypatch.setattr(model_runner, "device_memory", lambda device: (available, total))
    runner = ModelRunner(_args(["--model-preset", "tiny", "--num-layers", "1", "--mem-fraction-static", "0.75"]))
    budget = 8 << 20
    assert runner.max_total_tokens == int(budget // runner.bytes_per_token) - 1  # less the padding page
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        ModelRunner(_args(["--model-preset", "tiny", "--num-layers", "1", "--mem-fraction-static", "0.2"]))


def test_the_cpus_memory_is_the_machines():
    free, total = device_memory(torch.device("cpu"))
    assert 0 < free <= total


def test_fp8_quantization_of_a_block_fp8_checkpoint_warns_that_it_is_used_as_stored(caplog):
    from plugserve.core.loader import read_config
    from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR

    with caplog.at_level(logging.WARNING):
        config, _ = read_config(str(EMBEDDED_MODEL_DIR), None, "fp8")
    assert config.fp8_block == (128, 128)
    assert "--quantization fp8: the checkpoint is block-FP8 already (128x128 blocks): its weights are used as " \
           "stored" in caplog.text
