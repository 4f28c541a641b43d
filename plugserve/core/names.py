"""The names a launch may give, without torch (so that `plugserve --help` and the pytest plugin stay light):
backend kinds, load formats, and the published model shapes behind `--model-preset`."""

from __future__ import annotations

from typing import Any, Literal

Kind = Literal["attention", "gemm", "moe", "comm"]
KINDS: tuple[Kind, ...] = ("attention", "gemm", "moe", "comm")

LOAD_FORMATS = ("auto", "safetensors", "dummy")

# Published shapes, for `--load-format dummy` (random weights) without a checkpoint.
PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
        num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid",
        max_position_embeddings=163840, rope_theta=10000.0, num_nextn_predict_layers=1,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                          mscale=1.0, mscale_all_dim=1.0),
        quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                 weight_block_size=[128, 128]),
        bos_token_id=0, eos_token_id=1,
    ),
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, n_shared_experts=2,
        n_routed_experts=64, routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=6,
        first_k_dense_replace=1, norm_topk_prob=False, scoring_func="softmax", max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                          mscale=0.707, mscale_all_dim=0.707),
        bos_token_id=100000, eos_token_id=100001,
    ),
    # DeepSeek-V3's structure at a size the CPU runs interactively, random weights; its vocabulary and special-token
    # ids are the embedded model's, whose tokenizer it uses.
    "tiny": dict(
        model_type="deepseek_v3", vocab_size=4096, hidden_size=256, intermediate_size=512,
        moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=8, n_shared_experts=1,
        n_routed_experts=16, routed_scaling_factor=2.5, kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32,
        v_head_dim=64, qk_nope_head_dim=64, topk_method="noaux_tc", n_group=4, topk_group=2, num_experts_per_tok=4,
        first_k_dense_replace=1, norm_topk_prob=True, scoring_func="sigmoid", max_position_embeddings=8192,
        rope_theta=10000.0, num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1,
    ),
}
