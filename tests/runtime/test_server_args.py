"""ServerArgs: the speculative-decoding and expert-parallel flags, their defaults, and errors that name the flag."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from plugserve.runtime.server_args import ServerArgs, SpeculativeConfig, describe_validation_error


def _error(**flags) -> str:
    with pytest.raises(ValidationError) as exc:
        ServerArgs(**flags)
    return describe_validation_error(exc.value)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"speculative_algorithm": "NEXTN"}, SpeculativeConfig("NEXTN", 3, 1, 4)),
        ({"speculative_algorithm": "EAGLE", "speculative_num_steps": 2}, SpeculativeConfig("EAGLE", 2, 1, 3)),
        ({"speculative_algorithm": "NEXTN", "speculative_num_draft_tokens": 6}, SpeculativeConfig("NEXTN", 5, 1, 6)),
        ({"speculative_algorithm": "NEXTN", "speculative_num_steps": 1, "speculative_eagle_topk": 1,
          "speculative_num_draft_tokens": 2}, SpeculativeConfig("NEXTN", 1, 1, 2)),
    ],
)
def test_speculative_defaults_fill_in_a_chain(flags, expected):
    assert ServerArgs(**flags).speculative == expected


def test_speculation_is_off_by_default():
    assert ServerArgs().speculative is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"speculative_algorithm": "EAGLE3"},
         "--speculative-algorithm 'EAGLE3' is not one of: NEXTN, EAGLE"),
        ({"speculative_num_steps": 2}, "--speculative-num-steps needs --speculative-algorithm (NEXTN or EAGLE)"),
        ({"speculative_algorithm": "NEXTN", "speculative_num_steps": 0},
         "--speculative-num-steps: Input should be greater than or equal to 1"),
        ({"speculative_algorithm": "NEXTN", "speculative_draft_model_path": "/models/draft"},
         "--speculative-draft-model-path /models/draft: not a checkpoint directory (no config.json there)"),
        ({"speculative_draft_model_path": "/models/draft"},
         "--speculative-draft-model-path needs --speculative-algorithm (NEXTN or EAGLE)"),
        ({"speculative_algorithm": "NEXTN", "speculative_num_steps": 2, "speculative_eagle_topk": 4,
          "speculative_num_draft_tokens": 22},
         "--speculative-num-draft-tokens 22 is more than --speculative-num-steps 2 with --speculative-eagle-topk 4 "
         "draft: at most 21"),
        ({"speculative_algorithm": "NEXTN", "speculative_num_steps": 3, "speculative_num_draft_tokens": 6},
         "--speculative-num-draft-tokens 6 must be --speculative-num-steps + 1 = 4"),
        ({"speculative_algorithm": "NEXTN", "enable_deterministic_inference": True},
         "--enable-deterministic-inference does not combine with --speculative-algorithm"),
        ({"tp_size": 8, "enable_dp_attention": True, "dp_size": 2, "enable_deterministic_inference": True},
         "--enable-deterministic-inference takes DP attention groups of at most two ranks, not 4 (--tp-size 8 / "
         "--dp-size 2)"),
    ],
)
def test_bad_speculative_flags_are_refused_naming_the_flag(flags, message):
    assert message in _error(**flags)


def test_the_cli_takes_sglangs_spelling():
    import argparse

    from plugserve.server.launch import add_server_args, server_args_from

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    argv = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "3"]
    assert server_args_from(parser.parse_args(argv), parser).speculative == SpeculativeConfig("EAGLE", 2, 1, 3)



@pytest.mark.parametrize(("tp_size", "ep_size"), [(2, 2), (4, 1), (4, 4)])
def test_ep_size_is_1_or_the_tp_size(tp_size, ep_size):
    assert ServerArgs(tp_size=tp_size, ep_size=ep_size).ep_size == ep_size


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"tp_size": 4, "ep_size": 2}, "--ep-size 2 must be 1 or --tp-size (4)"),
        ({"ep_size": 2}, "--ep-size 2 must be 1 or --tp-size (1)"),
        ({"tp_size": 2, "ep_size": 2, "enable_shared_experts_fusion": True},
         "--enable-shared-experts-fusion does not combine with --ep-size 2"),
    ],
)
def test_bad_expert_parallel_flags_are_refused_naming_the_flag(flags, message):
    assert message in _error(**flags)


@pytest.mark.parametrize("ep_size", [1, 2])
def test_dp_attention_takes_a_dp_size_of_the_tp_size(ep_size):
    args = ServerArgs(tp_size=2, ep_size=ep_size, enable_dp_attention=True, dp_size=2)
    assert args.dp_attention_size == 2 and ServerArgs(tp_size=2).dp_attention_size == 1


@pytest.mark.parametrize(("tp_size", "dp_size", "ep_size"), [(4, 2, 1), (4, 2, 4), (8, 2, 1), (8, 4, 8)])
def test_dp_attention_takes_a_dp_size_dividing_the_tp_size(tp_size, dp_size, ep_size):
    """Each DP group is --tp-size / --dp-size ranks, which split the group's attention heads."""
    args = ServerArgs(tp_size=tp_size, ep_size=ep_size, enable_dp_attention=True, dp_size=dp_size)
    assert args.dp_attention_size == dp_size


def test_dp_attention_combines_with_speculative_decoding():
    args = ServerArgs(tp_size=2, enable_dp_attention=True, dp_size=2, speculative_algorithm="EAGLE",
                      speculative_eagle_topk=2, speculative_num_draft_tokens=4)
    assert args.dp_attention_size == 2 and args.speculative is not None and args.speculative.topk == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"tp_size": 2, "enable_dp_attention": True}, "--enable-dp-attention needs --dp-size > 1"),
        ({"tp_size": 2, "dp_size": 2}, "--dp-size 2 needs --enable-dp-attention"),
        ({"tp_size": 6, "dp_size": 4, "enable_dp_attention": True}, "--dp-size 4 must divide --tp-size (6)"),
        ({"tp_size": 2, "dp_size": 4, "enable_dp_attention": True}, "--dp-size 4 must divide --tp-size (2)"),
    ],
)
def test_bad_dp_attention_flags_are_refused_naming_the_flag(flags, message):
    assert message in _error(**flags)


def test_disable_custom_all_reduce_is_for_several_ranks():
    assert ServerArgs(tp_size=2, disable_custom_all_reduce=True).disable_custom_all_reduce
    assert "--disable-custom-all-reduce is for several ranks: give --tp-size > 1" in _error(
        disable_custom_all_reduce=True)


def test_the_api_key_comes_from_a_file_and_stays_out_of_dumps(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    args = ServerArgs(api_key_file=str(key_file))
    assert args.api_key == "sk-from-file"
    assert "sk-from-file" not in repr(args) and "sk-from-file" not in str(args.model_dump(mode="json"))
    assert "give --api-key or --api-key-file, not both" in _error(api_key="k", api_key_file=str(key_file))
    (tmp_path / "empty").write_text("\n")
    assert "its first line is empty" in _error(api_key_file=str(tmp_path / "empty"))
    assert "cannot read a key from it" in _error(api_key_file=str(tmp_path / "missing"))


def test_the_cli_takes_the_api_key_from_the_environment(monkeypatch):
    import argparse

    from plugserve.server.launch import API_KEY_VARIABLE, add_server_args, server_args_from

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    monkeypatch.setenv(API_KEY_VARIABLE, "sk-from-env")
    assert server_args_from(parser.parse_args([]), parser).api_key == "sk-from-env"
    assert server_args_from(parser.parse_args(["--api-key", "sk-flag"]), parser).api_key == "sk-flag"


def test_max_sequences_per_request_defaults_to_256_and_takes_the_cli_flag():
    import argparse

    from plugserve.server.launch import HELP, add_server_args, server_args_from

    assert ServerArgs().max_sequences_per_request == 256
    assert "--max-sequences-per-request" in _error(max_sequences_per_request=0)
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    namespace = parser.parse_args(["--max-sequences-per-request", "1024"])
    assert server_args_from(namespace, parser).max_sequences_per_request == 1024
    assert "n" in HELP["max_sequences_per_request"]


def _parse(argv: list[str]) -> ServerArgs:
    import argparse

    from plugserve.server.launch import add_server_args, server_args_from

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return server_args_from(parser.parse_args(argv), parser)


def test_a_launch_command_from_sglangs_deepseek_docs_parses():
    """`python3 -m sglang.launch_server --model deepseek-ai/DeepSeek-V3 --tp 8 --trust-remote-code ...` with
    `plugserve serve` in front: SGLang's short spellings, its old switches and the flags that mean nothing here."""
    command = ("--model /models/DeepSeek-V3 --tp 8 --trust-remote-code --enable-flashinfer-mla --enable-ep-moe "
                  "--enable-metrics --enable-cache-report --disable-overlap-schedule --enable-torch-compile "
                  "--torch-compile-max-bs 8 --cuda-graph-max-bs 128 --mem-fraction-static 0.85 "
                  "--chunked-prefill-size 4096 --max-prefill-tokens 2048 --schedule-policy lpm --stream-interval 4 "
                  "--log-requests --log-requests-level 1 --watchdog-timeout 600 --skip-server-warmup "
                  "--decode-log-interval 10 --random-seed 7 --host 0.0.0.0 --port 30000")
    args = _parse(command.split())
    assert (args.model_path, args.tp_size, args.ep_size, args.attention_backend) == \
        ("/models/DeepSeek-V3", 8, 8, "flashinfer_mla")
    assert (args.schedule_policy, args.stream_interval, args.prefill_token_budget, args.seed) == ("lpm", 4, 2048, 7)
    assert [line.split(":")[0] for line in args.notices()] == \
        ["--trust-remote-code", "--enable-metrics", "--enable-cache-report"]


def test_model_and_model_path_are_one_flag():
    assert _parse(["--model-path", "/m"]).model_path == _parse(["--model", "/m"]).model_path == "/m"


def test_sglangs_other_schedule_policies_are_refused_naming_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        _parse(["--schedule-policy", "lof"])
    assert "--schedule-policy: invalid choice: 'lof' (choose from 'fcfs', 'lpm')" in capsys.readouterr().err
    assert "--schedule-policy 'dfs-weight' is not one of: fcfs, lpm" in _error(schedule_policy="dfs-weight")


def test_max_prefill_tokens_and_chunked_prefill_size_cap_a_prefill_batch_together():
    assert ServerArgs().prefill_token_budget == 8192
    assert ServerArgs(max_prefill_tokens=1024).prefill_token_budget == 1024
    assert ServerArgs(chunked_prefill_size=-1, max_prefill_tokens=3000).prefill_token_budget == 3000
    assert ServerArgs(chunked_prefill_size=-1).prefill_token_budget is None


def test_a_chat_template_is_a_file_or_inline_jinja(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert ServerArgs(chat_template=str(path)).chat_template_text == path.read_text()
    assert ServerArgs(chat_template="{{ messages[0].content }}").chat_template_text == "{{ messages[0].content }}"
    assert "--chat-template 'chatml': no such file, nor an inline Jinja template" in _error(chat_template="chatml")
    assert "--chat-template: not a Jinja template (Expected an expression" in _error(chat_template="{% for %}}")


def test_help_shows_defaults_and_choices(capsys):
    with pytest.raises(SystemExit):
        _parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--schedule-policy {fcfs,lpm}" in text and "(default: fcfs)" in text
    assert "--load-format {auto,safetensors,dummy}" in text and "(default: 300.0)" in text


def test_sglang_flags_without_a_counterpart_are_refused_saying_why(capsys):
    with pytest.raises(SystemExit):
        _parse(["--tp", "8", "--enable-deepep-moe", "--model", "/m"])
    assert "--enable-deepep-moe is not supported: no DeepEP all-to-all here" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(["--revision", "main"])
    assert "--revision is not supported: checkpoints are read from a local directory only" in capsys.readouterr().err


def test_a_kv_cache_dtype_no_usable_backend_reads_is_refused_naming_the_supported_ones(monkeypatch):
    """The torch reference reads any KV dtype; declared as reading only its activations' (as the GPU libraries'
    backends do), a bfloat16 cache under float32 activations is refused at parse time, not at warm-up."""
    import dataclasses

    from plugserve.plugins.attention.torch_ref import TorchRefAttention

    assert ServerArgs(kv_cache_dtype="bfloat16", dtype="float32", device="cpu").kv_cache_dtype == "bfloat16"
    assert ServerArgs(kv_cache_dtype="fp8_e4m3", device="cpu").kv_cache_dtype == "fp8_e4m3"
    own_only = dataclasses.replace(TorchRefAttention.capabilities, kv_cache_dtypes=None,
                                   kv_cache_note="say why")
    monkeypatch.setattr(TorchRefAttention, "capabilities", own_only)
    message = _error(kv_cache_dtype="bfloat16", dtype="float32", device="cpu", attention_backend="torch_ref")
    assert message.startswith("--kv-cache-dtype bfloat16: no decode attention backend usable here")
    assert "torch_ref: the activation dtype only (say why)" in message
    assert message.endswith("supported here: auto, float32")
