"""bench_decode_vs_hf: the bytes of a decode step against a hand count, the transformers config mapping, and
the whole script on the CPU (plugserve, transformers eagerly, the copy-bandwidth limit)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from benchmarks import bench_decode_vs_hf as bench
from plugserve.core import config as config_module
from plugserve.core.config import ModelConfig, preset_config

# DeepSeek-V2-Lite's structure at a size the CPU runs in a second.
TINY_V2_LITE = dict(
    model_type="deepseek_v2", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, n_shared_experts=2, n_routed_experts=8, routed_scaling_factor=1.0,
    kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, topk_method="greedy",
    n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=False,
    scoring_func="softmax", max_position_embeddings=4096, rope_theta=10000.0,
    rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=256, beta_fast=32, beta_slow=1,
                      mscale=0.707, mscale_all_dim=0.707),
    bos_token_id=0, eos_token_id=1,
)


def _hand_config(**overrides) -> ModelConfig:
    """2 layers (dense, then MoE), hidden 8, 2 heads, no q LoRA, 4 experts pick 2, 1 shared expert."""
    fields = dict(vocab_size=10, hidden_size=8, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=4,
                  qk_rope_head_dim=2, qk_nope_head_dim=2, v_head_dim=2, intermediate_size=6, moe_intermediate_size=3,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, num_hidden_layers=2,
                  first_k_dense_replace=1)
    return dataclasses.replace(preset_config("deepseek-v2-lite"), **(fields | overrides))


def test_decode_step_bytes_matches_a_hand_count():
    # Elements per layer: q_proj 8x8 64, kv_a_proj 6x8 48, kv_a_layernorm 4, kv_b_proj 8x4 32, o_proj 8x4 32,
    # two norms 16 = 196; layer 0's MLP 3x6x8 = 144; layer 1's router 4x8 32 + shared expert 3x3x8 72;
    # final norm 8 + lm head 10x8 80. 2 x 196 + 144 + 104 + 88 = 728 elements, 2 bytes each.
    config = _hand_config()
    one = bench.decode_step_bytes(config, batch_size=1, context_len=10)
    assert one.weights == 728 * 2
    # One expert 3x3x8 = 72 elements; 1 token picks 2 of 4, 2 tokens 4 * (1 - (1/2)^2) = 3 on average.
    assert one.experts == 2 * 72 * 2
    assert one.kv_cache == 1 * 10 * 2 * (4 + 2) * 2
    two = bench.decode_step_bytes(config, batch_size=2, context_len=10)
    assert two.experts == pytest.approx(3 * 72 * 2)
    assert two.kv_cache == 480 and two.total == two.weights + two.experts + two.kv_cache
    assert bench.decode_step_bytes(config, batch_size=2, context_len=10, kv_bytes=1).kv_cache == 240
    # q LoRA 3: q_a_proj 3x8 24 + q_a_layernorm 3 + q_b_proj 8x3 24 = 51 instead of 64 per layer; noaux_tc adds
    # the router's float32 correction bias (4 experts x 4 bytes).
    lora = bench.decode_step_bytes(_hand_config(q_lora_rank=3, topk_method="noaux_tc", scoring_func="sigmoid"), 1, 10)
    assert lora.weights == (728 - 2 * 13) * 2 + 16


def test_decode_step_bytes_counts_block_fp8_at_one_byte_plus_a_scale_per_block():
    # The 14 decoder linear weights (4 per attention, 3 dense MLP, 3 shared expert) of 568 elements in all are
    # e4m3 with one float32 scale each (every one fits one 128x128 block); norms 2 x 20, router 32, final norm 8
    # and lm head 80 stay 2 bytes.
    fp8 = bench.decode_step_bytes(_hand_config(fp8_block=(128, 128)), batch_size=2, context_len=10)
    assert fp8.weights == 568 + 14 * 4 + (40 + 32 + 8 + 80) * 2
    assert fp8.experts == pytest.approx(3 * (72 + 3 * 4))


def test_expected_distinct_experts():
    assert bench.expected_distinct_experts(64, 6, 1) == pytest.approx(6)
    assert bench.expected_distinct_experts(64, 6, 10**4) == pytest.approx(64)


@pytest.mark.parametrize("preset", ["deepseek-v2-lite", "tiny"])
def test_hf_config_maps_every_field_back(preset):
    config = preset_config(preset).with_layers(2)
    assert ModelConfig.from_hf(bench.hf_config(config)) == config


def test_hf_config_refuses_what_transformers_cannot_run():
    with pytest.raises(ValueError, match="--skip-hf"):
        bench.hf_config(preset_config("deepseek-v3"))  # block-FP8
    with pytest.raises(ValueError, match="sigmoid"):
        bench.hf_config(dataclasses.replace(preset_config("deepseek-v2-lite"), scoring_func="sigmoid"))


def test_hf_decode_step_times_only_the_decode_steps_of_each_run(monkeypatch):
    """A step is timed inside one run, from its first token to its last: a stall outside the decode steps (here
    before every other call, as load on the machine comes and goes) never enters it. It used to be the
    difference of two separately timed runs (output_len tokens, 1 token), negative when the short ones stalled."""
    monkeypatch.setitem(config_module.PRESETS, "tiny-v2-lite", TINY_V2_LITE)
    model = bench.build_hf_model(preset_config("tiny-v2-lite").with_layers(2), torch.float32, torch.device("cpu"), 0)
    real_generate, stall_s, calls = model.generate, 0.5, []

    def stalling_generate(*args, **kwargs):
        calls.append(kwargs["max_new_tokens"])
        if len(calls) % 2:
            time.sleep(stall_s)
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", stalling_generate)
    output_len = 4
    result = bench.hf_decode_step(model, 2, 8, output_len, compile_model=False, fullgraph=False, warmup=1, reps=4,
                                  seed=0)
    # 3 decode steps of this tiny model take milliseconds: a stall counted in would be 0.5 s.
    assert 0 < result["step_s"] * (output_len - 1) < stall_s
    assert calls == [output_len] * 5 and result["generate_s"] > 0


def test_whole_script_on_the_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(config_module.PRESETS, "tiny-v2-lite", TINY_V2_LITE)
    out = tmp_path / "decode_vs_hf.json"
    bench.main(["--model-preset", "tiny-v2-lite", "--load-format", "dummy", "--num-layers", "2", "--batch-size", "1",
                "2", "--input-len", "8", "--output-len", "3", "--hf-no-compile", "--hf-warmup", "1", "--hf-reps", "2",
                "--result-filename", str(out)])
    printed = capsys.readouterr().out
    assert "Decode step: plugserve vs transformers" in printed and "Decode.  median latency:" in printed
    report = json.loads(out.read_text())
    assert report["device"] and report["args"]["model_preset"] == "tiny-v2-lite"
    assert {"torch", "transformers"} <= set(report["versions"]) and report["ceilings"]["read_gbps"] > 0
    assert {(b["kind"], b["phase"]) for b in report["plugserve"]["backends"]} >= {("attention", "decode"),
                                                                                 ("moe", "decode")}
    assert report["hf_mode"] == "eager" and report["config"]["num_hidden_layers"] == 2
    assert [(r["batch_size"], r["input_len"], r["output_len"]) for r in report["rows"]] == [(1, 8, 3), (2, 8, 3)]
    for row in report["rows"]:
        for key in ("plugserve_ms", "hf_ms", "limit_ms", "fraction_of_limit", "speedup_over_hf"):
            assert row[key] > 0, key
        assert row["bytes"]["experts"] > 0 and row["plugserve"]["median_decode_latency"] > 0


def test_block_fp8_runs_plugserve_against_the_limit_alone(tmp_path, capsys):
    argv = ["--model-preset", "tiny", "--quantization", "fp8", "--num-layers", "2", "--batch-size", "2",
            "--input-len", "8", "--output-len", "3"]
    with pytest.raises(SystemExit):
        bench.main(argv)  # transformers has no block-FP8 model: --skip-hf is required
    out = tmp_path / "fp8.json"
    bench.main([*argv, "--skip-hf", "--result-filename", str(out)])
    [row] = json.loads(out.read_text())["rows"]
    assert row["plugserve_ms"] > 0 and row["limit_ms"] > 0 and row["hf_ms"] is None
    assert "-" in capsys.readouterr().out.splitlines()[-2]  # no transformers column
