"""The Triton attention backend against the torch reference, on the CPU through Triton's interpreter.

`triton.jit` decides when a function is defined whether it is interpreted, and that includes Triton's
own standard library (tl.max, tl.sum, ...), defined when triton is first imported. Any earlier test
may import triton without TRITON_INTERPRET, so the kernel tests run in a child pytest of this file
started with TRITON_INTERPRET=1 (`test_kernels_in_the_interpreter`); in the parent they are skipped.
Shapes are small: the interpreter runs every program in Python. Only fp16 and fp32: the interpreter's
tl.dot mishandles bf16, which the conformance kit checks on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from plugserve.conformance import oracle
from plugserve.conformance.batches import random_batch
from plugserve.conformance.tolerances import assert_close, assert_lse_close
from plugserve.core.dispatch import prepare_attention
from plugserve.core.forward_batch import AttnForwardMethod, DraftTree, ForwardBatch, ForwardMode
from plugserve.core.hardware import Hardware
from plugserve.core.specs import AttentionSpec
from plugserve.plugins.attention.torch_ref import TorchRefAttention, merge_attn_states, ragged_attention
from plugserve.plugins.attention.triton import TritonAttention

CHILD = "PLUGSERVE_TRITON_INTERPRETER_CHILD"
IN_CHILD = os.environ.get(CHILD) == "1"
interpreted = pytest.mark.skipif(not IN_CHILD, reason="runs in the TRITON_INTERPRET=1 child of "
                                                      "test_kernels_in_the_interpreter")
CPU = torch.device("cpu")
DTYPES = [torch.float16, torch.float32]
LAYER = 1
# Not a multiple of the 16-head block, so the last head block is masked; R and P powers of two but
# small, and MHA head dims off powers of two (40 = 32 + 8 tail, 24 padded to 32).
HEADS, R, P, NOPE, V = 20, 64, 32, 8, 24


@pytest.mark.skipif(IN_CHILD, reason="this is the child")
def test_kernels_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", CHILD: "1"}
    root = Path(__file__).parents[3]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).relative_to(root))],
        cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return importlib.import_module("plugserve.plugins.attention.mla_decode")


@pytest.fixture(scope="module")
def projection() -> ModuleType:
    return importlib.import_module("plugserve.plugins.attention.mla_project")


@pytest.fixture(scope="module")
def mha() -> ModuleType:
    return importlib.import_module("plugserve.plugins.attention.mha_prefill")


@pytest.fixture(scope="module")
def common() -> ModuleType:
    return importlib.import_module("plugserve.plugins.attention.common")


def spec_of(dtype: torch.dtype, page_size: int = 1, heads: int = HEADS) -> AttentionSpec:
    return AttentionSpec(num_heads=heads, kv_lora_rank=R, qk_nope_head_dim=NOPE, qk_rope_head_dim=P, v_head_dim=V,
                         dtype=dtype, page_size=page_size)


def backends(spec: AttentionSpec, batch: ForwardBatch) -> tuple[TritonAttention, TorchRefAttention]:
    triton_backend, reference = TritonAttention(spec, CPU), TorchRefAttention(spec, CPU)
    triton_backend.plan(batch)
    reference.plan(batch)
    return triton_backend, reference


def test_kernels_say_where_gluon_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend named triton runs the Gluon twins on sm90 only: its `kernels` line says so per GPU."""
    h100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 * 2**30, 132)
    a100 = Hardware("cuda", "NVIDIA A100", (8, 0), 80 * 2**30, 108)
    b200 = Hardware("cuda", "NVIDIA B200", (10, 0), 180 * 2**30, 148)
    on_hopper = TritonAttention.kernels(h100)
    assert "MLA decode: Gluon (gluon_mla)" in on_hopper and "MHA prefill: Gluon (gluon_mha)" in on_hopper
    assert "merge: Triton" in on_hopper
    for gpu in (a100, b200):
        assert "Gluon kernel" in TritonAttention.kernels(gpu) and "Gluon (" not in TritonAttention.kernels(gpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonAttention.kernels(Hardware.detect(CPU)) == "MLA decode, MHA prefill, merge: Triton (interpreter)"


def test_it_declares_where_its_decode_rounds_to_e4m3(monkeypatch: pytest.MonkeyPatch) -> None:
    """`rounds_decode_to_e4m3` (what the kit's oracle follows) holds exactly where the decode takes the Gluon kernel
    over an e4m3 pool: sm90, 64-head blocks (fewer heads padded to one), not batch-invariant."""
    h100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 * 2**30, 132)
    monkeypatch.setattr(Hardware, "detect", staticmethod(lambda device: h100))
    fp8 = torch.float8_e4m3fn

    def rounds(**fields) -> bool:
        spec = AttentionSpec(**{"num_heads": 128, "dtype": torch.bfloat16, "page_size": 64, **fields})
        return TritonAttention(spec, CPU).rounds_decode_to_e4m3

    assert rounds(kv_cache_dtype=fp8)
    assert not rounds()  # a bf16 pool
    assert rounds(kv_cache_dtype=fp8, page_size=16)  # blocks span pages: rows by cp.async, the same wgmmas
    assert rounds(kv_cache_dtype=fp8, num_heads=32)  # the Gluon kernel's 64-head block, heads masked
    assert rounds(kv_cache_dtype=fp8, num_heads=32, page_size=1)
    assert rounds(kv_cache_dtype=fp8, num_heads=16)  # padded too on pages of 64
    assert not rounds(kv_cache_dtype=fp8, num_heads=16, page_size=1)  # 16-head blocks: mma.sync, the upcast
    assert not rounds(kv_cache_dtype=fp8, batch_invariant=True)  # fixed splits never take the Gluon kernel


def test_fewer_heads_take_the_gluon_kernels_64_head_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """On sm90, 16 and 32 heads launch the Gluon kernel's 64-head block at any page size: over a bf16 pool from 128
    (token, head) rows on, over an e4m3 pool every DECODE at 32 heads or on pages of 64; fewer rows, 16 heads over e4m3
    on shorter pages, a draft tree and batch invariance keep the pointer kernel's own blocks. The launch is recorded,
    not run (the Gluon kernel needs the GPU: `test_gluon_mla`)."""
    h100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 * 2**30, 132)
    monkeypatch.setattr(Hardware, "detect", staticmethod(lambda device: h100))
    mla_decode = importlib.import_module("plugserve.plugins.attention.mla_decode")
    launched: list = []

    def record(q_nope: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        launched.append(args[7])  # the config
        return torch.zeros_like(q_nope)

    monkeypatch.setattr(mla_decode, "mla_attention", record)

    def block_h(tokens: int, heads: int = 16, tree: bool = False, **fields) -> int:
        spec = AttentionSpec(**{"num_heads": heads, "dtype": torch.bfloat16, "page_size": 64, **fields})
        mode = ForwardMode.TARGET_VERIFY if tree else ForwardMode.DECODE
        requests = 1 if tree else tokens
        batch = random_batch(mode, [130] * requests, [tokens // requests] * requests, spec, CPU)
        if tree:
            batch = batch.with_tree(DraftTree.of(torch.arange(-1, tokens - 1)[None]))
        backend = TritonAttention(spec, CPU)
        backend.plan(batch)
        q_nope = torch.zeros(batch.num_tokens, heads, spec.kv_lora_rank, dtype=torch.bfloat16)
        backend.forward_mla(q_nope, torch.zeros(batch.num_tokens, heads, spec.qk_rope_head_dim,
                                                dtype=torch.bfloat16), LAYER)
        config = launched.pop()
        assert config.gluon == (config.block_h == 64)
        return config.block_h

    assert block_h(8) == 64 and block_h(4, heads=32) == 64 and block_h(64) == 64
    assert block_h(7) == 16 and block_h(1) == 16 and block_h(3, heads=32) == 32
    fp8 = torch.float8_e4m3fn
    assert block_h(1, heads=32, kv_cache_dtype=fp8) == 64  # at every DECODE, as rounds_decode_to_e4m3 says
    assert block_h(1, heads=32, kv_cache_dtype=fp8, page_size=32) == 64
    assert block_h(1, kv_cache_dtype=fp8) == 64  # 16 heads on pages of 64
    assert block_h(8, kv_cache_dtype=fp8, page_size=16) == 16  # 16 heads on shorter pages: the pointer kernel
    assert block_h(8, page_size=1) == 64  # its blocks' rows by cp.async
    assert block_h(8, tree=True) == 16 and block_h(8, batch_invariant=True) == 16
    assert block_h(8, heads=128) == 64  # 64-head blocks anyway


def test_availability_on_the_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = Hardware.detect(CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonAttention.availability(cpu)
    monkeypatch.delenv("TRITON_INTERPRET")
    available = TritonAttention.availability(cpu)
    assert not available and "TRITON_INTERPRET=1" in available.reason


MLA_CASES = {
    "decode": (ForwardMode.DECODE, [1, 70, 130, 33], [1, 1, 1, 1]),
    "target_verify": (ForwardMode.TARGET_VERIFY, [5, 80], [4, 4]),
    "draft_extend": (ForwardMode.DRAFT_EXTEND, [12, 66], [3, 1]),
    "extend_prefix": (ForwardMode.EXTEND, [20, 90], [7, 13]),
}


def mla_inputs(spec: AttentionSpec, batch: ForwardBatch, backend: TritonAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes the new tokens' KV and returns q_nope [T, H, R], q_rope [T, H, P] as strided views, laid
    out as the model's W_UK product (head-major) and q split give them."""
    t, dtype = batch.num_tokens, spec.dtype
    latent, k_rope = torch.randn(t, R, dtype=dtype), torch.randn(t, P, dtype=dtype)
    backend.set_kv(LAYER, batch.out_cache_loc, latent, k_rope)
    q_nope = torch.randn(HEADS, t, R, dtype=dtype).transpose(0, 1)
    q_rope = torch.randn(t, HEADS, NOPE + P, dtype=dtype)[..., NOPE:]
    return q_nope, q_rope


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("case", list(MLA_CASES))
def test_forward_mla(case: str, page: int, dtype: torch.dtype) -> None:
    mode, seq_lens, extend_lens = MLA_CASES[case]
    spec = spec_of(dtype, page)
    batch = random_batch(mode, seq_lens, extend_lens, spec, CPU)
    backend, reference = backends(spec, batch)
    q_nope, q_rope = mla_inputs(spec, batch, backend)
    out = backend.forward_mla(q_nope, q_rope, LAYER)
    assert out.dtype == dtype
    assert_close(out, reference.forward_mla(q_nope, q_rope, LAYER), dtype, f"forward_mla {case} page {page}")


def new_tokens(spec: AttentionSpec, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
    """Random q_nope [T, H, R], q_rope [T, H, P], and the new tokens' latent [T, R] and rope key [T, P]."""
    t, dtype = batch.num_tokens, spec.dtype
    return (torch.randn(t, spec.num_heads, R, dtype=dtype), torch.randn(t, spec.num_heads, P, dtype=dtype),
            torch.randn(t, R, dtype=dtype), torch.randn(t, P, dtype=dtype))


@interpreted
def test_draft_forest_across_key_blocks_and_splits(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """TARGET_VERIFY of a NextN draft forest (several roots): request 0's 20 nodes start on a key-block boundary
    (prefix 32, blocks of 16) with 16 roots filling block 2 and a chain after them, so that a chain node's
    split over block 2 sees none of its keys (its partial weighs nothing, not NaN); request 1's tree straddles
    blocks. One key block a split, against the oracle. In float32 only: the tree mask does not depend on the
    dtype, and the kit runs draft trees in float16 too."""
    monkeypatch.setattr(kernels, "mla_min_split_keys", lambda num_heads: 1)
    dtype = torch.float32
    spec = spec_of(dtype, page_size=16)
    parents = torch.tensor([[-1] * 16 + [-1, 16, 17, 18],
                            [-1, 0, 0, 1, -1, 4, 2, 5, 6, 3, 9, 10, 11, -1, 13, 14, 15, 8, 7, 0]])
    batch = random_batch(ForwardMode.TARGET_VERIFY, [52, 45], [20, 20], spec, CPU).with_tree(DraftTree.of(parents))
    backend, _ = backends(spec, batch)
    q_nope, q_rope, latent, k_rope = new_tokens(spec, batch)
    expected, _ = oracle.mla(batch, LAYER, q_nope, q_rope, latent, k_rope, oracle.softmax_scale(spec))
    backend.set_kv(LAYER, batch.out_cache_loc, latent, k_rope)
    plan = backend.plan_state
    for splits in (1, 4):
        out = kernels.mla_attention(q_nope, q_rope, batch.kv_pool.buffer(LAYER), batch.block_table,
                                    plan.token_req, plan.token_kv_len, 16, spec.softmax_scale,
                                    kernels.MlaConfig(16, 16, 1, 1), splits, tree=plan.tree)
        assert_close(out, expected, dtype, f"forward_mla of a draft forest, {splits} KV splits")


def test_trees_past_64_nodes_are_refused() -> None:
    spec = spec_of(torch.float32, page_size=16)
    batch = random_batch(ForwardMode.TARGET_VERIFY, [80], [65], spec, CPU)
    batch = batch.with_tree(DraftTree.of(torch.arange(-1, 64)[None]))
    with pytest.raises(ValueError, match="at most 64 nodes"):
        TritonAttention(spec, CPU).plan(batch)


@interpreted
def test_mla_launches_against_the_oracle(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Head blocks of 16 (two for 20 heads, the second partial), 32 and 64 (one, mostly masked); key blocks
    of 16 and 64, through pointers and TMA boxes, the query held or loaded per block; each at 1 and 3
    KV splits, the first also at 16. Page 16 over 1, 300 and 129 keys, splits down to one key block (not
    256 keys): 16 splits of 300 keys leave 6 empty, the 1-key request every split but the first; 300 and
    129 end in a partial key block, 128 (the verify row before it) on a whole one. In float16 only: the
    launch configs do not depend on the dtype, and the kit runs the default ones in float32 too."""
    monkeypatch.setattr(kernels, "mla_min_split_keys", lambda num_heads: 1)
    dtype = torch.float16
    spec = spec_of(dtype, page_size=16)
    batch = random_batch(ForwardMode.TARGET_VERIFY, [1, 300, 129], [1, 3, 2], spec, CPU)
    backend, _ = backends(spec, batch)
    q_nope, q_rope, latent, k_rope = new_tokens(spec, batch)
    expected, _ = oracle.mla(batch, LAYER, q_nope, q_rope, latent, k_rope, oracle.softmax_scale(spec))
    backend.set_kv(LAYER, batch.out_cache_loc, latent, k_rope)
    plan = backend.plan_state
    MlaConfig = kernels.MlaConfig
    configs = [MlaConfig(16, 16, 1, 1, tma=True), MlaConfig(32, 64, 1, 1, reload_q=True),
               MlaConfig(64, 16, 1, 1, tma=True, reload_q=True)]
    for config, splits in [(configs[0], 16), *itertools.product(configs, (1, 3))]:
        out = kernels.mla_attention(q_nope, q_rope, batch.kv_pool.buffer(LAYER), batch.block_table,
                                    plan.token_req, plan.token_kv_len, 16, spec.softmax_scale, config, splits)
        assert_close(out, expected, dtype, f"forward_mla, {config}, {splits} KV splits")


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_mla_projected_folds_w_uv_into_the_reduce(kernels: ModuleType, dtype: torch.dtype,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """W_UV (V = 24: a masked second column block) in the split reduce, at 1 and 3 splits (1: forward_mla and a bmm);
    through the backend at 3 and at FUSED_V_PROJ_MAX_TOKENS + 1 tokens (forward_mla and a bmm). Against the oracle's
    latent output rounded to the dtype, times W_UV in float64."""
    from plugserve.plugins.attention import triton as triton_backend

    monkeypatch.setattr(kernels, "mla_min_split_keys", lambda num_heads: 1)
    spec = spec_of(dtype, page_size=16)
    w_vc = (torch.randn(HEADS, R, V) / R**0.5).to(dtype)
    for rows in (3, triton_backend.FUSED_V_PROJ_MAX_TOKENS + 1):
        batch = random_batch(ForwardMode.DECODE, [1, 70, 130, 33, 5, 9, 40, 17, 64][:rows], [1] * rows, spec, CPU)
        backend, _ = backends(spec, batch)
        q_nope, q_rope, latent, k_rope = new_tokens(spec, batch)
        latent_out, _ = oracle.mla(batch, LAYER, q_nope, q_rope, latent, k_rope, oracle.softmax_scale(spec))
        expected = torch.einsum("thr,hrv->thv", latent_out.to(dtype).double(), w_vc.double())
        backend.set_kv(LAYER, batch.out_cache_loc, latent, k_rope)
        out = backend.forward_mla_projected(q_nope, q_rope, LAYER, w_vc)
        assert out.shape == (rows, HEADS, V) and out.dtype == dtype
        assert_close(out, expected, dtype, f"forward_mla_projected, {rows} tokens")
        if rows <= triton_backend.FUSED_V_PROJ_MAX_TOKENS:
            plan = backend.plan_state
            for splits in (1, 3):
                out = kernels.mla_attention(q_nope, q_rope, batch.kv_pool.buffer(LAYER), batch.block_table,
                                            plan.token_req, plan.token_kv_len, 16, spec.softmax_scale,
                                            kernels.MlaConfig(16, 16, 1, 1), splits, w_vc=w_vc)
                assert_close(out, expected, dtype, f"mla_attention with W_UV, {splits} KV splits")


@interpreted
@pytest.mark.parametrize("dtype", [*DTYPES, torch.bfloat16], ids=str)
def test_mla_reads_an_fp8_pool_times_its_scale(kernels: ModuleType, dtype: torch.dtype,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """An e4m3 pool of scale 0.37 (stored values / 0.37): the kernel at 1 and 3 KV splits, and through the backend
    with W_UV folded into the reduce, against the oracle over the dequantized cache; the torch reference too. The
    kernel refuses TMA boxes over it (they would read q's dtype). Under a bfloat16 q its 16-head blocks compute in
    float16, so even the interpreter (whose bfloat16 dots are wrong) gets them right; the backend's own blocks of
    these 20 heads are 32 wide, in bfloat16, so that q runs the kernel calls only."""
    monkeypatch.setattr(kernels, "mla_min_split_keys", lambda num_heads: 1)
    spec = dataclasses.replace(spec_of(dtype, page_size=16), kv_cache_dtype=torch.float8_e4m3fn)
    batch = random_batch(ForwardMode.DECODE, [1, 70, 130], [1, 1, 1], spec, CPU, kv_scale=0.37)
    backend, reference = backends(spec, batch)
    q_nope, q_rope, latent, k_rope = new_tokens(spec, batch)
    expected, _ = oracle.mla(batch, LAYER, q_nope, q_rope, latent, k_rope, oracle.softmax_scale(spec))
    backend.set_kv(LAYER, batch.out_cache_loc, latent, k_rope)
    assert_close(reference.forward_mla(q_nope, q_rope, LAYER), expected, dtype, "torch_ref over an fp8 pool")
    plan, buffer = backend.plan_state, batch.kv_pool.buffer(LAYER)
    call = functools.partial(kernels.mla_attention, q_nope, q_rope, buffer, batch.block_table, plan.token_req,
                             plan.token_kv_len, 16, spec.softmax_scale)
    for splits in (1, 3):
        out = call(kernels.MlaConfig(16, 16, 1, 1), splits, kv_scale=0.37)
        assert_close(out, expected, dtype, f"mla_attention over an fp8 pool, {splits} KV splits")
    if dtype != torch.bfloat16:
        w_vc = (torch.randn(HEADS, R, V) / R**0.5).to(dtype)
        projected = backend.forward_mla_projected(q_nope, q_rope, LAYER, w_vc)
        assert_close(projected, torch.einsum("thr,hrv->thv", expected.to(dtype).double(), w_vc.double()), dtype,
                     "forward_mla_projected over an fp8 pool")
    with pytest.raises(ValueError, match="an fp8 pool takes pointer loads"):
        call(kernels.MlaConfig(16, 16, 1, 1, tma=True), 1, kv_scale=0.37)


def test_mla_refuses_what_does_not_fit(kernels: ModuleType) -> None:
    spec = spec_of(torch.float16, page_size=16)
    batch = random_batch(ForwardMode.DECODE, [40, 9], [1, 1], spec, CPU)
    backend, _ = backends(spec, batch)
    q_nope, q_rope, _, _ = new_tokens(spec, batch)
    call = functools.partial(kernels.mla_attention, q_nope, q_rope, batch.kv_pool.buffer(LAYER), batch.block_table,
                             backend.plan_state.token_req, backend.plan_state.token_kv_len, 16, spec.softmax_scale)
    with pytest.raises(ValueError, match="cannot use TMA"):  # 64-key blocks span pages of 16
        call(kernels.MlaConfig(16, 64, 1, 1, tma=True), 1)
    with pytest.raises(ValueError, match="cannot run the Gluon kernel"):  # the CPU (and 16 heads, a small latent)
        call(kernels.MlaConfig(64, 16, 8, 2, gluon=True), 1)
    rows = kernels.mla_workspace_size(2, HEADS, 3)
    with pytest.raises(ValueError, match="too small"):
        call(kernels.MlaConfig(16, 16, 1, 1), 3, (torch.empty(rows * R - 1), torch.empty(rows)))


@interpreted
def test_launch_heuristics(kernels: ModuleType) -> None:
    h100, sm90, sm80, bf16 = 132, (9, 0), (8, 0), torch.bfloat16
    assert kernels.mla_block_h(128, bf16, sm90) == 64 and kernels.mla_block_h(128, bf16, sm80) == 32
    assert kernels.mla_block_h(20, bf16, sm90) == 32 and kernels.mla_block_h(128, torch.float32, sm90) == 16
    # sm90, 64-head blocks: the Gluon kernel where its blocks lie in pages; else Triton's, TMA where it can.
    assert kernels.mla_config(128, bf16, sm90, 64, 512, 64) == kernels.MlaConfig(64, 64, 8, 2, tma=True, gluon=True)
    assert kernels.mla_config(128, bf16, sm90, 16, 512, 64) == kernels.MlaConfig(64, 64, 8, 2, gluon=True)  # rows
    assert kernels.mla_config(128, bf16, sm90, 64, 256, 64) == kernels.MlaConfig(64, 64, 8, 2, tma=True)
    # An fp8 pool: the Gluon kernel's 8-bit wgmmas where it fits, else pointer loads upcast in registers, never the
    # Triton kernel's TMA boxes (which read q's dtype).
    fp8 = torch.float8_e4m3fn
    assert kernels.mla_config(128, bf16, sm90, 64, 512, 64, fp8) == kernels.MlaConfig(64, 64, 8, 2, gluon=True)
    assert kernels.mla_config(128, bf16, sm90, 16, 512, 64, fp8) == kernels.MlaConfig(64, 64, 8, 2, gluon=True)
    assert kernels.mla_config(128, bf16, (8, 9), 64, 512, 64, fp8) == kernels.MlaConfig(32, 64, 8, 5, reload_q=True)
    assert kernels.mla_config(128, bf16, None, 64, 512, 64) == kernels.MlaConfig(64, 64, 1, 1)  # the interpreter
    assert kernels.mla_config(16, bf16, sm90, 64, 512, 64) == kernels.MlaConfig(16, 32, 4, 5, reload_q=True)
    # 16-head blocks over an e4m3 pool: 64 keys on 8 warps, the upcast tiles read twice (no spills on sm90); 32-head
    # blocks as over a bf16 pool.
    assert kernels.mla_config(16, bf16, sm90, 1, 512, 64, fp8) == kernels.MlaConfig(16, 64, 8, 5, reload_q=True)
    assert kernels.mla_config(32, bf16, sm90, 1, 512, 64, fp8) == kernels.mla_config(32, bf16, sm90, 1, 512, 64)
    assert kernels.mla_min_split_keys(128) == 256 and kernels.mla_min_split_keys(16) == 32
    assert kernels.mla_min_split_keys(20) == 64 and kernels.mla_min_split_keys(1) == 32
    # (token, head block) rows -> the most splits in one wave at least 80% full on 132 SMs, else the fewest filling
    # 80% of every wave; 128 heads: 256 keys a split.
    assert kernels.mla_num_splits(2, 32768, h100, 256) == 66  # batch 1, 128 heads in 2 blocks: 132 programs
    assert kernels.mla_num_splits(16, 32768, h100, 256) == 8  # batch 8: 128 programs
    assert kernels.mla_num_splits(64, 32768, h100, 256) == 2  # batch 32: 128 programs
    assert kernels.mla_num_splits(128, 32768, h100, 256) == 1  # batch 64: one wave without splitting
    assert kernels.mla_num_splits(2, 600, h100, 256) == 3  # never below 256 keys a split
    assert kernels.mla_num_splits(1, 1 << 20, h100, 256) == 128  # at most MLA_MAX_SPLITS
    assert kernels.mla_num_splits(100, 1 << 20, h100, 256) == 1  # 2 splits fill no better, 5 take 4 waves
    assert kernels.mla_num_splits(80, 1 << 20, h100, 256) == 3  # 240 programs: 2 waves, 91% full
    # 16 heads in one block: 32 keys a split.
    assert kernels.mla_num_splits(32, 8192, h100, 32) == 4  # batch 32
    assert kernels.mla_num_splits(1, 4096, h100, 32) == 128  # batch 1: a 288-key decode runs 9 splits of 32
    assert kernels.mla_num_splits(1, 288, h100, 32) == 9
    assert kernels.mla_workspace_size(32, 128, 1) == 0 and kernels.mla_workspace_size(32, 128, 2) == 32 * 128 * 2


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_graph_replays_write_partials_to_the_workspace(dtype: torch.dtype) -> None:
    """plan_capture / plan_replay as the graph runner calls them (eagerly on the CPU), on a backend that
    believes it has an H100's 132 SMs, so that small batches split: the partials go to the workspace
    init_cuda_graph allocated, and the result still matches the oracle."""
    spec = spec_of(dtype, page_size=16)
    batch = random_batch(ForwardMode.DECODE, [300, 77], [1, 1], spec, CPU)
    backend = TritonAttention(spec, CPU)
    backend._multiprocessors = 132
    backend.init_cuda_graph(max_batch_size=4, max_num_tokens=4, max_pages=64)  # graphs for up to 1024 keys
    lse_workspace = backend._graph_workspace[1]
    lse_workspace.fill_(float("nan"))
    backend.plan_capture(batch)
    splits = backend.plan_state.num_splits
    assert splits == 16  # 2 programs cannot fill 132 SMs: as many splits as 1024 keys allow, 64 keys each
    q_nope, q_rope, latent, k_rope = new_tokens(spec, batch)
    expected, _ = oracle.mla(batch, LAYER, q_nope, q_rope, latent, k_rope, oracle.softmax_scale(spec))
    backend.set_kv(LAYER, batch.out_cache_loc, latent, k_rope)
    assert_close(backend.forward_mla(q_nope, q_rope, LAYER), expected, dtype, "forward_mla from a graph plan")
    # Splits keep 64 keys (20 heads: `mla_min_split_keys`, one block of 64) however many there are: 300 keys
    # fill 5, 77 keys 2; the rest write only their -inf log-sum-exps.
    lse = lse_workspace[: backend._mla_decode.mla_workspace_size(2, HEADS, splits)].view(2, HEADS, splits)
    assert torch.equal(torch.isfinite(lse).sum(-1), torch.tensor([[5] * HEADS, [2] * HEADS]))
    assert not torch.isnan(lse).any()


@interpreted
def test_fixed_splits_follow_each_tokens_length_alone(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch-invariant launches (fixed_splits): a token's row is the same bits at every split count a launch holding
    it has, from its own `mla_fixed_num_splits` (1 for the 1-key request: still reduced) to MLA_FIXED_MAX_SPLITS:
    splits of one 16-key block, and 700 keys (44 blocks) over the most splits, of 2 blocks; and in launches of one
    token at a time, as a workspace too small for all of them takes them. Against the oracle too."""
    assert kernels.mla_fixed_num_splits(1, 256) == 1 and kernels.mla_fixed_num_splits(600, 256) == 3
    assert kernels.mla_fixed_num_splits(1 << 20, 256) == kernels.MLA_FIXED_MAX_SPLITS
    assert kernels.mla_workspace_size(2, 128, 1, fixed_splits=True) == 256
    monkeypatch.setattr(kernels, "mla_min_split_keys", lambda num_heads: 16)
    dtype, config = torch.float32, kernels.MlaConfig(16, 16, 1, 1)
    spec = spec_of(dtype, page_size=16)
    seq_lens = [1, 40, 700]
    batch = random_batch(ForwardMode.DECODE, seq_lens, [1] * 3, spec, CPU)
    backend, _ = backends(spec, batch)
    q_nope, q_rope, latent, k_rope = new_tokens(spec, batch)
    expected, _ = oracle.mla(batch, LAYER, q_nope, q_rope, latent, k_rope, oracle.softmax_scale(spec))
    backend.set_kv(LAYER, batch.out_cache_loc, latent, k_rope)
    plan = backend.plan_state
    call = functools.partial(kernels.mla_attention, kv_buffer=batch.kv_pool.buffer(LAYER), page_size=16,
                             sm_scale=spec.softmax_scale, config=config, fixed_splits=True)
    batch_splits = kernels.mla_fixed_num_splits(700, 16)
    assert batch_splits == kernels.MLA_FIXED_MAX_SPLITS
    together = call(q_nope, q_rope, block_table=batch.block_table, token_req=plan.token_req,
                    token_kv_len=plan.token_kv_len, num_splits=batch_splits)
    assert_close(together, expected, dtype, "forward_mla with fixed splits")
    for row, seq_len in enumerate(seq_lens):
        own = kernels.mla_fixed_num_splits(seq_len, 16)
        for splits in sorted({own, (own + batch_splits) // 2}):
            alone = call(q_nope[row : row + 1], q_rope[row : row + 1], block_table=batch.block_table[row : row + 1],
                         token_req=torch.zeros(1, dtype=torch.int32), token_kv_len=plan.token_kv_len[row : row + 1],
                         num_splits=splits)
            assert torch.equal(alone, together[row : row + 1]), f"request {row} alone, {splits} splits"
    monkeypatch.setattr(kernels, "MLA_FIXED_WORKSPACE_ROWS", HEADS * batch_splits)
    assert kernels.mla_workspace_size(3, HEADS, batch_splits, fixed_splits=True) == HEADS * batch_splits
    sliced = call(q_nope, q_rope, block_table=batch.block_table, token_req=plan.token_req,
                  token_kv_len=plan.token_kv_len, num_splits=batch_splits)
    assert torch.equal(sliced, together), "a launch pair a token"


@interpreted
def test_batch_invariant_backend_projects_and_replays_as_eager() -> None:
    """Under spec.batch_invariant: forward_mla_projected past FUSED_V_PROJ_MAX_TOKENS gives each request the same bits
    alone as in the batch, and a graph plan (splits for 1024 keys on a backend that believes it has 132 SMs) the same
    forward_mla bits as the eager plan."""
    dtype = torch.float16
    spec = dataclasses.replace(spec_of(dtype, page_size=16), batch_invariant=True)
    seq_lens = [1, 70, 130, 33, 5, 9, 40, 17, 64]
    batch = random_batch(ForwardMode.DECODE, seq_lens, [1] * len(seq_lens), spec, CPU)
    backend = TritonAttention(spec, CPU)
    backend._multiprocessors = 132
    backend.plan(batch)
    q_nope, q_rope, latent, k_rope = new_tokens(spec, batch)
    backend.set_kv(LAYER, batch.out_cache_loc, latent, k_rope)
    w_vc = (torch.randn(HEADS, R, V) / R**0.5).to(dtype)
    eager = backend.forward_mla(q_nope, q_rope, LAYER)
    projected = backend.forward_mla_projected(q_nope, q_rope, LAYER, w_vc)
    assert_close(projected, torch.einsum("thr,hrv->thv", eager.double(), w_vc.double()), dtype, "projected")
    for row, seq_len in enumerate(seq_lens):
        alone = ForwardBatch.build(ForwardMode.DECODE, [seq_len], [1], batch.block_table[row : row + 1], batch.kv_pool)
        alone.attn_method = AttnForwardMethod.MLA
        backend.plan(alone)
        rows = slice(row, row + 1)
        assert torch.equal(backend.forward_mla_projected(q_nope[rows], q_rope[rows], LAYER, w_vc), projected[rows])
    backend.init_cuda_graph(max_batch_size=len(seq_lens), max_num_tokens=len(seq_lens), max_pages=64)
    backend.plan_capture(batch)
    assert torch.equal(backend.forward_mla(q_nope, q_rope, LAYER), eager)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mla_project_rows_are_the_same_bits_at_any_token_count(projection: ModuleType, dtype: torch.dtype) -> None:
    """mla_project (W_UV in fixed tiles of MLA_PROJECT_BLOCK_T tokens): against the float64 product, and each token's
    row the same bits in a prefix, alone, or past the first tile; V = 24 masks most of a column block."""
    latent = torch.randn(37, HEADS, R).to(dtype)
    w_vc = (torch.randn(HEADS, R, V) / R**0.5).to(dtype)
    whole = projection.mla_project(latent, w_vc)
    assert whole.shape == (37, HEADS, V) and whole.dtype == dtype
    assert_close(whole, torch.einsum("thr,hrv->thv", latent.double(), w_vc.double()), dtype, "mla_project")
    for rows in (slice(0, 1), slice(0, 17), slice(36, 37), slice(5, 30)):
        assert torch.equal(projection.mla_project(latent[rows], w_vc), whole[rows]), f"tokens {rows}"
    with pytest.raises(ValueError, match="w_vc must be"):
        projection.mla_project(latent, w_vc[:, :-1])


@interpreted
def test_launch_falls_back_to_a_config_that_fits(common: ModuleType) -> None:
    from triton.runtime.errors import OutOfResources

    tried: list[int] = []

    class SmallSharedMemoryKernel:
        """Refuses, as Triton does before launching, every config with BLOCK > 16."""

        def __getitem__(self, grid: tuple[int, ...]):
            def launch(*args: object, BLOCK: int) -> None:
                tried.append(BLOCK)
                if BLOCK > 16:
                    raise OutOfResources(2 * BLOCK, 32, "shared memory")

            return launch

    configs = [{"BLOCK": 64}, {"BLOCK": 32}, {"BLOCK": 16}]
    common.launch_first_fitting(SmallSharedMemoryKernel(), (1,), (), configs, ("test", 1))
    common.launch_first_fitting(SmallSharedMemoryKernel(), (1,), (), configs, ("test", 1))
    assert tried == [64, 32, 16, 16]  # the second launch goes straight to the config that fit
    with pytest.raises(OutOfResources):
        common.launch_first_fitting(SmallSharedMemoryKernel(), (1,), (), configs[:2], ("test", 2))


MHA_CASES = {
    "causal": (AttnForwardMethod.MHA, [0, 0, 0], [1, 9, 40], 1 << 30),
    "one_shot_prefix": (AttnForwardMethod.MHA, [40, 0, 65], [10, 5, 1], 1 << 30),
    "chunked_prefix": (AttnForwardMethod.MHA_CHUNKED_KV, [100, 0, 37], [5, 9, 3], 32),
}


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(MHA_CASES))
def test_forward_mha(case: str, dtype: torch.dtype) -> None:
    """Every forward_mha call of the case against the reference; for chunked prefixes also the merged
    result against one causal pass over whole sequences. Head dims off powers of two (qk 40, v 24); the
    kit runs the same cases at DeepSeek's 192 and 128."""
    method, prefix_lens, extend_lens, capacity = MHA_CASES[case]
    qk, v_dim = 40, 24
    heads = 3
    spec = AttentionSpec(num_heads=heads, kv_lora_rank=R, qk_nope_head_dim=qk - P, qk_rope_head_dim=P,
                         v_head_dim=v_dim, dtype=dtype)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    batch = random_batch(ForwardMode.EXTEND, seq_lens, extend_lens, spec, CPU, num_layers=1)
    prepare_attention(batch, chunked_prefix_cache_threshold=1, prefix_chunk_capacity=capacity)
    assert batch.attn_method is method
    backend, reference = backends(spec, batch)
    # Whole sequences of keys / values per request; each call takes its slice.
    keys = [torch.randn(s, heads, qk, dtype=dtype) for s in seq_lens]
    values = [torch.randn(s, heads, v_dim, dtype=dtype) for s in seq_lens]
    q = torch.randn(batch.num_tokens, heads, qk, dtype=dtype)

    def call(kv_slices: list[slice], chunk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([kb[s] for kb, s in zip(keys, kv_slices, strict=True)])
        v = torch.cat([vb[s] for vb, s in zip(values, kv_slices, strict=True)])
        out, lse = backend.forward_mha(q, k, v, prefix_chunk=chunk)
        ref_out, ref_lse = reference.forward_mha(q, k, v, prefix_chunk=chunk)
        assert_close(out, ref_out, dtype, f"{case} chunk {chunk} out")
        assert_lse_close(lse, ref_lse, dtype, f"{case} chunk {chunk} lse")
        return out, lse

    if method is AttnForwardMethod.MHA:
        call([slice(None)] * len(seq_lens), None)
        return
    out, lse = call([slice(p, None) for p in prefix_lens], None)
    assert len(batch.prefix_chunks) > 1
    for i, chunk in enumerate(batch.prefix_chunks):
        chunk_slices = [slice(s, s + n) for s, n in zip(chunk.starts_cpu, chunk.lens_cpu, strict=True)]
        out, lse = backend.merge_attn_states(out, lse, *call(chunk_slices, i))
    whole_out, whole_lse = ragged_attention(q, torch.cat(keys), torch.cat(values), extend_lens, seq_lens,
                                            spec.softmax_scale, causal=True)
    assert_close(out, whole_out, dtype, f"{case} merged over all chunks")
    assert_lse_close(lse, whole_lse, dtype, f"{case} merged lse")


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mha_queries_without_keys(mha: ModuleType, dtype: torch.dtype) -> None:
    # Causal with fewer keys than queries (first rows see nothing) and a request with no keys at all.
    q_lens, kv_lens = [5, 3], [2, 0]
    q = torch.randn(8, 2, 40, dtype=dtype)
    k, v = torch.randn(2, 2, 40, dtype=dtype), torch.randn(2, 2, 24, dtype=dtype)
    cu_q, cu_kv = torch.tensor([0, 5, 8], dtype=torch.int32), torch.tensor([0, 2, 2], dtype=torch.int32)
    for causal in (True, False):
        out, lse = mha.mha_varlen(q, k, v, cu_q, cu_kv, 5, 0.2, causal)
        ref_out, ref_lse = ragged_attention(q, k, v, q_lens, kv_lens, 0.2, causal)
        assert_close(out, ref_out, dtype, f"causal={causal} out")
        assert_lse_close(lse, ref_lse, dtype, f"causal={causal} lse")
        assert torch.all(out[5:] == 0) and torch.all(torch.isneginf(lse[5:]))


@interpreted
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_mha_blocks_without_and_with_masks(mha: ModuleType, causal: bool, tma: bool) -> None:
    """16-key blocks over requests of 40 new tokens after a 24-token prefix, 7 after 0, and 21 after 9: unmasked
    blocks below each query block's first diagonal, masked ones across it and at kv_len, heaviest blocks first.
    TMA boxes read past a request's keys into the next one's and past a head's 40 columns into the next head's."""
    q_lens, prefixes = [40, 7, 21], [24, 0, 9]
    kv_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(sum(q_lens), 2, 40, generator=generator)
    k = torch.randn(sum(kv_lens), 2, 40, generator=generator)
    v = torch.randn(sum(kv_lens), 2, 24, generator=generator)
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    cu_kv = torch.tensor([0, *itertools.accumulate(kv_lens)], dtype=torch.int32)
    out, lse = mha.mha_varlen(q, k, v, cu_q, cu_kv, max(q_lens), 0.2, causal,
                              mha.MhaConfig(16, 16, 1, 1, tma=tma))
    ref_out, ref_lse = ragged_attention(q, k, v, q_lens, kv_lens, 0.2, causal)
    assert_close(out, ref_out, torch.float32, "out")
    assert_lse_close(lse, ref_lse, torch.float32, "lse")


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_attn_states_with_empty_sides(dtype: torch.dtype) -> None:
    t, heads, d = 9, HEADS, V
    out_a, out_b = torch.randn(t, heads, d, dtype=dtype), torch.randn(t, heads, d, dtype=dtype)
    lse_a, lse_b = torch.randn(t, heads) * 3, torch.randn(t, heads) * 3
    lse_a[0], lse_b[1] = float("-inf"), float("-inf")
    lse_a[2], lse_b[2] = float("-inf"), float("-inf")
    out_a[0], out_b[1] = float("nan"), float("nan")  # an empty side's out is unspecified
    backend = TritonAttention(spec_of(dtype), CPU)
    out, lse = backend.merge_attn_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, "merge out")
    assert_lse_close(lse, ref_lse, dtype, "merge lse")
    assert torch.all(out[2] == 0) and torch.all(torch.isneginf(lse[2]))
