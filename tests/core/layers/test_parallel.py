"""Tensor-parallel layers against the one-process Linear / embedding on the same full weights: what each
rank holds (loaded rank by rank in this process), and the layers' outputs with their collectives on 2
spawned gloo ranks, in float32, bfloat16 and block-FP8 (through the torch_ref GEMM)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from plugserve.core.distributed import SINGLE, ParallelGroup
from plugserve.core.layers.linear import Linear, WeightLoadError
from plugserve.core.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from plugserve.core.layers.quant import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8
from plugserve.core.specs import GemmSpec
from plugserve.plugins.gemm.torch_ref import TorchRefFp8Gemm
from tests.multiprocess import run_ranks

CPU = torch.device("cpu")
BLOCK = (128, 128)
# (model dtype, whether the checkpoint is block-FP8): FP8 runs in a float32 model so that only the
# e4m3 weights, not the output dtype, separate it from float.
CASES = {"float32": (torch.float32, False), "bfloat16": (torch.bfloat16, False), "fp8": (torch.float32, True)}
# A sum over ranks of partial products rounds differently from one matmul: a few roundings of the dtype,
# relative to the output's largest value (elements near zero come out of cancellation).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)  # inputs the same in every run, whatever ran before


def fake_ranks(world_size: int = 2) -> list[ParallelGroup]:
    """Every rank of a world, for loading in this process (no collectives run on them)."""
    return [ParallelGroup(rank, world_size) for rank in range(world_size)]


def checkpoint_tensor(rows: int, cols: int, dtype: torch.dtype, fp8: bool,
                      seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A weight [rows, cols] as a checkpoint stores it: e4m3 with its block scales, or in `dtype`. Rows
    and columns grow in magnitude, so that every block has its own scale and a block sliced wrongly shows."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.linspace(0.02, 0.2, rows)[:, None] * torch.linspace(1, 4, cols)
    return quantize_block_fp8(w, BLOCK) if fp8 else (w.to(dtype), None)


def gemm_for(dtype: torch.dtype, fp8: bool) -> TorchRefFp8Gemm | None:
    return TorchRefFp8Gemm(GemmSpec(dtype, BLOCK), CPU) if fp8 else None


def reference(in_features: int, shards: list[tuple[torch.Tensor, torch.Tensor | None]], dtype: torch.dtype,
              fp8: bool) -> Linear:
    """The one-process Linear of the full shards."""
    layer = Linear(in_features, [w.shape[0] for w, _ in shards], dtype, CPU, BLOCK if fp8 else None)
    for i, (w, s) in enumerate(shards):
        layer.load_shard(i, f"shard{i}", w, s)
    layer.finalize(gemm_for(dtype, fp8))
    return layer


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tolerance = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == FP8_DTYPE else torch.equal(a, b)


@pytest.mark.parametrize("case", CASES)
def test_column_parallel_rank_holds_its_rows_of_each_fused_shard(case: str) -> None:
    dtype, fp8 = CASES[case]
    gate, up = checkpoint_tensor(256, 256, dtype, fp8, 0), checkpoint_tensor(256, 256, dtype, fp8, 1)
    full = reference(256, [gate, up], dtype, fp8)
    x = torch.randn(5, 256).to(dtype)
    expected_gate, expected_up = full(x).split([256, 256], dim=-1)
    for group in fake_ranks():
        layer = ColumnParallelLinear(256, [256, 256], dtype, CPU, BLOCK if fp8 else None, group=group,
                                     name="mlp.gate_up_proj")
        layer.load_shard(0, "gate_proj", *gate)
        layer.load_shard(1, "up_proj", *up)
        layer.finalize(gemm_for(dtype, fp8))
        mine = slice(128 * group.rank, 128 * (group.rank + 1))
        assert layer.output_sizes == [128, 128] and layer.weight.shape == (256, 256)
        assert same_bits(layer.weight.data, torch.cat([gate[0][mine], up[0][mine]]))  # gate_r ++ up_r
        if fp8:
            assert torch.equal(layer.weight_scale_inv.data, torch.cat([gate[1][group.rank : group.rank + 1],
                                                                       up[1][group.rank : group.rank + 1]]))
        assert_close(layer(x), torch.cat([expected_gate[:, mine], expected_up[:, mine]], dim=-1))


@pytest.mark.parametrize("case", CASES)
def test_row_parallel_rank_holds_its_columns_and_partial_sums_add_up(case: str) -> None:
    dtype, fp8 = CASES[case]
    down = checkpoint_tensor(256, 512, dtype, fp8, 2)
    x = torch.randn(5, 512).to(dtype)
    partials = []
    for group in fake_ranks():
        layer = RowParallelLinear(512, [256], dtype, CPU, BLOCK if fp8 else None, group=group,
                                  name="mlp.down_proj", reduce_output=False)
        layer.load_shard(0, "down_proj", *down)
        layer.finalize(gemm_for(dtype, fp8))
        mine = slice(256 * group.rank, 256 * (group.rank + 1))
        assert layer.in_features == 256 and same_bits(layer.weight.data, down[0][:, mine])
        if fp8:
            assert torch.equal(layer.weight_scale_inv.data, down[1][:, 2 * group.rank : 2 * group.rank + 2])
        partials.append(layer(x[:, mine]))
    assert_close(partials[0] + partials[1], reference(512, [down], dtype, fp8)(x))


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_fp8_slice_inside_a_block_is_requantized(parallel: str) -> None:
    """384 over 2 ranks: rank 0 starts on a block and keeps the checkpoint's bytes; rank 1 starts at 192,
    mid-block, and is requantized in its own blocks: within e4m3's rounding (half of 2^-3 relative) of
    the checkpoint's values, and its outputs within that of the reference."""
    w, s = checkpoint_tensor(384, 384, torch.float32, True, 3)
    exact = dequantize_block_fp8(w, s, BLOCK)
    x = torch.randn(4, 384)
    for group in fake_ranks():
        mine = slice(192 * group.rank, 192 * (group.rank + 1))
        if parallel == "column":
            layer: Linear = ColumnParallelLinear(384, [384], torch.float32, CPU, BLOCK, group=group, name="q_b_proj")
            wanted, local_x = exact[mine], x
        else:
            layer = RowParallelLinear(384, [384], torch.float32, CPU, BLOCK, group=group, name="o_proj",
                                      reduce_output=False)
            wanted, local_x = exact[:, mine], x[:, mine]
        layer.load_shard(0, "w", w, s)
        layer.finalize(gemm_for(torch.float32, True))
        held = layer.dequantized_weight()
        if group.rank == 0:
            assert same_bits(layer.weight.data, w[mine] if parallel == "column" else w[:, mine])
        assert (held - wanted).abs().max() <= wanted.abs().max() / 16
        out, expected = layer(local_x), local_x @ wanted.T
        assert (out - expected).abs().max() <= 0.1 * expected.abs().max()


def test_a_size_that_does_not_split_is_refused_naming_the_layer() -> None:
    group = ParallelGroup(0, 3)
    with pytest.raises(ValueError, match=r"layers.0.mlp.gate_up_proj: output size 256 does not split over 3 ranks"):
        ColumnParallelLinear(64, [255, 256], torch.float32, CPU, group=group, name="layers.0.mlp.gate_up_proj")
    with pytest.raises(ValueError, match=r"layers.0.mlp.down_proj: input size 100 does not split over 3 ranks"):
        RowParallelLinear(100, [64], torch.float32, CPU, group=group, name="layers.0.mlp.down_proj")


def test_a_checkpoint_tensor_of_the_wrong_full_shape_is_refused() -> None:
    layer = ColumnParallelLinear(64, [128], torch.float32, CPU, group=ParallelGroup(1, 2), name="q_b_proj")
    with pytest.raises(WeightLoadError, match=r"q_b_proj.weight: shape \(64, 64\) does not match the model's "
                                              r"\(128, 64\)"):
        layer.load_shard(0, "q_b_proj.weight", torch.zeros(64, 64))


class RecordingSlice:
    """A safetensors lazy slice that records what was read."""

    def __init__(self, inner: object) -> None:
        self.inner, self.reads = inner, []

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()  # type: ignore[attr-defined]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        self.reads.append(index)
        return self.inner[index]  # type: ignore[index]


def test_a_rank_reads_only_its_rows_from_a_lazy_safetensors_slice(tmp_path: Path) -> None:
    w, s = checkpoint_tensor(512, 256, torch.float32, True, 4)
    save_file({"kv_b_proj.weight": w}, tmp_path / "model.safetensors")
    layer = ColumnParallelLinear(256, [512], torch.float32, CPU, BLOCK, group=ParallelGroup(1, 2), name="kv_b_proj")
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        lazy = RecordingSlice(f.get_slice("kv_b_proj.weight"))
        layer.load_shard(0, "kv_b_proj.weight", lazy, s)
    assert lazy.reads == [(slice(256, 512),)]
    assert same_bits(layer.weight.data, w[256:]) and torch.equal(layer.weight_scale_inv.data, s[2:])


def test_vocab_shards_pad_the_last_rank() -> None:
    table = torch.randn(10, 8)
    for group in fake_ranks(4):  # 3 rows a rank: rank 3 holds token 9 and two rows of padding
        embedding = VocabParallelEmbedding(10, 8, torch.float32, CPU, group=group, name="embed_tokens")
        embedding.load("model.embed_tokens.weight", table)
        assert embedding.weight.shape == (3, 8)
        assert torch.equal(embedding.weight.data[: embedding.num_local], table[3 * group.rank : 3 * group.rank + 3])
    assert embedding.num_local == 1 and not embedding.weight.data[1:].any()
    with pytest.raises(WeightLoadError, match="expected an unquantized tensor"):
        embedding.load("model.embed_tokens.weight", table.to(FP8_DTYPE))


def test_vocab_layers_at_world_size_one_are_the_plain_ones() -> None:
    table, ids, hidden = torch.randn(10, 8), torch.tensor([0, 9, 3]), torch.randn(3, 8)
    embedding = VocabParallelEmbedding(10, 8, torch.float32, CPU, group=SINGLE, name="embed_tokens")
    head = ParallelLMHead(10, 8, torch.float32, CPU, group=SINGLE, name="lm_head")
    embedding.load("e", table)
    head.load("h", table)
    assert torch.equal(embedding(ids), F.embedding(ids, table))
    assert torch.equal(head(hidden), F.linear(hidden, table).float())


def _layers_on_two_ranks(group: ParallelGroup) -> None:
    """An MLP (column-parallel gate ++ up, row-parallel down, all-reduced), the embedding and the LM head
    (vocabulary 37: the last rank padded) per case, against the one-process layers."""
    torch.manual_seed(0)  # the same inputs on both ranks
    for dtype, fp8 in CASES.values():
        block = BLOCK if fp8 else None
        gate, up = checkpoint_tensor(256, 256, dtype, fp8, 0), checkpoint_tensor(256, 256, dtype, fp8, 1)
        down = checkpoint_tensor(256, 256, dtype, fp8, 2)
        gate_up = ColumnParallelLinear(256, [256, 256], dtype, CPU, block, group=group, name="gate_up_proj")
        down_proj = RowParallelLinear(256, [256], dtype, CPU, block, group=group, name="down_proj")
        gate_up.load_shard(0, "gate_proj", *gate)
        gate_up.load_shard(1, "up_proj", *up)
        down_proj.load_shard(0, "down_proj", *down)
        for layer in (gate_up, down_proj):
            layer.finalize(gemm_for(dtype, fp8))
        full_gate_up, full_down = reference(256, [gate, up], dtype, fp8), reference(256, [down], dtype, fp8)

        def mlp(x: torch.Tensor, gate_up: Linear, down: Linear) -> torch.Tensor:
            g, u = gate_up(x).chunk(2, dim=-1)
            return down(F.silu(g) * u)

        x = torch.randn(6, 256).to(dtype)
        assert_close(mlp(x, gate_up, down_proj), mlp(x, full_gate_up, full_down))

        table, ids, hidden = torch.randn(37, 256).to(dtype), torch.randint(0, 37, (9,)), torch.randn(9, 256).to(dtype)
        embedding = VocabParallelEmbedding(37, 256, dtype, CPU, group=group, name="embed_tokens")
        head = ParallelLMHead(37, 256, dtype, CPU, group=group, name="lm_head")
        embedding.load("model.embed_tokens.weight", table)
        head.load("lm_head.weight", table)
        assert embedding.weight.shape == head.weight.shape == (19, 256)
        assert torch.equal(embedding(ids), F.embedding(ids, table))
        logits = head(hidden)
        assert logits.shape == (9, 37) and logits.dtype == torch.float32
        assert_close(logits.to(dtype), F.linear(hidden, table))  # float32 from the model dtype: exact


def test_parallel_layers_on_two_gloo_ranks_match_one_process() -> None:
    run_ranks(_layers_on_two_ranks)
