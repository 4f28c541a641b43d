"""Small ops as hand-written Triton kernels, where one kernel does what torch (even compiled) needs several for.

Imported only by `SmallOps.with_fused_kernels` (on CUDA) and by tests: importing plugserve.core must not
import triton, and `triton.jit` decides when a kernel is defined whether it compiles for the GPU or runs in
the interpreter (TRITON_INTERPRET=1, the CPU tests).

    mla_prepare   absorbed MLA's per-layer preparation of the new tokens: kv_a_layernorm of the latent,
                  interleaved rope of the rope key and of q's rope part, the KV pool write, and (at decode sizes)
                  W_UK's product with q's nope part. Eager that is six kernels (an RMSNorm, two ropes, two
                  index_put, a bmm); here it is one launch.
    rms_norm      DeepSeek's RMSNorm of each row (eager: pow, mean, add, rsqrt, two products, two casts).
    add_rms_norm  the residual add and the RMSNorm of the sum, both written by one launch.
    silu_and_mul  silu(gate) * up of the MLP's gate_up output (eager: three kernels).

Only plain tl.load / tl.store / arithmetic / tl.sum / tl.exp, so that it compiles on older Triton releases too;
on Hopper and newer GPUs with a Triton that offers it, the kernels launch as programmatic dependents
(`plugserve.core.triton_pdl`).

Arguments that change with every batch (token, pair and split counts, and the strides that follow them) are
`do_not_specialize_on_alignment`: Triton would otherwise compile a variant for each count divisible by 16 and
one for the rest, the later inside a request after the warm-up. Their == 1 variants stay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugserve.core import batch_invariant
from plugserve.core.layers import eager_ops
from plugserve.core.triton_pdl import launch_options, programmatic_prologue

# Dtypes the kernel stores the pool in. Its casts round to nearest even like torch's; an fp8 pool's values are
# divided by the scale, clamped to e4m3's range and rounded on e4m3's grid in float32 first (`_to_e4m3_grid`), as
# `kv_cache.quantize` does.
KERNEL_POOL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn})
# q's rope pairs a program rotates (BLOCK_H heads of P / 2): with P = 64, 16 heads, so that V3's 128 heads at
# decode spread over 8 programs, each one load / store round trip, instead of looping in one.
Q_PAIRS_PER_PROGRAM = 512
# W_UK's product in the same launch up to this many tokens: each absorbing program holds a [D, ABSORB_BLOCK_R] tile of
# one head's W_UK and runs every token through it (one pass over W_UK, like a bmm, but no launch of its own); more
# tokens take the bmm.
FUSED_ABSORB_MAX_TOKENS = 8
ABSORB_BLOCK_R = 64


@triton.jit
def _rms_normed(x, weight_ptr, offsets, mask, eps, size, x_ty):
    """weight * rms_norm(x) of one row x [BLOCK] float32 (zero past `size`), in float32: normalized in float32 and
    rounded to x's dtype first, as `eager_ops.rms_norm` does; the caller casts the product to torch's promoted
    dtype of x and the weight (a product of two 16-bit values is exact in float32, so one rounding matches)."""
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / size + eps)).to(x_ty)
    return tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * normed.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, sum_ptr, weight_ptr, out_ptr, stride_x, stride_residual, stride_sum,
                     stride_out, eps, D: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr):
    """Program t: out[t] = weight * rms_norm(x[t]); with ADD, of the sum x[t] + residual[t] (rounded to x's dtype,
    as torch adds), which it also writes to sum[t]."""
    programmatic_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    ok = d < D
    x_ty = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * stride_x + d, mask=ok, other=0.0)
    if ADD:
        residual = tl.load(residual_ptr + t * stride_residual + d, mask=ok, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ty)
        tl.store(sum_ptr + t * stride_sum + d, x, mask=ok)
    out = _rms_normed(x.to(tl.float32), weight_ptr, d, ok, eps, D, x_ty)
    tl.store(out_ptr + t * stride_out + d, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    """Program (t, b): out[t, b-block] = silu(gate) * up with gate = x[t, :WIDTH], up = x[t, WIDTH:], silu rounded
    to x's dtype before the product, as torch's two kernels round."""
    programmatic_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < WIDTH
    x_ty = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + t * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + WIDTH + c, mask=ok, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_out + c, (silu * up).to(x_ty), mask=ok)


@triton.jit
def _to_e4m3_grid(x):
    """x [BLOCK] float32 with |x| <= 448 rounded to nearest even on float8_e4m3fn's grid, still float32 (exact in
    e4m3, so the cast that follows does not round): e4m3 keeps 3 mantissa bits, normal exponents from -6, so the
    step at x is 2^(max(exponent(x), -6) - 3). Adding and subtracting 1.5 * 2^(step's exponent + 23) rounds |x| to
    that step in float32's own round-to-nearest-even; x's sign bit goes back on after (so -0 stays -0, as torch's
    cast keeps it). Done by hand because Triton's interpreter rounds the fp8 cast wrongly where it carries into the
    next exponent."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = (((exponent + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (tl.abs(x) + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _to_pool(x, kv_scale, buf_ty, FP8: tl.constexpr):
    """Values x [BLOCK] float32 as the pool stores them (`kv_cache.quantize`): FP8, x / kv_scale saturated to
    +-448 and rounded to nearest even; else a plain cast."""
    if FP8:
        x = tl.minimum(tl.maximum(tl.math.div_rn(x, kv_scale), -448.0), 448.0)
        x = _to_e4m3_grid(x)
    return x.to(buf_ty)


@triton.jit(do_not_specialize_on_alignment=["num_tokens"])
def _mla_prepare_kernel(
    kv_a_ptr, q_ptr, weight_ptr, cos_ptr, sin_ptr, slots_ptr, buf_ptr, q_out_ptr, q_nope_ptr, w_kc_ptr, q_abs_ptr,
    num_tokens, stride_kv_a, stride_q_t, stride_q_h, stride_cos, stride_sin, stride_slots, stride_buf, stride_out_t,
    stride_out_h, stride_nope_t, stride_nope_h, stride_w_h, stride_w_d, stride_abs_t, stride_abs_h, eps, kv_scale,
    H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, ROUND_NORM: tl.constexpr,
    ROPE_BLOCKS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_RA: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    """Program (t, 0): pool row slots[t] = rms_norm(latent) ++ rope(k_rope). Program (t, 1 + b), b < ROPE_BLOCKS:
    heads [b * BLOCK_H, (b + 1) * BLOCK_H) of q_rope[t] rotated into q_out[t]. Every cast goes through the input's
    dtype first, as the eager ops round (`eager_ops.rms_norm`, `eager_ops._rotate`); FP8: the row is stored as
    `_to_pool` quantizes, by kv_scale. Program (0, 1 + ROPE_BLOCKS + a)
    (launched only to absorb): q_abs[:, h, r-block] = q_nope[:, h] @ w_kc[h, :, r-block] for every token, float32
    sums, with h, r-block = divmod(a, ceil(R / BLOCK_RA))."""
    programmatic_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    x_ty = kv_a_ptr.dtype.element_ty
    if block > ROPE_BLOCKS:
        if t == 0:
            a = block - 1 - ROPE_BLOCKS
            h = (a // tl.cdiv(R, BLOCK_RA)).to(tl.int64)
            r = (a % tl.cdiv(R, BLOCK_RA)) * BLOCK_RA + tl.arange(0, BLOCK_RA)
            d = tl.arange(0, BLOCK_D)
            w = tl.load(w_kc_ptr + h * stride_w_h + d[:, None] * stride_w_d + r[None, :],
                        mask=(d < D)[:, None] & (r < R)[None, :], other=0.0).to(tl.float32)
            for token in range(num_tokens):
                q = tl.load(q_nope_ptr + token * stride_nope_t + h * stride_nope_h + d, mask=d < D, other=0.0)
                product = tl.sum(q.to(tl.float32)[:, None] * w, axis=0)
                tl.store(q_abs_ptr + token * stride_abs_t + h * stride_abs_h + r,
                         product.to(q_abs_ptr.dtype.element_ty), mask=r < R)
        return
    j = tl.arange(0, BLOCK_HALF)  # rope pair j: elements 2j, 2j + 1
    j_ok = j < P // 2
    cos = tl.load(cos_ptr + t * stride_cos + j, mask=j_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_sin + j, mask=j_ok, other=0.0).to(tl.float32)
    if block == 0:
        buf_ty = buf_ptr.dtype.element_ty
        kv = kv_a_ptr + t * stride_kv_a
        row = buf_ptr + tl.load(slots_ptr + t * stride_slots).to(tl.int64) * stride_buf
        # The product rounded to x's dtype when the weight has it: torch's product of two 16-bit tensors is
        # 16-bit; of mixed dtypes, float32.
        r = tl.arange(0, BLOCK_R)
        x = tl.load(kv + r, mask=r < R, other=0.0).to(tl.float32)
        latent = _rms_normed(x, weight_ptr, r, r < R, eps, R, x_ty)
        if ROUND_NORM:
            latent = latent.to(x_ty)
        tl.store(row + r, _to_pool(latent.to(tl.float32), kv_scale, buf_ty, FP8), mask=r < R)
        k_even = tl.load(kv + R + 2 * j, mask=j_ok, other=0.0).to(tl.float32)
        k_odd = tl.load(kv + R + 2 * j + 1, mask=j_ok, other=0.0).to(tl.float32)
        k_even_out = (k_even * cos - k_odd * sin).to(x_ty).to(tl.float32)
        k_odd_out = (k_odd * cos + k_even * sin).to(x_ty).to(tl.float32)
        tl.store(row + R + 2 * j, _to_pool(k_even_out, kv_scale, buf_ty, FP8), mask=j_ok)
        tl.store(row + R + 2 * j + 1, _to_pool(k_odd_out, kv_scale, buf_ty, FP8), mask=j_ok)
    else:
        h = (block - 1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = (h < H)[:, None] & j_ok[None, :]
        q = q_ptr + t * stride_q_t + h[:, None] * stride_q_h + 2 * j[None, :]
        q_even = tl.load(q, mask=ok, other=0.0).to(tl.float32)
        q_odd = tl.load(q + 1, mask=ok, other=0.0).to(tl.float32)
        out = q_out_ptr + t * stride_out_t + h[:, None] * stride_out_h + 2 * j[None, :]
        q_ty = q_out_ptr.dtype.element_ty
        tl.store(out, (q_even * cos[None, :] - q_odd * sin[None, :]).to(q_ty), mask=ok)
        tl.store(out + 1, (q_odd * cos[None, :] + q_even * sin[None, :]).to(q_ty), mask=ok)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # The kernel takes a stride for every dim but the last (the model's views already have unit stride there).
    return x if x.stride(-1) == 1 else x.contiguous()


def mla_prepare(kv_a: torch.Tensor, q_nope: torch.Tensor, q_rope: torch.Tensor, w_kc: torch.Tensor,
                norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, buffer: torch.Tensor,
                slots: torch.Tensor, kv_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`eager_ops.mla_prepare` in one kernel launch (same arguments, same results; see there), W_UK's product
    included up to FUSED_ABSORB_MAX_TOKENS tokens (beyond, and at every count under `batch_invariant`, where a
    token's product must not follow the batch's size, `eager_ops.absorb_q` follows).

    kv_a [T, R + P], q_nope [T, H, D] and q_rope [T, H, P] may be strided views (last dim contiguous); w_kc
    [H, D, R]; cos / sin [T, P/2] float32; buffer [num_slots, R + P] (float8_e4m3fn: value / kv_scale, on GPUs of
    sm89 and newer, which convert to fp8; the eager op elsewhere); slots [T] int64. Returns (q absorbed
    [T, H, R], q_rope rotated [T, H, P]), new tensors. Grid (T, 1 + head blocks + absorbing programs), no host
    sync, only the outputs allocated: fine in a CUDA graph."""
    fp8 = buffer.dtype == torch.float8_e4m3fn
    if buffer.dtype not in KERNEL_POOL_DTYPES or (fp8 and buffer.is_cuda and
                                                  torch.cuda.get_device_capability(buffer.device) < (8, 9)):
        return eager_ops.mla_prepare(kv_a, q_nope, q_rope, w_kc, norm_weight, eps, cos, sin, buffer, slots, kv_scale)
    t, h, p = q_rope.shape
    r, d = norm_weight.shape[0], q_nope.shape[2]
    q_out = torch.empty((t, h, p), dtype=q_rope.dtype, device=q_rope.device)
    if t == 0:
        return torch.empty((t, h, r), dtype=q_nope.dtype, device=q_nope.device), q_out
    kv_a, q_nope, q_rope, w_kc, cos, sin = (_last_dim_contiguous(x) for x in (kv_a, q_nope, q_rope, w_kc, cos, sin))
    block_half = triton.next_power_of_2(p // 2)
    block_h = max(1, min(triton.next_power_of_2(h), Q_PAIRS_PER_PROGRAM // block_half))
    rope_blocks = triton.cdiv(h, block_h)
    absorb = t <= FUSED_ABSORB_MAX_TOKENS and not batch_invariant.active()
    absorbing = h * triton.cdiv(r, ABSORB_BLOCK_R) if absorb else 0
    q_abs = torch.empty((t, h, r), dtype=q_nope.dtype, device=q_nope.device) if absorb else q_out  # unwritten
    _mla_prepare_kernel[(t, 1 + rope_blocks + absorbing)](
        kv_a, q_rope, norm_weight, cos, sin, slots, buffer, q_out, q_nope, w_kc, q_abs,
        t, kv_a.stride(0), q_rope.stride(0), q_rope.stride(1), cos.stride(0), sin.stride(0), slots.stride(0),
        buffer.stride(0), q_out.stride(0), q_out.stride(1), q_nope.stride(0), q_nope.stride(1), w_kc.stride(0),
        w_kc.stride(1), q_abs.stride(0), q_abs.stride(1), eps, kv_scale,
        H=h, R=r, P=p, D=d, BLOCK_H=block_h, BLOCK_R=triton.next_power_of_2(r), BLOCK_HALF=block_half,
        ROUND_NORM=norm_weight.dtype == kv_a.dtype, ROPE_BLOCKS=rope_blocks, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_RA=ABSORB_BLOCK_R, FP8=fp8, **launch_options(kv_a),
        # Products and sums rounded one by one, as torch's element-wise kernels do (no FMA contraction).
        enable_fp_fusion=False,
    )
    return (q_abs if absorb else eager_ops.absorb_q(q_nope, w_kc)), q_out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [rows, D] with unit stride in D (a view where one exists, e.g. a column slice of a GEMM's
    output)."""
    return _last_dim_contiguous(x if x.dim() == 2 else x.reshape(-1, x.shape[-1]))


def _norm_launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    rows = _rows(x)
    t, d = rows.shape
    out = torch.empty((t, d), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty((t, d), dtype=x.dtype, device=x.device) if residual is not None else out
    if t > 0:
        others = _rows(residual) if residual is not None else rows
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(t,)](rows, others, summed, weight, out, rows.stride(0), others.stride(0), summed.stride(0),
                               out.stride(0), eps, D=d, BLOCK=block, ADD=residual is not None,
                               **launch_options(rows), num_warps=min(max(block // 512, 1), 16),
                               enable_fp_fusion=False)
    return out.view(x.shape), summed.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`eager_ops.rms_norm` in one launch: x [..., D] (last dim contiguous, other strides free), weight [D] ->
    [..., D] in torch's promoted dtype of x and weight, a new tensor."""
    return _norm_launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`eager_ops.add_rms_norm` in one launch: x, residual [..., D] -> (rms_norm(x + residual), x + residual), new
    tensors. Mixed dtypes of x and residual (torch would promote the sum) take the eager op."""
    if residual.dtype != x.dtype:
        return eager_ops.add_rms_norm(x, residual, weight, eps)
    return _norm_launch(x, residual, weight, eps)


# Columns of the output a silu_and_mul program writes: several programs per row at V3's widths (18432), so that a
# batch-1 decode still spreads over the SMs.
SILU_BLOCK = 1024


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`eager_ops.silu_and_mul` in one launch: gate_up [T, 2I] (gate columns, then up) -> [T, I], a new tensor."""
    rows = _rows(gate_up)
    t, i = rows.shape[0], rows.shape[1] // 2
    out = torch.empty((t, i), dtype=gate_up.dtype, device=gate_up.device)
    if t > 0:
        block = min(SILU_BLOCK, triton.next_power_of_2(i))
        _silu_and_mul_kernel[(t, triton.cdiv(i, block))](rows, out, rows.stride(0), out.stride(0), WIDTH=i,
                                                          BLOCK=block, **launch_options(rows), num_warps=4,
                                                          enable_fp_fusion=False)
    return out.view(*gate_up.shape[:-1], i)
