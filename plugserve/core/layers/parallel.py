"""Tensor-parallel layers: each rank of a `ParallelGroup` holds a slice of a layer and reads only that
slice of the checkpoint tensor (`load_shard` takes the full tensor or a lazy safetensors slice).

- `ColumnParallelLinear`: the output dim split; rank r holds rows r of every fused shard (gate_r ++ up_r).
- `RowParallelLinear`: the input dim split; the ranks' partial outputs are summed (all-reduce).
- `VocabParallelEmbedding` / `ParallelLMHead`: the vocabulary split; lookups all-reduced, logits gathered.

Block-FP8 slices: one that starts on a (bn, bk) block boundary keeps the checkpoint's e4m3 values and scales
(DeepSeek-V3's splits at TP 2..16 do); one that starts inside a block is dequantized to float32 and quantized
again in its own blocks, as `Linear` does with fused shards that share blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from plugserve.core.distributed import ParallelGroup
from plugserve.core.layers.linear import Linear, WeightLoadError
from plugserve.core.layers.quant import FP8_DTYPE, ceil_div, dequantize_block_fp8, scale_grid


class LazySlice(Protocol):
    """A checkpoint tensor not yet read, as safetensors' `get_slice` returns it: indexing reads that part."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...


TensorSource = torch.Tensor | LazySlice


def _shape(source: TensorSource) -> tuple[int, ...]:
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def _check_shape(name: str, source: TensorSource, expected: tuple[int, ...]) -> None:
    if _shape(source) != expected:
        raise WeightLoadError(f"{name}: shape {_shape(source)} does not match the model's {expected}")


def _local_size(layer: str, what: str, size: int, group: ParallelGroup) -> int:
    if size % group.world_size:
        raise ValueError(f"{layer}: {what} {size} does not split over {group.world_size} ranks "
                         f"({size} is not a multiple of {group.world_size})")
    return size // group.world_size


def _span(dim: int, start: int, end: int) -> tuple[slice, ...]:
    """Index of [start, end) along dim 0 or 1 of a 2-D tensor."""
    return (slice(start, end),) if dim == 0 else (slice(None), slice(start, end))


def _read_slice(name: str, source: TensorSource, scale_inv: torch.Tensor | None, dim: int, start: int, size: int,
                fp8_block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[start, start + size) along `dim` of checkpoint tensor `name` [N, K], with the matching rows or
    columns of its scales [ceil(N/bn), ceil(K/bk)] when it is block-FP8; or, for a block-FP8 slice that
    starts inside a block, the slice dequantized to float32 and no scales (see the module docstring)."""
    if scale_inv is None or fp8_block is None:  # unquantized, or an error `Linear.load_shard` reports
        return source[_span(dim, start, start + size)], scale_inv
    grid = scale_grid(*_shape(source), fp8_block)
    if tuple(scale_inv.shape) != grid:
        raise WeightLoadError(f"{name}_scale_inv: shape {tuple(scale_inv.shape)} does not match the {grid} "
                              f"blocks of {fp8_block} for a {_shape(source)} weight")
    block = fp8_block[dim]
    first, end = start // block, ceil_div(start + size, block)
    if start % block == 0:
        return source[_span(dim, start, start + size)], scale_inv[_span(dim, first, end)]
    # Read the whole blocks the slice touches, dequantize them with their scales, cut the slice out.
    low, high = first * block, min(end * block, _shape(source)[dim])
    covering = source[_span(dim, low, high)]
    if covering.dtype != FP8_DTYPE:
        raise WeightLoadError(f"{name} is {covering.dtype} but the checkpoint also has {name}_scale_inv")
    floats = dequantize_block_fp8(covering, scale_inv[_span(dim, first, end)], fp8_block)
    return floats[_span(dim, start - low, start - low + size)], None


class ColumnParallelLinear(Linear):
    """y_r = x W_r^T: rank r of `group` holds rows [r n/P, (r+1) n/P) of each shard of n rows (P = world
    size), the shards fused in order: weight [sum(self.output_sizes), in_features] = shard0_r ++ shard1_r ++ ...
    (gate_r ++ up_r), with `weight_scale_inv` [ceil(rows/bn), ceil(K/bk)] when block-FP8. The shards listed
    in `replicated` are held whole by every rank (kv_a_proj_with_mqa, every head's latent, fused with the
    q_proj that is split by heads).

    `output_sizes` are the checkpoint's (full) shard sizes, those split a multiple of P (ValueError naming
    `name` otherwise); `self.output_sizes` are this rank's. forward: x [..., K] (the same on every rank)
    -> [..., sum(self.output_sizes)] in the model dtype, this rank's columns, no communication: the next
    layer is row-parallel, or splits the columns by head.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str,
        fp8_block: tuple[int, int] | None = None,
        *,
        group: ParallelGroup,
        name: str,
        replicated: Sequence[int] = (),
    ) -> None:
        local = [n if i in replicated else _local_size(name, "output size", n, group)
                 for i, n in enumerate(output_sizes)]
        super().__init__(in_features, local, dtype, device, fp8_block)
        self.group, self.name, self.replicated = group, name, frozenset(replicated)
        self.full_output_sizes = list(output_sizes)

    def checkpoint_shape(self, shard: int) -> tuple[int, int]:
        return self.full_output_sizes[shard], self.in_features

    def load_shard(self, shard: int, name: str, weight: TensorSource, scale_inv: torch.Tensor | None = None) -> None:
        """This rank's rows of checkpoint tensor `name` [full_output_sizes[shard], in_features] (e4m3 with its
        full `scale_inv`, or float), read from the tensor or lazy slice `weight`."""
        _check_shape(name, weight, self.checkpoint_shape(shard))
        rows = self.output_sizes[shard]
        start = 0 if shard in self.replicated else self.group.rank * rows
        local, local_scale = _read_slice(name, weight, scale_inv, 0, start, rows, self.fp8_block)
        super().load_shard(shard, name, local, local_scale)


class RowParallelLinear(Linear):
    """y = sum over ranks r of x_r W_r^T: rank r of `group` holds columns [r K/P, (r+1) K/P) of W [N, K]
    (P = world size; K a multiple of P, else ValueError naming `name`): weight [N, K/P], with
    `weight_scale_inv` [ceil(N/bn), ceil(K/P/bk)] when block-FP8.

    forward: x [..., K/P] (this rank's columns, as a column-parallel layer leaves them) -> [..., N] in the
    model dtype: the sum over the ranks (one all-reduce), or with `reduce_output` False this rank's partial
    sum, for a caller that fuses the reduction with what follows.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str,
        fp8_block: tuple[int, int] | None = None,
        *,
        group: ParallelGroup,
        name: str,
        reduce_output: bool = True,
    ) -> None:
        super().__init__(_local_size(name, "input size", in_features, group), output_sizes, dtype, device, fp8_block)
        self.group, self.name, self.reduce_output = group, name, reduce_output
        self.full_in_features = in_features

    def checkpoint_shape(self, shard: int) -> tuple[int, int]:
        return self.output_sizes[shard], self.full_in_features

    def load_shard(self, shard: int, name: str, weight: TensorSource, scale_inv: torch.Tensor | None = None) -> None:
        """This rank's columns of checkpoint tensor `name` [output_sizes[shard], full_in_features] (e4m3 with
        its full `scale_inv`, or float), read from the tensor or lazy slice `weight`."""
        _check_shape(name, weight, self.checkpoint_shape(shard))
        cols = self.in_features
        local, local_scale = _read_slice(name, weight, scale_inv, 1, self.group.rank * cols, cols, self.fp8_block)
        super().load_shard(shard, name, local, local_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K/P] -> [..., N], summed over the ranks unless `reduce_output` is False."""
        partial = super().forward(x)
        return self.group.all_reduce(partial) if self.reduce_output else partial


class _VocabShard(nn.Module):
    """Rows [r V', (r+1) V') of a [vocab_size, hidden_size] table on rank r of `group`, V' = ceil(V / P)
    (P = world size): weight [V', hidden] in the model dtype; the last rank's rows past the vocabulary
    are zero padding, so the vocabulary need not be a multiple of P."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str, *,
                 group: ParallelGroup, name: str) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size, self.group, self.name = vocab_size, hidden_size, group, name
        rows = ceil_div(vocab_size, group.world_size)
        self.vocab_start = group.rank * rows
        self.num_local = max(0, min(rows, vocab_size - self.vocab_start))  # real (not padding) rows held here
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size, dtype=dtype, device=device), requires_grad=False)

    def load(self, name: str, weight: TensorSource, scale_inv: torch.Tensor | None = None) -> None:
        """This rank's rows of checkpoint tensor `name` [vocab_size, hidden_size] (unquantized), read from the
        tensor or lazy slice `weight`. The signature is `CheckpointTensor.load`'s."""
        _check_shape(name, weight, (self.vocab_size, self.hidden_size))
        rows = weight[_span(0, self.vocab_start, self.vocab_start + self.num_local)]
        if scale_inv is not None or rows.dtype == FP8_DTYPE:
            raise WeightLoadError(f"{name}: expected an unquantized tensor, got {rows.dtype}")
        self.weight.data[: self.num_local].copy_(rows)


class VocabParallelEmbedding(_VocabShard):
    """The embedding table split by vocabulary rows (see `_VocabShard`). forward: ids [T] int64 -> [T, hidden]
    in the model dtype: each rank looks up the ids in its rows, zeros the others, and one all-reduce sums
    them (exact: a single non-zero term per element)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(_VocabShard):
    """The LM head split by vocabulary rows (see `_VocabShard`); with tied embeddings its shard is the
    embedding's (`head.weight = embedding.weight`). forward: hidden [n, hidden] (the same on every rank)
    -> logits [n, vocab_size] float32 on every rank: each rank's [n, V'] gathered, the padding cut."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # Gathered in the model dtype (half the bytes of float32); the cast after is exact either way.
        logits = self.group.all_gather(F.linear(hidden, self.weight), dim=-1)
        return logits[..., : self.vocab_size].float()
