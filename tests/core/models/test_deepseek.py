"""plugserve's DeepSeek-V2/V3 against transformers' own modules, token for token (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from plugserve.core.forward_batch import AttnForwardMethod, ForwardMode
from plugserve.core.models.deepseek import DeepseekMoE
from plugserve.plugins.moe.torch_ref import TorchRefMoE
from tests.checkpoints import (
    random_hf_model,
    save_hf_model,
    tiny_v2_lite_config,
    tiny_v3_config,
    write_dequantized_checkpoint,
    write_fp8_checkpoint,
)
from tests.paged_runner import PagedRunner, Request, load_reference_model

# float32 end to end: differences are summation order only.
MAX_ABS_DIFF = 1e-4
MIN_COSINE = 0.99999
# Block-FP8 weights and activations against the weights they were quantized from.
FP8_MIN_COSINE = 0.99
DECODE_STEPS = 32
CONFIGS = {"v3": tiny_v3_config, "v2_lite": tiny_v2_lite_config}


def assert_logits_match(ours: torch.Tensor, theirs: torch.Tensor, min_cosine: float = MIN_COSINE,
                        max_abs: float | None = MAX_ABS_DIFF) -> None:
    cosine = torch.nn.functional.cosine_similarity(ours.flatten().double(), theirs.flatten().double(), dim=0).item()
    diff = (ours - theirs).abs().max().item()
    assert cosine >= min_cosine, f"cosine {cosine:.7f} < {min_cosine} (max abs diff {diff:.2e})"
    if max_abs is not None:
        assert diff <= max_abs, f"max abs diff {diff:.2e} > {max_abs} (cosine {cosine:.7f})"


@pytest.fixture(scope="module", params=list(CONFIGS))
def models(request, tmp_path_factory):
    """(transformers model, plugserve model) with the same random weights, via save_pretrained."""
    hf = random_hf_model(CONFIGS[request.param]())
    directory = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_reference_model(directory), directory


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def test_prefill_logits_match_transformers(models):
    hf, ours, _ = models
    prompts = _prompts(hf.config.vocab_size, [13, 29, 1])
    runner = PagedRunner(ours)
    logits = runner.step(ForwardMode.EXTEND, [Request() for _ in prompts], prompts)
    assert runner.last_batch.attn_method is AttnForwardMethod.MHA
    for prompt, ours_logits in zip(prompts, logits.split([len(p) for p in prompts]), strict=True):
        assert_logits_match(ours_logits, _hf_logits(hf, prompt))


def test_decode_through_the_paged_cache_matches_transformers_token_by_token(models):
    hf, ours, _ = models
    prompts = _prompts(hf.config.vocab_size, [7, 12])
    runner = PagedRunner(ours, page_size=4)
    requests = [Request() for _ in prompts]
    last = runner.step(ForwardMode.EXTEND, requests, prompts)
    next_tokens = [int(row.argmax()) for row in last[[len(prompts[0]) - 1, -1]]]
    for _ in range(DECODE_STEPS):
        logits = runner.step(ForwardMode.DECODE, requests, [[t] for t in next_tokens])
        assert runner.last_batch.attn_method is AttnForwardMethod.MLA
        for request, ours_row in zip(requests, logits, strict=True):
            assert_logits_match(ours_row, _hf_logits(hf, request.tokens)[-1])
        next_tokens = [int(row.argmax()) for row in logits]
    for request, prompt in zip(requests, prompts, strict=True):
        with torch.no_grad():
            generated = hf.generate(torch.tensor([prompt]), max_new_tokens=DECODE_STEPS, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0].tolist()
        assert request.tokens == generated[: len(request.tokens)], "greedy continuations differ"


@pytest.mark.parametrize(
    ("dispatch", "method"),
    [
        ({"chunked_prefix_cache_threshold": 1}, AttnForwardMethod.MHA),  # one shot over de-compressed prefix
        ({"chunked_prefix_cache_threshold": 1, "prefix_chunk_capacity": 8}, AttnForwardMethod.MHA_CHUNKED_KV),
        ({}, AttnForwardMethod.MLA),  # short prefix: absorbed
    ],
    ids=["mha", "mha_chunked_kv", "mla"],
)
def test_prefix_plus_extend_gives_the_same_logits_by_every_method(models, dispatch, method):
    hf, ours, _ = models
    long_prompt, fresh_prompt = _prompts(hf.config.vocab_size, [40, 6], seed=2)
    runner = PagedRunner(ours, page_size=4)
    cached, fresh = Request(), Request()
    runner.step(ForwardMode.EXTEND, [cached], [long_prompt[:30]])
    logits = runner.step(ForwardMode.EXTEND, [cached, fresh], [long_prompt[30:], fresh_prompt], **dispatch)
    assert runner.last_batch.attn_method is method
    if method is AttnForwardMethod.MHA_CHUNKED_KV:
        assert len(runner.last_batch.prefix_chunks) >= 3  # 30 cached tokens in chunks of <= 8
    assert_logits_match(logits[:10], _hf_logits(hf, long_prompt)[30:])
    assert_logits_match(logits[10:], _hf_logits(hf, fresh_prompt))


def test_block_fp8_checkpoint_matches_dequantized_weights_and_stays_close_to_bf16(tmp_path):
    # Sizes on 128-row block boundaries where DeepSeek fuses two checkpoint tensors into one GEMM.
    config = tiny_v3_config(q_lora_rank=128, intermediate_size=128, moe_intermediate_size=128)
    # transformers' own init scale (initializer_range 0.02): larger random weights make a chaotic network
    # whose routing flips on any rounding, which says nothing about the quantization.
    hf = random_hf_model(config, std=0.02)
    bf16_dir = save_hf_model(hf, tmp_path / "bf16")
    fp8_dir = write_fp8_checkpoint(bf16_dir, tmp_path / "fp8")
    fp8_model = load_reference_model(fp8_dir)
    assert fp8_model.layers[0].self_attn.fused_qkv_a_proj.weight.dtype == torch.float8_e4m3fn

    # The reference: transformers loading the FP8 checkpoint's weights dequantized.
    from transformers import AutoModelForCausalLM

    dequantized = AutoModelForCausalLM.from_pretrained(write_dequantized_checkpoint(fp8_dir, tmp_path / "deq")).eval()
    prompt = _prompts(config.vocab_size, [24])[0]
    runner = PagedRunner(fp8_model)
    fp8_logits = runner.step(ForwardMode.EXTEND, [Request()], [prompt])
    assert_logits_match(fp8_logits, _hf_logits(dequantized, prompt), min_cosine=0.999, max_abs=None)
    assert_logits_match(fp8_logits, _hf_logits(hf, prompt), min_cosine=FP8_MIN_COSINE, max_abs=None)



def test_padding_rows_reach_no_routed_expert_and_the_real_rows_keep_their_output(models):
    """DP attention's gathered padding rows (`ForwardBatch.dp_real_rows` False) go to the MoE backend with expert -1,
    which no rank holds, so no expert's weights are read for them; the real rows' output is unchanged."""
    _, model, _ = models
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, DeepseekMoE))
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(
        model.embed_tokens.weight.dtype)
    real = torch.tensor([True, False, True, True, False])
    seen = []
    forward = TorchRefMoE.forward  # the reference model's MoE backend

    def spying(self, x, packed, topk_ids, topk_weights, scaling):
        seen.append(topk_ids.clone())
        return forward(self, x, packed, topk_ids, topk_weights, scaling)

    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(TorchRefMoE, "forward", spying)
        whole, masked = moe(x), moe(x, real)
    assert (seen[1][~real] == -1).all() and torch.equal(seen[1][real], seen[0][real])
    torch.testing.assert_close(masked[real], whole[real])  # the same up to summation order (rows per expert)
