"""The accuracy harness on the CPU: a small block-FP8 checkpoint with a NextN layer, the reference against what
`auto` picks here, and the Triton backends interpreted on a short slice."""

from __future__ import annotations

import json

import pytest

from benchmarks import accuracy
from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR
from training.export import export
from training.model import TrainingModel, model_config

SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """DeepSeek-V3's format at a tiny size (random weights), with the embedded tokenizer's vocabulary."""
    directory = tmp_path_factory.mktemp("checkpoint")
    export(TrainingModel(model_config(4096, seq_len=64, **SMALL)).eval(), EMBEDDED_MODEL_DIR, directory)
    return directory


def test_combinations_parse_into_server_flags():
    assert accuracy.parse_combination("reference", "bfloat16") == accuracy.REFERENCE
    assert accuracy.parse_combination("gemm=triton", "bfloat16") == accuracy.REFERENCE | {
        "gemm": "triton", "dtype": "bfloat16"}
    with pytest.raises(ValueError, match="unknown keys"):
        accuracy.parse_combination("kernel=triton", "float32")
    combinations = accuracy.default_combinations("bfloat16")
    assert combinations[:3] == ["reference", "dtype=bfloat16", "auto"]
    assert "prefill_attention=fa3,dtype=bfloat16" in combinations and "moe=triton,dtype=bfloat16" in combinations


def test_auto_on_the_cpu_is_the_reference(checkpoint, tmp_path, capsys):
    out = tmp_path / "accuracy.json"
    accuracy.main(["--model-path", str(checkpoint), "--combos", "auto", "--max-text-tokens", "200", "--window", "64",
                   "--max-new-tokens", "4", "--log-level", "warning", "--result-filename", str(out)])
    assert "combination" in capsys.readouterr().out
    reference, auto = json.loads(out.read_text())["rows"]
    assert reference["combination"] == "reference" and auto["combination"] == "auto"
    assert reference["perplexity"] > 1 and auto["perplexity"] == pytest.approx(reference["perplexity"], rel=1e-6)
    assert auto["top1"] == auto["greedy"] == 1.0
    assert 0 <= reference["nextn"] <= 1 and "attention prefill: torch_ref" in auto["backends"]


def test_triton_backends_interpreted_agree_with_the_reference(checkpoint):
    rows = accuracy.run(accuracy.ServerArgs(model_path=str(checkpoint), device="cpu", log_level="warning"),
                        ["reference", "attention=triton,gemm=triton,moe=triton"], accuracy.DEFAULT_TEXT,
                        max_text_tokens=24, window=24, batch=1, max_new_tokens=2, num_prompts=1, dtype="float32")
    triton = rows[1]
    assert not triton.skipped and "moe decode: triton" in triton.backends
    assert abs(triton.delta) < 0.01 and triton.top1 >= 0.95 and triton.greedy == 1.0
