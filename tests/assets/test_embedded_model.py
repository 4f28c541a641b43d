"""The embedded default model (plugserve/assets/embedded_model): a trained DeepSeek-V3 in DeepSeek's published
block-FP8 format that plugserve serves with no model flag, that transformers reads, and that writes English."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors import safe_open

from benchmarks.accuracy import DEFAULT_TEXT, run, score_text_cached, text_tokens
from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR
from plugserve.runtime.engine import Engine
from plugserve.runtime.model_runner import ModelRunner
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs
from training.verify import verify

MAX_BYTES = 25 * 10**6  # the size budget for a model that lives in the package
# benchmarks/accuracy.py's float32 reference on the first 1024 tokens of its held-out text in 512-token windows, as
# measured on the CPU: 13.555 (on 2048 tokens 13.974, where a unigram model of the training split gives 856). Its
# default 16384 tokens give 24.7, the model card's figure; 1024 keep the test short.
HELD_OUT_PERPLEXITY = 13.55
CHAT = [{"role": "user", "content": "What is a list comprehension?"}]


def english_share(text: str) -> float:
    """The share of `text`'s words that occur in the held-out documentation (prose the model never saw)."""
    known = set(re.findall(r"[a-z]+", DEFAULT_TEXT.read_text(encoding="utf-8").lower()))
    words = re.findall(r"[A-Za-z]+", text)
    return sum(w.lower() in known for w in words) / max(len(words), 1)


def test_embedded_model_is_deepseek_v3_block_fp8_with_its_nextn_layer():
    files = {p.name: p for p in EMBEDDED_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
            "LICENSES.txt"} <= set(files)
    assert sum(p.stat().st_size for p in files.values()) <= MAX_BYTES
    config = json.loads(files["config.json"].read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert config["num_nextn_predict_layers"] == 1
    nextn = f"model.layers.{config['num_hidden_layers']}"
    weight_map = json.loads(files["model.safetensors.index.json"].read_text())["weight_map"]
    for name in (f"{nextn}.eh_proj.weight", "model.layers.1.mlp.experts.0.down_proj.weight"):
        with safe_open(EMBEDDED_MODEL_DIR / weight_map[name], "pt") as shard:
            assert shard.get_tensor(name).dtype == torch.float8_e4m3fn
            assert weight_map[name + "_scale_inv"]


def test_transformers_and_plugserve_generate_the_same_tokens_on_its_weights():
    report = verify(EMBEDDED_MODEL_DIR, max_new_tokens=16)
    assert report["hf_parity"] == 1.0, report["samples"]


def test_held_out_perplexity_is_the_measured_one_within_a_tenth():
    """A loader, layer or reference that costs the model (or flatters it) by more than a tenth fails."""
    (row,) = run(ServerArgs(), ["reference"], DEFAULT_TEXT, max_text_tokens=1024, window=512, batch=4,
                 max_new_tokens=4, num_prompts=1, dtype="float32")
    assert row.perplexity == pytest.approx(HELD_OUT_PERPLEXITY, rel=0.10)
    assert row.nextn >= 0.5  # the NextN head predicts the main model's next greedy choice (speculative decoding)


@pytest.mark.parametrize(("args", "english"), [(ServerArgs(), True), (ServerArgs(model_preset="tiny"), False)],
                         ids=["embedded", "random-tiny-preset"])
def test_the_default_server_answers_in_english(args: ServerArgs, english: bool):
    engine = Engine(args)
    try:
        prompt = engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
        (result,) = engine.generate([list(prompt)], SamplingParams(max_new_tokens=32, temperature=0))
    finally:
        engine.shutdown()
    assert (english_share(result.text) >= 0.9) is english, result.text


def test_licences_of_the_training_corpus_ship_with_the_weights():
    licences = (EMBEDDED_MODEL_DIR / "LICENSES.txt").read_text(encoding="utf-8")
    assert "PSF" in licences and "BSD" in licences


def test_an_fp8_kv_cache_keeps_the_perplexity_over_the_cache_within_one_percent():
    """Held-out text scored one DECODE step a token, so that every key is read back from the KV cache (a window's
    own EXTEND never reads it): an e4m3 cache (scale 1.0) against the float32 one. On 2048 tokens it measured
    +0.58 % (docs/kernels.md); on this slice it must stay within the 1 % target, and move (the cache is read)."""
    tokens = text_tokens(ServerArgs(), DEFAULT_TEXT, 512)
    perplexity = {}
    for kv in ("auto", "fp8_e4m3"):
        runner = ModelRunner(ServerArgs(dtype="float32", device="cpu", kv_cache_dtype=kv, max_total_tokens=2048,
                                        log_level="warning"))
        perplexity[kv] = math.exp(score_text_cached(runner, tokens, 64, 8).mean().item())
    delta = perplexity["fp8_e4m3"] / perplexity["auto"] - 1
    assert delta != 0 and abs(delta) < 0.01, perplexity
