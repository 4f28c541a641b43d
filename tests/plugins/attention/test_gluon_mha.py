"""The Gluon MHA kernel, `mha_varlen`'s choice on sm90: where it fits (on the CPU, no GPU needed), and against the
torch reference on a Hopper GPU (Gluon kernels do not run in Triton's interpreter)."""

from __future__ import annotations

import itertools

import pytest
import torch

from plugserve.conformance.tolerances import assert_close, assert_lse_close
from plugserve.plugins.attention import mha_prefill as kernels
from plugserve.plugins.attention.torch_ref import ragged_attention

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
SM90, BF16 = (9, 0), torch.bfloat16


def _qkv(q_lens: list[int], kv_lens: list[int], heads: int, d_qk: int, d_v: int, dtype: torch.dtype,
         device: str = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(sum(q_lens) + sum(kv_lens))
    q = torch.randn(sum(q_lens), heads, d_qk, generator=g).to(device, dtype)
    k = torch.randn(sum(kv_lens), heads, d_qk, generator=g).to(device, dtype)
    v = torch.randn(sum(kv_lens), heads, d_v, generator=g).to(device, dtype)
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
    cu_kv = torch.tensor([0, *itertools.accumulate(kv_lens)], dtype=torch.int32, device=device)
    return q, k, v, cu_q, cu_kv


def test_where_the_gluon_kernel_fits():
    q, k, v, _, _ = _qkv([3], [3], 2, 192, 128, BF16)
    fits = kernels.mha_gluon_fits
    assert fits(kernels.GLUON_MHA, q, k, v, SM90)
    assert fits(kernels.GLUON_MHA._replace(block_n=64), q, k, v, SM90)
    assert not fits(kernels.GLUON_MHA, q, k, v, None)  # the interpreter runs no Gluon
    assert not fits(kernels.GLUON_MHA, q, k, v, (10, 0))  # Blackwell has no wgmma
    assert not fits(kernels.GLUON_MHA, q.float(), k.float(), v.float(), SM90)
    assert not fits(kernels.GLUON_MHA._replace(block_m=64), q, k, v, SM90)
    assert not fits(kernels.GLUON_MHA, q[:, :, :128], k[:, :, :128], v, SM90)  # no power-of-two tail
    assert not fits(kernels.GLUON_MHA, *_qkv([3], [3], 2, 192, 256, BF16)[:3], SM90)  # Dv over 128
    assert not fits(kernels.GLUON_MHA, q, k.transpose(0, 1).contiguous().transpose(0, 1), v, SM90)  # not packed
    assert fits(kernels.GLUON_MHA, *_qkv([3], [3], 2, 96, 64, BF16)[:3], SM90)  # 64 + 32


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma kernel needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("q_lens,prefixes", [([300, 1, 129], [0, 77, 500]), ([1000], [4096]), ([5, 3], [-3, -3])],
                         ids=["mixed", "long-prefix", "rows-without-keys"])
def test_matches_the_reference(q_lens: list[int], prefixes: list[int], causal: bool, block_n: int,
                               dtype: torch.dtype):
    kv_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    q, k, v, cu_q, cu_kv = _qkv(q_lens, kv_lens, 3, 192, 128, dtype, "cuda")
    config = kernels.GLUON_MHA._replace(block_n=block_n)
    out, lse = kernels.mha_varlen(q, k, v, cu_q, cu_kv, max(q_lens), 0.07, causal, config)
    ref_out, ref_lse = ragged_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), q_lens, kv_lens, 0.07,
                                        causal)
    assert_close(out.cpu(), ref_out, dtype, f"gluon MHA {q_lens} after {prefixes}, causal={causal}, {block_n} keys")
    assert_lse_close(lse.cpu(), ref_lse, dtype, "lse")


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma kernel needs a Hopper GPU")
def test_is_the_default_where_it_fits():
    q, k, v, cu_q, cu_kv = _qkv([200], [260], 2, 192, 128, BF16, "cuda")
    default = kernels.mha_varlen(q, k, v, cu_q, cu_kv, 200, 0.07, True)
    gluon = kernels.mha_varlen(q, k, v, cu_q, cu_kv, 200, 0.07, True, kernels.GLUON_MHA)
    assert torch.equal(default[0], gluon[0]) and torch.equal(default[1], gluon[1])
