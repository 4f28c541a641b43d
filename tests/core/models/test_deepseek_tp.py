"""DeepseekForCausalLM split over 2 ranks (tensor parallelism, with expert parallelism, with DP attention) against
the one-process model of the same checkpoint: what each rank loads of a block-FP8 checkpoint (in this process,
no collectives), and logits and greedy continuations on 2 spawned gloo ranks (float32, torch_ref backends)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from plugserve.core.distributed import ParallelGroup
from plugserve.core.forward_batch import AttnForwardMethod, ForwardMode
from plugserve.core.layers.parallel import LazySlice
from plugserve.core.layers.quant import FP8_DTYPE
from plugserve.core.loader import SafetensorsCheckpoint, load_checkpoint, read_config
from plugserve.core.models.deepseek import DeepseekForCausalLM, DeepseekMoE, DenseMLP, MLAAttention
from tests.checkpoints import (
    random_hf_model,
    save_hf_model,
    tiny_v2_lite_config,
    tiny_v3_config,
    write_fp8_checkpoint,
)
from tests.multiprocess import run_ranks
from tests.paged_runner import PagedRunner, Request, load_reference_model

# 16 x 16 blocks: every split of the tiny models (heads, intermediate widths) falls on a block boundary, so
# each rank keeps the checkpoint's e4m3 values and scales, and quantizes activations in the same groups.
FP8_BLOCK = (16, 16)
WORLD_SIZE = 2
DECODE_STEPS = 4
# The ranks' partial sums add up in another order than one GEMM's: float32 rounding, relative to the
# largest logit.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny V3 (q LoRA, a dense first layer then MoE with a shared expert), its block-FP8 copy, and a tiny
    V2-Lite (q_proj without LoRA, two shared experts)."""
    root = tmp_path_factory.mktemp("tp")
    v3 = save_hf_model(random_hf_model(tiny_v3_config()), root / "v3")
    return {"v3": v3, "v3_fp8": write_fp8_checkpoint(v3, root / "v3_fp8", block=FP8_BLOCK),
            "v2_lite": save_hf_model(random_hf_model(tiny_v2_lite_config()), root / "v2_lite")}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == FP8_DTYPE else torch.equal(a, b)


def _rows(t: torch.Tensor, rank: int, dim: int = 0, parts: int = WORLD_SIZE) -> torch.Tensor:
    """Part `rank` of `parts` equal parts of t along `dim`."""
    return t.chunk(parts, dim)[rank]


def _fused_rows(t: torch.Tensor, sizes: list[int], rank: int, dim: int = 0) -> torch.Tensor:
    """Of the shards of `sizes` fused along `dim` in t, each one's part `rank`, fused again."""
    return torch.cat([_rows(shard, rank, dim) for shard in t.split(sizes, dim)], dim)


def _check_attention(mine: MLAAttention, full: MLAAttention, rank: int) -> None:
    assert mine.num_heads == full.num_heads // WORLD_SIZE
    assert _same_bits(mine.fused_qkv_a_proj.weight, full.fused_qkv_a_proj.weight)  # the latent: replicated
    for name in ("q_b_proj", "kv_b_proj"):  # by heads: rank r's heads are rows r of the checkpoint tensor
        assert _same_bits(getattr(mine, name).weight, _rows(getattr(full, name).weight, rank)), name
        assert _same_bits(getattr(mine, name).weight_scale_inv, _rows(getattr(full, name).weight_scale_inv, rank))
    assert _same_bits(mine.o_proj.weight, _rows(full.o_proj.weight, rank, dim=1))
    assert _same_bits(mine.o_proj.weight_scale_inv, _rows(full.o_proj.weight_scale_inv, rank, dim=1))
    assert _same_bits(mine.w_kc, _rows(full.w_kc, rank)) and _same_bits(mine.w_vc, _rows(full.w_vc, rank))


def _check_mlp(mine: DenseMLP, full: DenseMLP, rank: int) -> None:
    gate_up, blocks = full.gate_up_proj, full.gate_up_proj.weight_scale_inv.shape[0]
    assert _same_bits(mine.gate_up_proj.weight, _fused_rows(gate_up.weight, gate_up.output_sizes, rank))
    assert _same_bits(mine.gate_up_proj.weight_scale_inv,
                      _fused_rows(gate_up.weight_scale_inv, [blocks // 2] * 2, rank))
    assert _same_bits(mine.down_proj.weight, _rows(full.down_proj.weight, rank, dim=1))
    assert _same_bits(mine.down_proj.weight_scale_inv, _rows(full.down_proj.weight_scale_inv, rank, dim=1))


def _check_moe(mine: DeepseekMoE, full: DeepseekMoE, rank: int) -> None:
    assert _same_bits(mine.gate, full.gate)
    a, b = mine._packed, full._packed  # TorchRefMoEWeights: w13 [E, 2I, H], w2 [E, H, I]
    inter, blocks = b.w2.shape[2], b.w13_scale_inv.shape[1]
    assert _same_bits(a.w13, _fused_rows(b.w13, [inter, inter], rank, dim=1))
    assert _same_bits(a.w13_scale_inv, _fused_rows(b.w13_scale_inv, [blocks // 2] * 2, rank, dim=1))
    assert _same_bits(a.w2, _rows(b.w2, rank, dim=2))
    assert _same_bits(a.w2_scale_inv, _rows(b.w2_scale_inv, rank, dim=2))
    _check_mlp(mine.shared_experts, full.shared_experts, rank)  # type: ignore[arg-type]


class RecordingCheckpoint(SafetensorsCheckpoint):
    """Counts the elements read of each tensor, whole or through lazy slices."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self.read: dict[str, int] = {}

    def _count(self, name: str, part: torch.Tensor) -> torch.Tensor:
        self.read[name] = self.read.get(name, 0) + part.numel()
        return part

    def get(self, name: str) -> torch.Tensor:
        return self._count(name, super().get(name))

    def get_slice(self, name: str) -> LazySlice:
        return _CountingSlice(super().get_slice(name), lambda part: self._count(name, part))


class _CountingSlice:
    def __init__(self, inner: LazySlice, count: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.inner, self.count = inner, count

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self.count(self.inner[index])


def test_a_rank_reads_half_of_each_split_tensor_and_the_replicated_ones_whole(checkpoints: dict[str, Path]) -> None:
    directory = checkpoints["v3_fp8"]
    config, layers = read_config(str(directory), None)
    checkpoint = RecordingCheckpoint(directory)
    load_checkpoint(DeepseekForCausalLM(config, torch.float32, "cpu", group=ParallelGroup(1, WORLD_SIZE)),
                    checkpoint, layers)
    split = re.compile(r"(q_b_proj|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$|embed_tokens|lm_head")
    for name, read in checkpoint.read.items():
        numel = math.prod(checkpoint.get_slice(name).get_shape())
        assert read == (numel // WORLD_SIZE if split.search(name) else numel), name
    assert any("experts.7.down_proj.weight" in name for name in checkpoint.read)


EXPERT = re.compile(r"\.experts\.(\d+)\.")


def test_under_expert_parallelism_a_rank_reads_its_experts_whole_and_no_other(checkpoints: dict[str, Path]) -> None:
    directory = checkpoints["v3_fp8"]
    config, layers = read_config(str(directory), None)
    checkpoint = RecordingCheckpoint(directory)
    rank, held = 1, config.n_routed_experts // WORLD_SIZE
    load_checkpoint(DeepseekForCausalLM(config, torch.float32, "cpu", group=ParallelGroup(rank, WORLD_SIZE),
                                        expert_parallel=True), checkpoint, layers)
    experts = [name for name in checkpoint.names() if EXPERT.search(name)]
    assert any(name.endswith("_scale_inv") for name in experts)
    for name in experts:
        mine = rank * held <= int(EXPERT.search(name).group(1)) < (rank + 1) * held  # type: ignore[union-attr]
        assert checkpoint.read.get(name, 0) == (math.prod(checkpoint.get_slice(name).get_shape()) if mine else 0), name


def _check_expert_parallel_moe(mine: DeepseekMoE, full: DeepseekMoE, rank: int) -> None:
    """Rank `rank`'s packed experts are its E / P experts of the one-process model, bit for bit."""
    assert _same_bits(mine.gate, full.gate)
    assert _same_bits(mine.e_score_correction_bias, full.e_score_correction_bias)  # type: ignore[arg-type]
    a, b = mine._packed, full._packed  # TorchRefMoEWeights: w13 [E, 2I, H], w2 [E, H, I]
    for name in ("w13", "w2", "w13_scale_inv", "w2_scale_inv"):
        assert _same_bits(getattr(a, name), _rows(getattr(b, name), rank)), name
    _check_mlp(mine.shared_experts, full.shared_experts, rank)  # type: ignore[arg-type]


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_each_rank_of_a_block_fp8_checkpoint_holds_its_slices_of_the_unsharded_model(
        checkpoints: dict[str, Path], expert_parallel: bool) -> None:
    """Loading runs no collective: both ranks load here, each compared with the one-process model."""
    directory = checkpoints["v3_fp8"]
    full = load_reference_model(directory)
    check_moe = _check_expert_parallel_moe if expert_parallel else _check_moe
    for rank in range(WORLD_SIZE):
        mine = load_reference_model(directory, group=ParallelGroup(rank, WORLD_SIZE), expert_parallel=expert_parallel)
        assert _same_bits(mine.embed_tokens.weight, _rows(full.embed_tokens.weight, rank))
        assert _same_bits(mine.lm_head.weight, _rows(full.lm_head.weight, rank))
        for layer, full_layer in zip(mine.layers, full.layers, strict=True):
            _check_attention(layer.self_attn, full_layer.self_attn, rank)
            if isinstance(layer.mlp, DeepseekMoE):
                check_moe(layer.mlp, full_layer.mlp, rank)  # type: ignore[arg-type]
            else:
                _check_mlp(layer.mlp, full_layer.mlp, rank)  # type: ignore[arg-type]


# (new tokens of each request, dispatch arguments, the attention method they give): a prompt, then
# extensions over the cached prefix by each method.
EXTENDS = [
    (slice(0, -9), {}, AttnForwardMethod.MHA),
    (slice(-9, -6), {}, AttnForwardMethod.MLA),
    (slice(-6, -3), {"chunked_prefix_cache_threshold": 1}, AttnForwardMethod.MHA),
    (slice(-3, None), {"chunked_prefix_cache_threshold": 1, "prefix_chunk_capacity": 8},
     AttnForwardMethod.MHA_CHUNKED_KV),
]


def _greedy_run(model: DeepseekForCausalLM, prompts: list[list[int]]) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The prompts in EXTEND batches (EXTENDS), then DECODE_STEPS greedy DECODE batches: each batch's logits
    [new tokens, vocab] float32, and each request's tokens."""
    runner = PagedRunner(model, page_size=4)
    requests = [Request() for _ in prompts]
    logits = []
    for part, dispatch, method in EXTENDS:
        new = [prompt[part] for prompt in prompts]
        logits.append(runner.step(ForwardMode.EXTEND, requests, new, **dispatch))
        assert runner.last_batch.attn_method is method
    last_rows = torch.tensor([len(n) for n in new]).cumsum(0) - 1
    for _ in range(DECODE_STEPS):
        next_tokens = logits[-1][last_rows].argmax(-1).tolist()
        logits.append(runner.step(ForwardMode.DECODE, requests, [[t] for t in next_tokens]))
        last_rows = torch.arange(len(requests))
    return logits, [r.tokens for r in requests]


def _split_models_match_one_process(group: ParallelGroup, directories: list[Path], expert_parallel: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    for directory in directories:
        single = load_reference_model(directory)
        prompts = [torch.randint(0, single.config.vocab_size, (n,), generator=generator).tolist() for n in (21, 12)]
        expected, expected_tokens = _greedy_run(single, prompts)
        split = load_reference_model(directory, group=group, expert_parallel=expert_parallel)
        assert split.layers[0].self_attn.num_heads == single.layers[0].self_attn.num_heads // WORLD_SIZE
        logits, tokens = _greedy_run(split, prompts)
        assert tokens == expected_tokens, directory.name
        for got, want in zip(logits, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE * want.abs().max().item())


def test_tp2_logits_and_greedy_tokens_match_one_process(checkpoints: dict[str, Path]) -> None:
    run_ranks(_split_models_match_one_process, [checkpoints[name] for name in ("v3", "v2_lite", "v3_fp8")], False)


def test_tp2_ep2_logits_and_greedy_tokens_match_one_process(checkpoints: dict[str, Path]) -> None:
    """Each rank runs its 4 of the 8 experts for every token; the MoE all-reduce sums them."""
    run_ranks(_split_models_match_one_process, [checkpoints[name] for name in ("v3_fp8", "v2_lite")], True)


def test_under_dp_attention_each_rank_holds_the_whole_attention_and_embedding(checkpoints: dict[str, Path]) -> None:
    directory = checkpoints["v3_fp8"]
    full = load_reference_model(directory)
    rank = 1
    mine = load_reference_model(directory, group=ParallelGroup(rank, WORLD_SIZE), dp_size=WORLD_SIZE)
    assert _same_bits(mine.embed_tokens.weight, full.embed_tokens.weight)
    assert _same_bits(mine.lm_head.weight, _rows(full.lm_head.weight, rank))
    for layer, full_layer in zip(mine.layers, full.layers, strict=True):
        assert layer.self_attn.num_heads == full_layer.self_attn.num_heads
        for name, tensor in full_layer.self_attn.state_dict().items():
            assert _same_bits(layer.self_attn.state_dict()[name], tensor), name
        if isinstance(layer.mlp, DeepseekMoE):
            _check_moe(layer.mlp, full_layer.mlp, rank)  # type: ignore[arg-type]
        else:
            _check_mlp(layer.mlp, full_layer.mlp, rank)  # type: ignore[arg-type]


# DP attention's steps: (mode, the requests in it, the slice of each prompt an EXTEND computes). Requests 0 and 1
# are DP group 0's, request 2 group 1's: a prompt over the two groups' different token counts, an extension over the
# cached prefix (absorbed MLA), decodes, then a step where group 1 idles and one where group 0 does.
DP_OWNER = [0, 0, 1]
DP_STEPS = [
    (ForwardMode.EXTEND, [0, 1, 2], slice(0, -4)),
    (ForwardMode.EXTEND, [0, 1, 2], slice(-4, None)),
    *[(ForwardMode.DECODE, [0, 1, 2], None)] * 2,
    (ForwardMode.DECODE, [0, 1], None),
    (ForwardMode.DECODE, [2], None),
]


def _dp_attention_matches_one_process(group: ParallelGroup, runs: list[tuple[Path, bool]], dp_size: int) -> None:
    generator = torch.Generator().manual_seed(2)
    dp_rank = group.rank // (group.world_size // dp_size)
    for directory, expert_parallel in runs:
        single = PagedRunner(load_reference_model(directory), page_size=4)
        split = PagedRunner(load_reference_model(directory, group=group, expert_parallel=expert_parallel,
                                                 dp_size=dp_size), page_size=4)
        heads = single.model.config.num_attention_heads
        assert split.model.layers[0].self_attn.num_heads == heads * dp_size // group.world_size
        prompts = [torch.randint(0, single.model.config.vocab_size, (n,), generator=generator).tolist()
                   for n in (21, 12, 17)]
        single_requests, split_requests = [Request() for _ in prompts], [Request() for _ in prompts]
        last: dict[int, int] = {}  # each request's greedy next token
        for mode, active, part in DP_STEPS:
            new = {i: prompts[i][part] if mode is ForwardMode.EXTEND else [last[i]] for i in active}
            want = single.step(mode, [single_requests[i] for i in active], [new[i] for i in active])
            mine = [i for i in active if DP_OWNER[i] == dp_rank]
            counts = [sum(len(new[i]) for i in active if DP_OWNER[i] == g) for g in range(dp_size)]
            got = split.step(mode if mine else ForwardMode.IDLE, [split_requests[i] for i in mine],
                             [new[i] for i in mine], dp_tokens=counts)
            torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE * want.abs().max().item())
            ends = torch.tensor([len(new[i]) for i in active]).cumsum(0) - 1
            assert got[ends].argmax(-1).tolist() == want[ends].argmax(-1).tolist(), directory.name
            last.update(zip(active, want[ends].argmax(-1).tolist(), strict=True))


def test_dp2_logits_and_greedy_tokens_match_one_process(checkpoints: dict[str, Path]) -> None:
    """Each rank attends over its own requests only (rank 1 idles in one step, rank 0 in another); the MLPs and
    the LM head see both ranks' tokens: the logits are the one-process model's over all requests. The MLPs split
    by width (V3), and by expert (V2-Lite, without q LoRA)."""
    run_ranks(_dp_attention_matches_one_process, [(checkpoints["v3"], False), (checkpoints["v2_lite"], True)],
              WORLD_SIZE)


def test_dp2_groups_of_two_ranks_match_one_process(checkpoints: dict[str, Path]) -> None:
    """4 ranks, 2 DP groups of 2: each group's heads split over its ranks (o_proj summed over the group), each
    group's rows gathered once before the MLPs; the logits are the one-process model's. The MLPs split by width
    over the 4 ranks (V3), and by expert (V2-Lite)."""
    run_ranks(_dp_attention_matches_one_process, [(checkpoints["v3"], False), (checkpoints["v2_lite"], True)], 2,
              world_size=4)
