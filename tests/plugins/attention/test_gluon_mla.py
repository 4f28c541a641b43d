"""The Gluon MLA decode kernel, as `mla_attention`'s stage 1 for configs with `gluon` set: where it fits
(on the CPU, no GPU needed), and against the torch reference (an e4m3 pool: the kit's oracle) on a Hopper GPU (Gluon
kernels do not run in Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from plugserve.conformance import oracle
from plugserve.conformance.batches import random_batch
from plugserve.conformance.tolerances import assert_close
from plugserve.core.forward_batch import ForwardMode
from plugserve.core.specs import AttentionSpec
from plugserve.plugins.attention import mla_decode as kernels
from plugserve.plugins.attention.torch_ref import mla_attention_reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
PAGE = 64
GLUON = kernels.MlaConfig(64, 64, 8, 2, gluon=True)
LAYER = 1


def test_where_the_gluon_kernel_fits():
    bf16, sm90 = torch.bfloat16, (9, 0)
    assert kernels.mla_gluon_fits(GLUON, 512, 64, 64, bf16, sm90)
    assert kernels.mla_gluon_fits(GLUON, 512, 64, 128, torch.float16, sm90)
    assert kernels.mla_gluon_fits(GLUON, 512, 64, 64, bf16, sm90, torch.float8_e4m3fn)  # 8-bit wgmmas
    assert not kernels.mla_gluon_fits(GLUON, 512, 64, 64, bf16, sm90, torch.float16)  # a pool of another 16 bits
    assert not kernels.mla_gluon_fits(GLUON, 512, 64, 64, bf16, (10, 0))  # Blackwell has no wgmma
    assert not kernels.mla_gluon_fits(GLUON, 512, 64, 64, bf16, None)  # the interpreter runs no Gluon
    assert not kernels.mla_gluon_fits(GLUON, 512, 64, 64, bf16, (8, 9))  # wgmma is sm90's
    assert kernels.mla_gluon_fits(GLUON, 512, 64, 1, bf16, sm90)  # pages shorter than a block: rows by cp.async
    assert not kernels.mla_gluon_fits(GLUON, 256, 64, 64, bf16, sm90)  # DeepSeek's latent only
    assert not kernels.mla_gluon_fits(GLUON, 512, 64, 64, torch.float32, sm90)
    assert not kernels.mla_gluon_fits(kernels.MlaConfig(32, 64, 8, 2, gluon=True), 512, 64, 64, bf16, sm90)
    # Its warpgroups take whole 64-key blocks in two stages.
    assert not kernels.mla_gluon_fits(kernels.MlaConfig(64, 32, 8, 3, gluon=True), 512, 64, 64, bf16, sm90)


def _paged(kv_lens: list[int], heads: int, dtype: torch.dtype, seed: int, page: int = PAGE):
    """Queries, a shuffled page pool holding each request's keys and its block table, and the keys in order."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in kv_lens]
    order = torch.randperm(sum(pages) + 3, generator=g)  # and 3 pages nobody owns
    pool = torch.randn((sum(pages) + 3) * page, 576, generator=g)
    table = torch.zeros(len(kv_lens), max(pages), dtype=torch.int32)
    start = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[start:start + n]
        start += n
        # Rows past kv_len in the last page are NaN: a kernel that lets one into its dots returns NaN (0 * NaN).
        last = table[i, n - 1].item() * page
        pool[last + kv_lens[i] - (n - 1) * page:last + page] = float("nan")
    rows = [torch.cat([pool[p * page:(p + 1) * page] for p in table[i, :pages[i]].tolist()])[:n]
            for i, n in enumerate(kv_lens)]
    keys = torch.cat(rows)
    q = torch.randn(len(kv_lens), heads, 576, generator=g)
    return q.to(dtype), pool.to(dtype), table, keys.to(dtype)


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma kernel needs a Hopper GPU")
@pytest.mark.parametrize("kv_lens", [[37], [64, 130, 1000], [4096, 1]], ids=["one-partial-block", "mixed", "long"])
@pytest.mark.parametrize("heads", [16, 32, 64, 128])  # 16 and 32: one 64-head block, the rest masked
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page", [64, 16, 1])  # blocks as TMA boxes; rows by cp.async
def test_matches_the_reference(kv_lens: list[int], heads: int, splits: int, dtype: torch.dtype, page: int):
    q, pool, table, keys = _paged(kv_lens, heads, dtype, seed=sum(kv_lens) + heads, page=page)
    scale = 192**-0.5
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    out = kernels.mla_attention(q[..., :512].cuda(), q[..., 512:].cuda(), pool.cuda(), table.cuda(),
                                torch.arange(len(kv_lens), dtype=torch.int32).cuda(), lens.cuda(), page, scale, GLUON,
                                splits)
    expected, _ = mla_attention_reference(q[..., :512], q[..., 512:], keys[:, :512], keys[:, 512:],
                                          [1] * len(kv_lens), kv_lens, scale)
    assert_close(out.cpu(), expected, dtype, f"gluon MLA {kv_lens} x{heads} heads, {splits} splits, page {page}")


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma kernel needs a Hopper GPU")
@pytest.mark.parametrize("kv_lens", [[37], [64], [64, 130, 1000], [4096, 1]],
                         ids=["one-partial-block", "one-block", "mixed", "long"])
@pytest.mark.parametrize("heads", [16, 32, 64, 128])  # 16 and 32: one 64-head block, the rest masked
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page", [64, 1])
def test_an_e4m3_pool_against_the_oracle(kv_lens: list[int], heads: int, splits: int, dtype: torch.dtype, page: int):
    """An e4m3 pool (scale 0.5): the kernel's 8-bit wgmmas against the kit's oracle with the query rounded per
    head and room for the probabilities' rounding (`oracle.mla_as_declared`). A sequence of one block, whose P V on
    warpgroup 1 once lost its second k-step to ptxas, is among them."""
    device = torch.device("cuda")
    spec = AttentionSpec(num_heads=heads, dtype=dtype, page_size=page, kv_cache_dtype=torch.float8_e4m3fn)
    torch.manual_seed(sum(kv_lens) + heads)
    batch = random_batch(ForwardMode.DECODE, kv_lens, [1] * len(kv_lens), spec, device, kv_scale=0.5)
    t, pool = batch.num_tokens, batch.kv_pool
    latent, k_rope = (torch.randn(t, n, device=device, dtype=dtype) for n in (512, 64))
    q_nope, q_rope = (torch.randn(t, heads, n, device=device, dtype=dtype) for n in (512, 64))
    scale = oracle.softmax_scale(spec)
    expected, _, slack = oracle.mla_as_declared(batch, LAYER, q_nope, q_rope, latent, k_rope, scale, True)
    pool.write(LAYER, batch.out_cache_loc, latent, k_rope)
    out = kernels.mla_attention(q_nope, q_rope, pool.buffer(LAYER), batch.block_table,
                                torch.arange(t, dtype=torch.int32, device=device), batch.seq_lens.to(torch.int32),
                                page, scale, GLUON, splits, kv_scale=pool.scale)
    assert_close(out, expected, dtype, f"gluon MLA over e4m3 {kv_lens} x{heads} heads, {splits} splits, page {page}",
                 slack=slack)
