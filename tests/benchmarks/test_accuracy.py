"""The accuracy harness on the CPU: a small block-FP8 checkpoint with a NextN layer, the reference and `auto` against
transformers' perplexity, and the Triton backends interpreted on a short slice against the reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks import accuracy
from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR
from training.export import export
from training.model import TrainingModel, model_config
from training.verify import dequantized_copy

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


def transformers_nll(model_dir: Path, tokens: list[int], window: int) -> torch.Tensor:
    """The oracle: transformers' DeepseekV3ForCausalLM in float32 on the harness's windows of `tokens` (each from
    position 0) -> nll [len(tokens) - 1] float64 of each next token."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll = []
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, window):
            chunk = torch.tensor(tokens[start : start + window + 1])
            logits = model(chunk[None, :-1]).logits[0].double()
            nll.append(-logits.log_softmax(-1).gather(1, chunk[1:, None]).squeeze(1))
    return torch.cat(nll)


def test_the_reference_and_auto_score_the_text_as_transformers_does(checkpoint, tmp_path, capsys):
    """Every other row is measured against the reference row, so the reference (and `auto`, the reference's
    backends on the CPU) is checked against an independent oracle: transformers on the same windows of the same
    text, on the checkpoint's weights dequantized (so that both sides do the same float32 math)."""
    dequantized = dequantized_copy(checkpoint, tmp_path / "dequantized")
    out = tmp_path / "accuracy.json"
    accuracy.main(["--model-path", str(dequantized), "--combos", "auto", "--max-text-tokens", "200", "--window", "64",
                   "--max-new-tokens", "4", "--log-level", "warning", "--result-filename", str(out)])
    assert "combination" in capsys.readouterr().out
    reference, auto = json.loads(out.read_text())["rows"]
    assert reference["combination"] == "reference" and auto["combination"] == "auto"
    tokens = accuracy.text_tokens(accuracy.ServerArgs(model_path=str(dequantized)), accuracy.DEFAULT_TEXT, 200)
    expected = math.exp(transformers_nll(dequantized, tokens, 64).mean().item())
    assert reference["perplexity"] == pytest.approx(expected, rel=1e-5)
    assert auto["perplexity"] == pytest.approx(expected, rel=1e-5)
    assert 0 <= reference["nextn"] <= 1 and "attention prefill: torch_ref" in auto["backends"]


def test_triton_backends_interpreted_agree_with_the_reference(checkpoint):
    # Without the engine's warm-up: it would run every prefill and decode size through the interpreter first.
    args = accuracy.ServerArgs(model_path=str(checkpoint), device="cpu", log_level="warning", skip_server_warmup=True)
    rows = accuracy.run(args, ["reference", "attention=triton,gemm=triton,moe=triton"], accuracy.DEFAULT_TEXT,
                        max_text_tokens=24, window=24, batch=1, max_new_tokens=2, num_prompts=1, dtype="float32")
    triton = rows[1]
    assert not triton.skipped and "moe decode: triton" in triton.backends
    assert abs(triton.delta) < 0.01 and triton.top1 >= 0.95 and triton.greedy == 1.0
