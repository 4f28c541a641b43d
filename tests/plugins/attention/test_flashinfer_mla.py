"""The flashinfer_mla backend on the CPU, where FlashInfer cannot run: its declaration and availability,
the metadata and layouts it hands the library (against independent torch computations), the base-2 /
natural log-sum-exp conversions, and plan / forward wiring end to end against a stand-in `flashinfer`
module that computes what FlashInfer 0.7.2.post1's wrappers compute (in float32, from the metadata
it is given), compared with the torch reference."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import pytest
import torch

from plugserve.conformance.batches import random_batch
from plugserve.conformance.tolerances import assert_close, assert_lse_close
from plugserve.core.dispatch import prepare_attention
from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode, Phase
from plugserve.core.graph_inputs import GraphInputs
from plugserve.core.hardware import Hardware
from plugserve.core.kv_cache import MLAKVPool, pages_needed, sequence_slots
from plugserve.core.specs import AttentionSpec
from plugserve.plugins.attention import flashinfer_mla
from plugserve.plugins.attention.flashinfer_mla import (
    LN2,
    LOG2E,
    FlashInferMLAAttention,
    base2_to_natural_,
    exclusive_cumsum,
    fa_kernel,
    find_nvcc,
    merge_natural_lse,
    natural_to_base2,
    paged_kv_indices,
    paged_latent_views,
)
from plugserve.plugins.attention.torch_ref import (
    TorchRefAttention,
    dense_attention,
    merge_attn_states,
    ragged_attention,
)
from plugserve.registry import Registry

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def _gpu(capability: tuple[int, int]) -> Hardware:
    return Hardware("cuda", "Some GPU", capability, 80 << 30, 132)


# -- declaration, registration, availability ----------------------------------------------------------


def test_declared_and_registered() -> None:
    FlashInferMLAAttention.check_declaration()
    registry = Registry(builtin=("plugserve.plugins.attention.torch_ref",
                                 "plugserve.plugins.attention.flashinfer_mla"), entry_points=False)
    assert not registry.broken
    assert registry.get("attention", "flashinfer_mla").cls is FlashInferMLAAttention


def _fake_install(monkeypatch: pytest.MonkeyPatch, module: ModuleType | None, jit_cache: bool = False) -> None:
    """Make `import flashinfer` give `module` (None: fail), as if installed; flashinfer_jit_cache as told."""
    real_find_spec = flashinfer_mla.importlib.util.find_spec

    def find_spec(name: str, *args: object):
        if name == "flashinfer":
            return SimpleNamespace(name=name)
        if name == "flashinfer_jit_cache":
            return SimpleNamespace(name=name) if jit_cache else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(flashinfer_mla.importlib.util, "find_spec", find_spec)
    monkeypatch.setitem(sys.modules, "flashinfer", module)


def _module(version: str, with_plan_metadata: bool) -> ModuleType:
    module = ModuleType("flashinfer")
    module.__version__ = version  # type: ignore[attr-defined]
    module.mla = SimpleNamespace(MLAPlanMetadata=object) if with_plan_metadata else SimpleNamespace()  # type: ignore[attr-defined]
    return module


def test_availability_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    assert FlashInferMLAAttention.availability(Hardware.detect(CPU)).reason == "runs on cuda, not cpu"
    assert FlashInferMLAAttention.availability(_gpu((7, 5))).reason == "needs sm80 or newer, this GPU is sm75"
    real_find_spec = flashinfer_mla.importlib.util.find_spec
    monkeypatch.setattr(flashinfer_mla.importlib.util, "find_spec",
                        lambda name, *a: None if name == "flashinfer" else real_find_spec(name, *a))
    assert (FlashInferMLAAttention.availability(_gpu((9, 0))).reason
            == "flashinfer is not installed (pip install flashinfer-python)")

    _fake_install(monkeypatch, None)  # installed, but the import raises
    assert FlashInferMLAAttention.availability(_gpu((9, 0))).reason.startswith(
        "flashinfer is installed but fails to import")
    _fake_install(monkeypatch, _module("0.2.5", with_plan_metadata=False))
    reason = FlashInferMLAAttention.availability(_gpu((9, 0))).reason
    assert "flashinfer 0.2.5 predates" in reason and "pip install flashinfer-python -U" in reason

    _fake_install(monkeypatch, _module("0.7.2.post1", with_plan_metadata=True))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))  # a CUDA_HOME without bin/nvcc
    assert "finds no nvcc" in FlashInferMLAAttention.availability(_gpu((9, 0))).reason
    _fake_install(monkeypatch, _module("0.7.2.post1", with_plan_metadata=True), jit_cache=True)
    assert FlashInferMLAAttention.availability(_gpu((9, 0)))  # prebuilt kernels need no nvcc
    _fake_install(monkeypatch, _module("0.7.2.post1", with_plan_metadata=True))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    assert FlashInferMLAAttention.availability(_gpu((8, 0)))


def test_find_nvcc_follows_flashinfer(tmp_path) -> None:
    (tmp_path / "bin").mkdir()
    assert find_nvcc({"CUDA_HOME": str(tmp_path)}) is None  # CUDA_HOME wins even when it lacks nvcc
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    assert find_nvcc({"CUDA_HOME": str(tmp_path)}) == str(nvcc)
    assert find_nvcc({"CUDA_PATH": str(tmp_path)}) == str(nvcc)
    assert find_nvcc({"PATH": str(tmp_path / "bin")}) == str(nvcc)


def test_capabilities() -> None:
    caps = FlashInferMLAAttention.capabilities
    assert caps.phases() == frozenset(Phase)
    for page_size in (1, 16, 64, 128):
        for dtype in (torch.bfloat16, torch.float16):
            spec = AttentionSpec(dtype=dtype, page_size=page_size)
            assert caps.check(spec, Phase.DECODE) and caps.check(spec, Phase.PREFILL)
    assert caps.check(AttentionSpec(dtype=torch.float32), Phase.DECODE).reason == (
        "dtype float32 is not supported (supports bfloat16, float16)")
    assert "kv_lora_rank 256" in caps.check(AttentionSpec(kv_lora_rank=256), Phase.DECODE).reason
    assert "MHA head dims (qk, v) (192, 192)" in caps.check(AttentionSpec(v_head_dim=192), Phase.PREFILL).reason
    assert FlashInferMLAAttention.priority_on(_gpu((9, 0))) == 70
    assert FlashInferMLAAttention.priority_on(_gpu((8, 0))) == 40


@pytest.mark.parametrize(("capability", "cuda", "kernel"), [
    ((9, 0), "13.0", "fa3"), ((9, 0), "12.4", "fa3"), ((9, 0), "12.2", "fa2"), ((9, 0), None, "fa2"),
    ((8, 0), "13.0", "fa2"), ((8, 9), "12.8", "fa2"), ((10, 0), "12.8", "fa2"), ((12, 0), "12.9", "fa2"),
])
def test_fa_kernel_per_arch(capability: tuple[int, int], cuda: str | None, kernel: str) -> None:
    assert fa_kernel(capability, cuda) == kernel


# -- metadata and layouts ----------------------------------------------------------------------------


def test_exclusive_cumsum() -> None:
    assert exclusive_cumsum([3, 0, 5]).tolist() == [0, 3, 3, 8]
    assert exclusive_cumsum([]).tolist() == [0]
    assert exclusive_cumsum([1]).dtype == torch.int32


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_paged_kv_indices_address_every_cached_slot(page_size: int) -> None:
    seq_lens = [1, 17, 64, 100, 129, 3]
    spec = AttentionSpec(num_heads=2, page_size=page_size)
    batch = random_batch(ForwardMode.DECODE, seq_lens, [1] * len(seq_lens), spec, CPU, num_layers=1)
    pages = paged_kv_indices(batch.block_table, seq_lens, page_size)
    for name, t in (("kv_indptr", pages.kv_indptr), ("kv_indices", pages.kv_indices), ("kv_lens", pages.kv_lens)):
        assert t.dtype == torch.int32 and t.is_contiguous(), name
    assert pages.kv_lens.tolist() == seq_lens
    # FlashInfer's own plan check: each request's page count is ceil(kv_len / page_size).
    assert torch.equal(pages.kv_indptr.diff(), torch.tensor([math.ceil(s / page_size) for s in seq_lens],
                                                            dtype=torch.int32))
    # The kernel's addressing, page kv_indices[kv_indptr[b] + p // page_size], row p % page_size, yields
    # the slots plugserve's own sequence_slots computes from the block table.
    indptr, indices = pages.kv_indptr.tolist(), pages.kv_indices.long()
    slots = torch.cat([indices[indptr[b] + torch.arange(s) // page_size] * page_size + torch.arange(s) % page_size
                       for b, s in enumerate(seq_lens)])
    assert torch.equal(slots, sequence_slots(batch.block_table, seq_lens, page_size))


def test_paged_kv_indices_into_a_fixed_buffer() -> None:
    table = torch.tensor([[7, 3, 9], [4, 0, 0]], dtype=torch.int32)
    buffer = torch.full((8,), -1, dtype=torch.int32)
    pages = paged_kv_indices(table, [20, 5], 8, out=buffer)
    assert pages.kv_indices.data_ptr() == buffer.data_ptr() and pages.kv_indices.tolist() == [7, 3, 9, 4]
    assert buffer.tolist() == [7, 3, 9, 4, -1, -1, -1, -1]  # the rest untouched
    with pytest.raises(ValueError, match="4 page ids do not fit a kv_indices buffer of 3"):
        paged_kv_indices(table, [20, 5], 8, out=buffer[:3])


def test_paged_kv_indices_refuse_a_short_block_table() -> None:
    table = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="need up to 4 pages of 16"):
        paged_kv_indices(table, [10, 49], 16)
    assert paged_kv_indices(table[:0], [], 16).kv_indices.numel() == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_latent_views_are_the_pool_rows(page_size: int) -> None:
    rank, rope, num_pages = 512, 64, 9
    pool = MLAKVPool(2, num_pages, page_size, rank, rope, torch.bfloat16, CPU)
    slots = torch.randperm(pool.num_slots)[:7]
    latent, k_rope = torch.randn(7, rank), torch.randn(7, rope)
    pool.write(1, slots, latent, k_rope)
    ckv, kpe = paged_latent_views(pool, 1)
    buffer = pool.buffer(1)
    assert ckv.shape == (num_pages, page_size, rank) and kpe.shape == (num_pages, page_size, rope)
    # What FlashInfer's kernels assume: views of the one buffer, rows `rank + rope` apart, last stride 1.
    for view, offset in ((ckv, 0), (kpe, rank)):
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert view.stride() == (page_size * (rank + rope), rank + rope, 1) and view.storage_offset() == offset
    # Element (page, row, d) at page * stride(0) + row * stride(1) + d from the view's start, as the kernels
    # address it, is the written value of slot page * page_size + row.
    flat = buffer.reshape(-1)
    for view, values in ((ckv, latent), (kpe, k_rope)):
        page, row = slots // page_size, slots % page_size
        start = view.storage_offset() + page * view.stride(0) + row * view.stride(1)
        read = flat[start[:, None] + torch.arange(view.shape[-1])]
        assert torch.equal(read, values.to(torch.bfloat16))
        assert torch.equal(view[page, row], values.to(torch.bfloat16))


# -- log-sum-exp bases -------------------------------------------------------------------------------


def test_lse_conversions() -> None:
    scores = torch.randn(9, 4, 33) * 4
    scores[0, 0] = NEG_INF  # a row with no visible key
    natural = torch.logsumexp(scores, dim=-1)
    base2 = torch.log2(torch.exp2(scores * LOG2E).sum(-1))  # what FlashInfer's kernels compute
    assert torch.allclose(base2_to_natural_(base2.clone()), natural, atol=1e-5)
    assert torch.allclose(natural_to_base2(natural), base2, atol=1e-5)
    assert torch.isneginf(natural_to_base2(natural)[0, 0]) and torch.isneginf(base2_to_natural_(base2.clone())[0, 0])
    strided = natural.t()
    converted = natural_to_base2(strided)
    assert converted.is_contiguous() and converted.dtype == torch.float32
    x = torch.tensor([1.0, 2.0])
    assert base2_to_natural_(x) is x  # in place


def emulated_merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's MergeStateKernel (cascade.cuh) in torch: base-2 lse, contiguous inputs required."""
    for t in (v_a, s_a, v_b, s_b):
        assert t.is_contiguous(), "FlashInfer's merge_state checks CHECK_INPUT (contiguous)"
    assert s_a.dtype == s_b.dtype == torch.float32
    s_max = torch.maximum(s_a, s_b)
    # CUDA's fmax drops the NaN of (-inf) - (-inf); exp2(-inf) = 0.
    a = torch.exp2(torch.nan_to_num(s_a - s_max, nan=NEG_INF))
    b = torch.exp2(torch.nan_to_num(s_b - s_max, nan=NEG_INF))
    total = a + b
    scale_a = torch.where(total > 0, a / total, 0.0)[..., None]
    scale_b = torch.where(total > 0, b / total, 0.0)[..., None]
    v = (scale_a * v_a.float() + scale_b * v_b.float()).to(v_a.dtype)
    return v, torch.log2(total) + s_max


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_merge_in_natural_log(dtype: torch.dtype) -> None:
    t, h, d = 11, 3, 128
    out_a = torch.randn(h, t, d, dtype=dtype).transpose(0, 1)  # not contiguous: the merge must copy it
    out_b = torch.randn(t, h, d, dtype=dtype)
    lse_a, lse_b = torch.randn(t, h) * 3, torch.randn(t, h) * 3
    lse_a[0], lse_b[1] = NEG_INF, NEG_INF
    lse_a[2], lse_b[2] = NEG_INF, NEG_INF
    out_a[0], out_b[1], out_a[2], out_b[2] = 0, 0, 0, 0
    out, lse = merge_natural_lse(out_a, lse_a, out_b, lse_b, emulated_merge_state)
    ref_out, ref_lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, "merge out")
    assert_lse_close(lse, ref_lse, dtype, "merge lse")


# -- plan and forward against a stand-in FlashInfer ---------------------------------------------------


@dataclass(frozen=True)
class PlanMetadata:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len_arr: torch.Tensor

    @classmethod
    def csr(cls, *, qo_indptr, kv_indptr, kv_indices, kv_len_arr) -> PlanMetadata:
        return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr)


class FakeCompiledPlanner:
    """0.7.2.post1's compiled MLA planner (`wrapper._planned_backend._cached_module._module.plan`): it writes a
    schedule into the pinned int workspace and returns (plan_info, bytes to upload); the captured kernel reads
    the schedule from the device int workspace and bakes plan_info (grid, workspace offsets) in. Here the
    schedule is the CSR metadata itself, and plan_info depends on the batch size and `layout` only."""

    def __init__(self) -> None:
        self.calls, self.layout = 0, 0

    def plan(self, float_workspace, int_workspace, pinned, qo_indptr, kv_indptr, kv_len, num_heads, head_dim_ckv,
             causal) -> tuple[list[int], int]:
        for t in (qo_indptr, kv_indptr, kv_len):
            assert t.device.type == "cpu" and t.dtype == torch.int32, "the planner reads these on the host"
        schedule = torch.cat([qo_indptr, kv_indptr, kv_len])
        pinned.view(torch.int32)[: schedule.numel()] = schedule
        self.calls += 1
        return [kv_len.numel(), int(causal), num_heads, head_dim_ckv, self.layout], schedule.numel() * 4


class FakePlannedBackend:
    """What wrapper.plan leaves in 0.7.2.post1: the compiled module, the workspaces, the launch layout."""

    def __init__(self, planner: FakeCompiledPlanner, plan_info: list[int], size: int) -> None:
        self._cached_module = SimpleNamespace(_module=planner)
        self._float_workspace_buffer = torch.empty(16, dtype=torch.uint8)
        self._int_workspace_buffer = torch.zeros(4 * (3 * size + 2), dtype=torch.uint8)
        self._pin_memory_int_workspace_buffer = torch.zeros_like(self._int_workspace_buffer)
        self._plan_info = plan_info


class FakeMLAWrapper:
    """BatchMLAPagedAttentionWrapper's contract: CSR pages, causal bottom-right over kv_len keys. In graph mode
    (`use_cuda_graph`, 0.7.2.post1's `_fa_common.py`): reserved int32 buffers, qo_indptr / kv_indptr / kv_len_arr
    of the planned batch's exact sizes and kv_indices at least as long as the batch's pages, into which plan()
    copies the metadata; plan() also leaves the compiled planner's backend behind (`_planned_backend`), and the
    kernel then reads the page ids from the reserved kv_indices and the schedule from the device int workspace,
    as a captured launch would."""

    def __init__(self, workspace: torch.Tensor, use_cuda_graph: bool = False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, *, backend: str) -> None:
        self.backend, self.plans, self.use_cuda_graph = backend, 0, use_cuda_graph
        self.buffers = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self.workspace_device = workspace.device
        self.kv_indices_read: list[int] = []  # data_ptr of the page ids each run read

    def plan(self, *, metadata: PlanMetadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale,
             q_data_type, kv_data_type, query_layout, kv_cache_layout) -> None:
        assert (query_layout, kv_cache_layout) == ("split", "split")
        fields = (metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices, metadata.kv_len_arr)
        for t in fields:
            assert t.dtype == torch.int32 and t.is_contiguous() and t.dim() == 1
        for t in (metadata.qo_indptr, metadata.kv_indptr, metadata.kv_len_arr):
            assert t.device.type == "cpu", "the planner reads these on the host: device tensors would sync"
        pages = (metadata.kv_len_arr.long() + page_size - 1) // page_size
        assert torch.equal(pages, metadata.kv_indptr.diff().long()), "FlashInfer refuses this page count"
        if self.use_cuda_graph:
            for i, (buffer, source) in enumerate(zip(self.buffers, fields, strict=True)):
                assert buffer.dtype == torch.int32 and buffer.is_contiguous() and buffer.device == self.workspace_device
                assert buffer.shape[0] >= source.shape[0] if i == 2 else buffer.shape == source.shape, \
                    "CUDA graph reserved buffer has insufficient or incompatible capacity"
                buffer[: source.shape[0]].copy_(source)
            planner = FakeCompiledPlanner()
            size = metadata.kv_len_arr.numel()
            backend = self._planned_backend = FakePlannedBackend(planner, [], size)
            int_workspace, pinned = backend._int_workspace_buffer, backend._pin_memory_int_workspace_buffer
            backend._plan_info, staged = planner.plan(
                backend._float_workspace_buffer, int_workspace, pinned, metadata.qo_indptr, metadata.kv_indptr,
                metadata.kv_len_arr, num_heads, head_dim_ckv, causal)
            int_workspace[:staged].copy_(pinned[:staged])
            metadata = PlanMetadata(metadata.qo_indptr.clone(), metadata.kv_indptr.clone(), self.buffers[2],
                                    metadata.kv_len_arr.clone())
        self.meta, self.causal, self.sm_scale, self.num_heads = metadata, causal, sm_scale, num_heads
        self.dims, self.dtypes = (head_dim_ckv, head_dim_kpe), (q_data_type, kv_data_type)
        self.plans += 1

    def run(self, *, query: tuple[torch.Tensor, torch.Tensor], kv_cache: tuple[torch.Tensor, torch.Tensor]
            ) -> torch.Tensor:
        (q_nope, q_pe), (ckv, kpe) = query, kv_cache
        assert type(query) is tuple and type(kv_cache) is tuple
        assert all(t.stride(-1) == 1 for t in (q_nope, q_pe, ckv, kpe))
        assert q_nope.dtype == self.dtypes[0] and ckv.dtype == self.dtypes[1] and q_nope.shape[1] == self.num_heads
        qo, kv = self.meta.qo_indptr.tolist(), self.meta.kv_indptr.tolist()
        indices, lens = self.meta.kv_indices.long(), self.meta.kv_len_arr.tolist()
        if self.use_cuda_graph:  # the schedule as the device holds it, whoever planned it
            size = len(lens)
            schedule = self._planned_backend._int_workspace_buffer.view(torch.int32).tolist()
            qo, kv, lens = schedule[: size + 1], schedule[size + 1: 2 * size + 2], schedule[2 * size + 2: 3 * size + 2]
        self.kv_indices_read.append(self.meta.kv_indices.data_ptr())
        out = torch.empty_like(q_nope)
        for b, kv_len in enumerate(lens):
            pages = indices[kv[b]:kv[b + 1]]
            latent = ckv[pages].reshape(-1, ckv.shape[-1])[:kv_len]
            rope = kpe[pages].reshape(-1, kpe.shape[-1])[:kv_len]
            rows = slice(qo[b], qo[b + 1])
            q = torch.cat([q_nope[rows], q_pe[rows]], dim=-1)
            o, _ = dense_attention(q, torch.cat([latent, rope], -1)[:, None], latent[:, None], self.sm_scale,
                                   self.causal)
            out[rows] = o.to(out.dtype)
        return out


class FakeRaggedWrapper:
    """BatchPrefillWithRaggedKVCacheWrapper's contract: base-2 lse from the kernel, ln on request."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str, *, backend: str) -> None:
        assert kv_layout == "NHD"
        self.backend, self.plans = backend, 0

    def plan(self, *, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, causal, sm_scale,
             q_data_type, kv_data_type) -> None:
        assert qo_indptr.dtype == kv_indptr.dtype == torch.int32 and num_qo_heads == num_kv_heads
        self.q_lens, self.kv_lens = qo_indptr.diff().tolist(), kv_indptr.diff().tolist()
        self.causal, self.sm_scale, self.dims = causal, sm_scale, (head_dim_qk, head_dim_vo)
        self.plans += 1

    def run(self, q, k, v, *, return_lse: bool, lse_base: str) -> tuple[torch.Tensor, torch.Tensor]:
        assert return_lse and (q.shape[2], v.shape[2]) == self.dims
        out, lse = ragged_attention(q, k, v, self.q_lens, self.kv_lens, self.sm_scale, self.causal)
        lse2 = lse * LOG2E  # the kernel's base 2
        return out, lse2 * LN2 if lse_base == "ln" else lse2


class FakeEvent:
    def __init__(self) -> None:
        self.synchronized = 0

    def record(self, stream: object) -> None:
        pass

    def synchronize(self) -> None:
        self.synchronized += 1


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = ModuleType("flashinfer")
    module.BatchMLAPagedAttentionWrapper = FakeMLAWrapper  # type: ignore[attr-defined]
    module.BatchPrefillWithRaggedKVCacheWrapper = FakeRaggedWrapper  # type: ignore[attr-defined]
    module.mla = SimpleNamespace(MLAPlanMetadata=PlanMetadata)  # type: ignore[attr-defined]
    module.merge_state = emulated_merge_state  # type: ignore[attr-defined]
    module.cascade = SimpleNamespace(get_cascade_module=lambda: None)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    # The backend orders re-plans after the previous upload with CUDA events; there is no CUDA here.
    monkeypatch.setattr(flashinfer_mla.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(flashinfer_mla.torch.cuda, "current_stream", lambda device=None: None)
    return module


DTYPE = torch.bfloat16
HEADS = 4


def _spec(page_size: int | None = None) -> AttentionSpec:
    return AttentionSpec(num_heads=HEADS, dtype=DTYPE, page_size=page_size)


MLA_CASES = {
    "decode": (ForwardMode.DECODE, [1, 17, 64, 100], [1, 1, 1, 1]),
    "verify": (ForwardMode.TARGET_VERIFY, [10, 33], [4, 4]),
    "draft_extend": (ForwardMode.DRAFT_EXTEND, [12, 40], [3, 2]),
    "extend": (ForwardMode.EXTEND, [20, 50, 9], [5, 13, 9]),
}


@pytest.mark.usefixtures("fake_flashinfer")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", list(MLA_CASES))
def test_forward_mla_wiring(case: str, page_size: int) -> None:
    mode, seq_lens, extend_lens = MLA_CASES[case]
    spec = _spec(page_size)
    batch = random_batch(mode, seq_lens, extend_lens, spec, CPU, num_layers=2)
    batch.attn_method = AttnForwardMethod.MLA
    backend, reference = FlashInferMLAAttention(spec, CPU), TorchRefAttention(spec, CPU)
    t = batch.num_tokens
    latent, k_rope = torch.randn(t, spec.kv_lora_rank, dtype=DTYPE), torch.randn(t, spec.qk_rope_head_dim, dtype=DTYPE)
    # q_nope as the model makes it: a transposed bmm output (strides (R, T*R, 1)).
    q_nope = torch.randn(HEADS, t, spec.kv_lora_rank, dtype=DTYPE).transpose(0, 1)
    q_rope = torch.randn(t, HEADS, spec.qk_rope_head_dim, dtype=DTYPE)
    backend.plan(batch)
    backend.set_kv(1, batch.out_cache_loc, latent, k_rope)
    out = backend.forward_mla(q_nope, q_rope, 1)
    reference.plan(batch)
    assert_close(out, reference.forward_mla(q_nope, q_rope, 1), DTYPE, f"forward_mla {case}")
    wrapper = backend._mla
    assert wrapper.backend == "fa2" and wrapper.causal == (max(extend_lens) > 1)
    assert wrapper.num_heads == HEADS and wrapper.dims == (512, 64) and wrapper.dtypes == (DTYPE, DTYPE)
    assert wrapper.sm_scale == spec.softmax_scale
    with pytest.raises(ValueError, match="planned for absorbed MLA"):
        backend.forward_mha(q_rope, q_rope, q_rope)


MHA_CASES = {
    "causal": (AttnForwardMethod.MHA, [0, 0, 0], [1, 9, 40], 1 << 30),
    "one_shot_prefix": (AttnForwardMethod.MHA, [40, 0, 65], [10, 5, 1], 1 << 30),
    "chunked_prefix": (AttnForwardMethod.MHA_CHUNKED_KV, [100, 0, 37], [5, 9, 3], 32),
}


@pytest.mark.parametrize("case", list(MHA_CASES))
def test_forward_mha_and_merge_wiring(case: str, fake_flashinfer: ModuleType) -> None:
    method, prefix_lens, extend_lens, capacity = MHA_CASES[case]
    spec = _spec()
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    batch = random_batch(ForwardMode.EXTEND, seq_lens, extend_lens, spec, CPU, num_layers=1)
    prepare_attention(batch, chunked_prefix_cache_threshold=1, prefix_chunk_capacity=capacity)
    assert batch.attn_method is method
    backend, reference = FlashInferMLAAttention(spec, CPU), TorchRefAttention(spec, CPU)
    backend.plan(batch)
    reference.plan(batch)
    keys = [torch.randn(s, HEADS, spec.qk_head_dim, dtype=DTYPE) for s in seq_lens]
    values = [torch.randn(s, HEADS, spec.v_head_dim, dtype=DTYPE) for s in seq_lens]
    q = torch.randn(batch.num_tokens, HEADS, spec.qk_head_dim, dtype=DTYPE)

    def call(kv_slices: list[slice], chunk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([kb[s] for kb, s in zip(keys, kv_slices, strict=True)])
        # v as the model makes it: a split view of kv_b_proj's output (not contiguous).
        v = torch.cat([torch.cat([vb[s], vb[s]], dim=-1) for vb, s in zip(values, kv_slices, strict=True)])
        v = v[..., : spec.v_head_dim]
        out, lse = backend.forward_mha(q, k, v, prefix_chunk=chunk)
        ref_out, ref_lse = reference.forward_mha(q, k, v, prefix_chunk=chunk)
        assert_close(out, ref_out, DTYPE, f"{case} chunk {chunk} out")
        assert_lse_close(lse, ref_lse, DTYPE, f"{case} chunk {chunk} lse")
        return out, lse

    if method is AttnForwardMethod.MHA:
        call([slice(None)] * len(seq_lens), None)
        assert len(backend._ragged) == 1 and backend._ragged[0].causal
        return
    out, lse = call([slice(p, None) for p in prefix_lens], None)
    assert len(batch.prefix_chunks) > 1 and len(backend._ragged) == 1 + len(batch.prefix_chunks)
    assert [w.causal for w in backend._ragged] == [True] + [False] * len(batch.prefix_chunks)
    for i, chunk in enumerate(batch.prefix_chunks):
        chunk_slices = [slice(s, s + n) for s, n in zip(chunk.starts_cpu, chunk.lens_cpu, strict=True)]
        out, lse = backend.merge_attn_states(out, lse, *call(chunk_slices, i))
    whole_out, whole_lse = ragged_attention(q, torch.cat(keys), torch.cat(values), extend_lens, seq_lens,
                                            spec.softmax_scale, causal=True)
    assert_close(out, whole_out, DTYPE, f"{case} merged over all chunks")
    assert_lse_close(lse, whole_lse, DTYPE, f"{case} merged lse")
    with pytest.raises(ValueError, match="out of range"):
        backend.forward_mha(q, q, q, prefix_chunk=len(batch.prefix_chunks))
    with pytest.raises(ValueError, match=r"k must be \[17, 4, 192\] and v \[17, 4, 128\]"):
        backend.forward_mha(q, q, q)  # v of the qk width
    with pytest.raises(ValueError, match="planned for MHA"):
        backend.forward_mla(torch.zeros(batch.num_tokens, HEADS, 512, dtype=DTYPE),
                            torch.zeros(batch.num_tokens, HEADS, 64, dtype=DTYPE), 0)


@pytest.mark.usefixtures("fake_flashinfer")
def test_wrappers_are_planned_once_per_forward_and_reused() -> None:
    spec = _spec(16)
    backend = FlashInferMLAAttention(spec, CPU)
    for _ in range(2):
        decode = random_batch(ForwardMode.DECODE, [5, 70], [1, 1], spec, CPU, num_layers=3)
        backend.plan(decode)
        for layer in range(3):
            backend.forward_mla(torch.randn(2, HEADS, 512, dtype=DTYPE), torch.randn(2, HEADS, 64, dtype=DTYPE), layer)
    assert backend._mla.plans == 2 and not backend._ragged  # decode plans no ragged wrapper
    prefill = random_batch(ForwardMode.EXTEND, [300, 8], [5, 8], spec, CPU, num_layers=1)
    prepare_attention(prefill, chunked_prefix_cache_threshold=1, prefix_chunk_capacity=64)
    backend.plan(prefill)
    wrappers = list(backend._ragged)
    events = [backend._uploads[id(w)] for w in wrappers]
    backend.plan(prefill)
    assert backend._ragged == wrappers and all(w.plans == 2 for w in wrappers)
    assert all(e.synchronized == 1 for e in events)  # each re-plan waited for its wrapper's last upload
    assert backend._mla.plans == 2


# -- CUDA graphs: init_cuda_graph / plan_capture / plan_replay against the stand-in -------------------


def _graph_pool(num_pages: int, page_size: int) -> MLAKVPool:
    pool = MLAKVPool(2, num_pages, page_size, 512, 64, DTYPE, CPU)
    for layer in range(2):
        pool.buffer(layer).copy_(torch.randn(pool.num_slots, 576))
    return pool


def _real_batch(mode: ForwardMode, seq_lens: list[int], per_request: int, pool: MLAKVPool) -> ForwardBatch:
    """Requests on shuffled pages of `pool`, never its last page (the graphs' padding page)."""
    order = torch.randperm(pool.num_pages - 1).tolist()
    pages = [[order.pop() for _ in range(pages_needed(s, pool.page_size))] for s in seq_lens]
    table = torch.tensor([p + [p[0]] * (max(map(len, pages)) - len(p)) for p in pages], dtype=torch.int32)
    batch = ForwardBatch.build(mode, seq_lens, [per_request] * len(seq_lens), table, pool)
    batch.attn_method = AttnForwardMethod.MLA
    return batch


@pytest.mark.usefixtures("fake_flashinfer")
@pytest.mark.parametrize(("mode", "per_request"), [(ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 3)])
def test_cuda_graph_capture_and_replay(mode: ForwardMode, per_request: int) -> None:
    """One graph-mode wrapper per captured size over the fixed buffers; every replay re-plans it in place:
    the page ids of real and padding rows into the fixed kv_indices, which the run reads (as the captured
    kernel would), and the output of the real rows is the reference's."""
    page_size, max_bs, max_pages = 16, 4, 6
    spec = _spec(page_size)
    assert mode in FlashInferMLAAttention.capabilities.graph_modes
    pool = _graph_pool(max_bs * max_pages + 1, page_size)
    padding_page = pool.num_pages - 1
    inputs = GraphInputs(max_bs, per_request, max_pages, pool, padding_page)
    backend, reference = FlashInferMLAAttention(spec, CPU), TorchRefAttention(spec, CPU)
    with pytest.raises(RuntimeError, match="before init_cuda_graph"):
        backend.plan_capture(inputs.batch(mode, max_bs))
    backend.init_cuda_graph(max_bs, max_bs * per_request, max_pages)
    kv_indices = backend._graph.kv_indices
    assert kv_indices.shape == (max_bs * max_pages,) and kv_indices.dtype == torch.int32
    wrappers = {}
    for size in (max_bs, 2):  # largest first, as the runner captures
        backend.plan_capture(inputs.batch(mode, size))
        wrapper = wrappers[size] = backend.plan_state.mla
        assert wrapper is not backend._mla and wrapper.use_cuda_graph and wrapper.backend == "fa2"
        qo, kv, indices, lens = wrapper.buffers
        assert qo.shape == kv.shape == (size + 1,) and lens.shape == (size,) and indices is kv_indices
        assert wrapper.causal == (per_request > 1)
    with pytest.raises(RuntimeError, match="plan_capture made no graph wrapper"):
        backend.plan_replay(inputs.batch(mode, 1))

    for seq_lens, size in (([70, 3, 33], max_bs), ([80, 17], 2), ([5], 2), ([90, 1 + per_request], max_bs)):
        real = _real_batch(mode, seq_lens, per_request, pool)
        static = inputs.load(torch.zeros(real.num_tokens, dtype=torch.int64), real, size)
        wrapper = wrappers[size]
        planner = wrapper._planned_backend._cached_module._module
        plans, calls, upload = wrapper.plans, planner.calls, backend._uploads.get(id(wrapper))
        waits = upload.synchronized if upload is not None else 0
        backend.plan_replay(static)
        # Straight through the compiled planner, after the previous upload out of its pinned buffer ran.
        assert backend.plan_state.mla is wrapper and (wrapper.plans, planner.calls) == (plans, calls + 1)
        assert upload is None or upload.synchronized == waits + 1
        assert backend._uploads[id(wrapper)] is not upload  # this re-plan's upload, awaited by the next
        # Real rows' pages, then one padding page per padding row (seq_len = per_request), in the fixed buffer.
        expected = paged_kv_indices(real.block_table, seq_lens, page_size).kv_indices.tolist()
        expected += [padding_page] * (size - len(seq_lens))
        assert kv_indices[: len(expected)].tolist() == expected
        t, n = static.num_tokens, real.num_tokens
        latent, k_rope = torch.randn(t, 512, dtype=DTYPE), torch.randn(t, 64, dtype=DTYPE)
        q_nope, q_rope = torch.randn(t, HEADS, 512, dtype=DTYPE), torch.randn(t, HEADS, 64, dtype=DTYPE)
        backend.set_kv(1, static.out_cache_loc, latent, k_rope)
        out = backend.forward_mla(q_nope, q_rope, 1)
        assert wrapper.kv_indices_read[-1] == kv_indices.data_ptr()  # the run reads the fixed buffer
        reference.plan(real)
        assert_close(out[:n], reference.forward_mla(q_nope[:n], q_rope[:n], 1), DTYPE, f"replay {seq_lens}")

    decode = random_batch(ForwardMode.DECODE, [40, 9], [1, 1], spec, CPU)
    backend.plan(decode)  # eager forwards keep their own wrapper
    assert backend.plan_state.mla is backend._mla and not backend._mla.use_cuda_graph


@pytest.mark.usefixtures("fake_flashinfer")
def test_graph_replan_refuses_a_new_launch_layout_and_falls_back_without_the_compiled_planner() -> None:
    """A re-plan may change only the schedule a captured launch reads: a planner returning another plan_info
    is an error. A FlashInfer not laid out as 0.7.2.post1 (no compiled planner) is re-planned through
    wrapper.plan."""
    page_size, size, max_pages = 16, 2, 4
    pool = _graph_pool(size * max_pages + 1, page_size)
    inputs = GraphInputs(size, 1, max_pages, pool, pool.num_pages - 1)
    backend = FlashInferMLAAttention(_spec(page_size), CPU)
    backend.init_cuda_graph(size, size, max_pages)
    backend.plan_capture(inputs.batch(ForwardMode.DECODE, size))
    wrapper = backend.plan_state.mla
    real = _real_batch(ForwardMode.DECODE, [30, 7], 1, pool)
    static = inputs.load(torch.zeros(2, dtype=torch.int64), real, size)
    wrapper._planned_backend._cached_module._module.layout = 1
    with pytest.raises(RuntimeError, match="another launch layout"):
        backend.plan_replay(static)
    del wrapper._planned_backend
    plans = wrapper.plans
    backend.plan_replay(static)
    assert wrapper.plans == plans + 1
