"""What the attention kernel files share: launch helpers, and the two device functions that a Triton kernel and
its Gluon twin both call (`mla_program`: the MLA decode program's work; `mha_softmax`: MHA's online softmax).

`triton.jit` decides when a function is defined whether it compiles for the GPU or runs in the interpreter
(TRITON_INTERPRET=1): like the kernel files, this module is imported only once a backend is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

LOG2E = math.log2(math.e)  # softmaxes run in base 2: scores are scaled by sm_scale * LOG2E
# tl.dot needs every operand dimension >= 16.
MIN_DOT = 16


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest power of two >= n, and at least `floor`."""
    return max(floor, triton.next_power_of_2(n))


def input_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: exact products ("ieee") for fp32 operands, which are the accuracy dtype here,
    not a serving one (single TF32 risks the kit's lse bound on 576-wide scores); the setting does not change
    fp16 / bf16 dots. docs/kernels.md says what the alternatives cost."""
    return "ieee" if dtype == torch.float32 else "tf32"


# Index of the config that fits, per launch key: tried once per process, then launched directly.
_FITTING_CONFIG: dict[tuple, int] = {}


def launch_first_fitting(kernel, grid: tuple[int, ...] | Callable[[dict], tuple[int, ...]],
                         args: tuple | Callable[[dict], tuple], configs: list[dict], key: tuple) -> None:
    """Launch `kernel[grid](*args, **config)` with the first of `configs` (block sizes, num_warps,
    num_stages; largest first) whose shared memory this GPU holds (`grid` and `args` may be functions
    of the config). Tiles tuned on H100 (228 KB) overflow smaller GPUs (~100 KB on sm86 / sm89) and wide
    or fp32 heads; Triton raises OutOfResources before launching, so a refused config had no effect."""
    refused: OutOfResources | None = None
    for index in range(_FITTING_CONFIG.get(key, 0), len(configs)):
        config = configs[index]
        try:
            kernel[grid](*(args(config) if callable(args) else args), **config)
        except OutOfResources as exc:
            refused = exc
            continue
        _FITTING_CONFIG[key] = index
        return
    raise refused or ValueError("no config to launch")


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x, or a contiguous copy when its last dim is strided: the kernels take strides for every dim but the last,
    whose unit stride keeps loads vectorized."""
    return x if x.stride(-1) == 1 else x.contiguous()


def gluon_runs_on(capability: tuple[int, int] | None) -> bool:
    """Whether the Gluon kernels (`gluon_mla`, `gluon_mha`) can run on a GPU of this compute capability: their
    wgmma is Hopper's alone (Blackwell's tensor cores take tcgen05); the interpreter (None) runs no Gluon."""
    return capability is not None and capability[0] == 9


@triton.jit
def saturate_to_f16(x):
    """x (bfloat16) as float16, beyond float16's range clamped to its largest finite value rather than inf."""
    return tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def mla_program(num_heads, num_splits, min_split_blocks, token_req_ptr, token_kv_len_ptr, BLOCK_H: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """This MLA decode program's work, the same for `mla_decode`'s Triton kernel and `gluon_mla`'s (one program per
    token, KV split and block of BLOCK_H heads, heads fastest): (head block, split, token t and its request (int64),
    kv_len, its key blocks first .. last - 1). Splits are of whole blocks, at least min_split_blocks each: only the
    sequence's last block is partial, and the late splits of a short sequence are empty (first >= last)."""
    pid = tl.program_id(0)
    head_blocks = tl.cdiv(num_heads, BLOCK_H)
    split = (pid // head_blocks) % num_splits
    t = (pid // head_blocks // num_splits).to(tl.int64)
    kv_len = tl.load(token_kv_len_ptr + t)
    num_blocks = tl.cdiv(kv_len, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(num_blocks, num_splits), min_split_blocks)
    first = split * per_split
    return (pid % head_blocks, split, t, tl.load(token_req_ptr + t).to(tl.int64), kv_len, first,
            tl.minimum(first + per_split, num_blocks))


@triton.jit
def mha_softmax(m, denom, scores, offs_m, offs_n, kv_len, diagonal, qk_scale, MASKED: tl.constexpr,
                CAUSAL: tl.constexpr):
    """Online softmax of one key block's raw scores, the same in `mha_prefill`'s Triton kernel and `gluon_mha`'s:
    (probabilities [M, N] float32, m_new, denom_new, alpha, the factor the accumulator takes). MASKED: the block may
    hold keys past kv_len or (CAUSAL) past a row's diagonal; unmasked blocks skip every mask and the -inf guard (every
    score is finite there)."""
    if MASKED:
        visible = (offs_n < kv_len)[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= diagonal + offs_m[:, None])
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        # A row with no visible key yet keeps m = -inf; shifting it by 0 keeps its weights at 0, not NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        probs = tl.exp2(scores - shift[:, None])
    else:
        # The scale and the shift in one FMA per score (the scale is positive: the max commutes with it).
        m_new = tl.maximum(m, tl.max(scores, 1) * qk_scale)
        shift = m_new
        probs = tl.exp2(scores * qk_scale - shift[:, None])
    alpha = tl.exp2(m - shift)
    return probs, m_new, denom * alpha + tl.sum(probs, 1), alpha
