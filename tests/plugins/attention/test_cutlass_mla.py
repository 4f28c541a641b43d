"""The cutlass_mla backend on the CPU: declaration, capabilities, availability reasons, the argument and
layout code (query packing and scaling, per-token page-table rows, workspace sizing against CUTLASS's
split heuristic), and the whole forward through a fake FlashInfer whose run() computes what the CUTLASS
kernel computes (fixed scale, 128 heads, one query per row, pages through the table), against the torch
reference."""

from __future__ import annotations

import math
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from plugserve.conformance.batches import random_batch
from plugserve.conformance.tolerances import assert_close
from plugserve.core.dispatch import prepare_attention
from plugserve.core.forward_batch import ForwardBatch, ForwardMode, Phase
from plugserve.core.graph_inputs import GraphInputs
from plugserve.core.hardware import Hardware
from plugserve.core.kv_cache import MLAKVPool, pages_needed
from plugserve.core.specs import AttentionSpec
from plugserve.plugins.attention.cutlass_mla import (
    KERNEL_HEADS,
    KERNEL_SM_SCALE,
    CutlassMLAAttention,
    pack_query,
    query_scale,
    token_rows,
    workspace_bytes,
)
from plugserve.plugins.attention.torch_ref import TorchRefAttention
from plugserve.registry import Registry

CPU = torch.device("cpu")
H100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 << 30, 132)
B200 = Hardware("cuda", "NVIDIA B200", (10, 0), 180 << 30, 148)
RTX5090 = Hardware("cuda", "NVIDIA GeForce RTX 5090", (12, 0), 32 << 30, 170)
LAYER = 1
V3_YARN_SCALE = (0.1 * math.log(40) + 1) ** 2 / math.sqrt(192)  # DeepSeek-V3: mscale_all_dim 1, factor 40


def test_declaration_and_registration() -> None:
    CutlassMLAAttention.check_declaration()
    registry = Registry(builtin=("plugserve.plugins.attention.cutlass_mla",), entry_points=False)
    assert not registry.broken and set(registry.backends["attention"]) == {"cutlass_mla"}


def test_capabilities() -> None:
    caps = CutlassMLAAttention.capabilities
    assert caps.phases() == {Phase.DECODE}
    assert caps.mla_modes == {ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}
    assert caps.forced_page_size() == 128
    assert caps.check(AttentionSpec(), Phase.DECODE)  # DeepSeek-V3, the pool's page size not yet chosen
    assert caps.check(AttentionSpec(page_size=128, num_heads=16), Phase.DECODE)  # V2-Lite / TP shards: padded
    assert "page size 64" in caps.check(AttentionSpec(page_size=64), Phase.DECODE).reason
    assert "256 heads" in caps.check(AttentionSpec(num_heads=256), Phase.DECODE).reason
    assert "kv_lora_rank 256" in caps.check(AttentionSpec(kv_lora_rank=256), Phase.DECODE).reason
    assert "float32" in caps.check(AttentionSpec(dtype=torch.float32), Phase.DECODE).reason
    assert "does not run prefill" in caps.check(AttentionSpec(), Phase.PREFILL).reason


def test_availability() -> None:
    assert "not cpu" in CutlassMLAAttention.availability(Hardware.detect(CPU)).reason
    assert "needs sm100 or newer, this GPU is sm90" in CutlassMLAAttention.availability(H100).reason
    assert "up to sm110" in CutlassMLAAttention.availability(RTX5090).reason
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        reason = CutlassMLAAttention.availability(B200).reason
        assert "flashinfer is not installed" in reason and "pip install flashinfer-python==0.7.2.post1" in reason


def test_availability_names_an_old_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    old = ModuleType("flashinfer")
    old.__version__ = "0.2.6"
    old.mla = ModuleType("flashinfer.mla")
    monkeypatch.setitem(sys.modules, "flashinfer", old)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", old.mla)
    reason = CutlassMLAAttention.availability(B200).reason
    assert "flashinfer 0.2.6 is too old" in reason and "MLAPlanMetadata" in reason


def test_query_scale() -> None:
    assert query_scale(1 / math.sqrt(192)) == 1.0  # V2-Lite, V2 without YaRN: a plain copy
    assert KERNEL_SM_SCALE * query_scale(V3_YARN_SCALE) == pytest.approx(V3_YARN_SCALE, rel=1e-12)


@pytest.mark.parametrize("heads", [16, KERNEL_HEADS])
@pytest.mark.parametrize("scale", [1.0, query_scale(V3_YARN_SCALE)])
def test_pack_query(heads: int, scale: float) -> None:
    t, rank, rope = 5, 512, 64
    q_nope = torch.randn(heads, t, rank, dtype=torch.bfloat16).transpose(0, 1)  # strided, as the model's bmm gives
    q_rope = torch.randn(t, heads, 192, dtype=torch.bfloat16)[:, :, 128:]
    out = torch.zeros(t, KERNEL_HEADS, rank + rope, dtype=torch.bfloat16)
    assert pack_query(q_nope, q_rope, out, scale) is out
    expected = torch.cat([q_nope, q_rope], dim=-1) * scale  # one rounding to bf16, as the kernel's input
    assert torch.equal(out[:, :heads], expected)
    assert torch.all(out[:, heads:] == 0)


def test_token_rows() -> None:
    page = 128
    seq_lens, extend_lens = [1, 300, 129, 700], [1, 3, 2, 1]
    spec = AttentionSpec(num_heads=4, page_size=page)
    batch = random_batch(ForwardMode.TARGET_VERIFY, seq_lens, extend_lens, spec, CPU, num_layers=1)
    width = 3  # enough for the longest row actually read (700 keys would need 6; cut for the test)
    table, kv_lens = token_rows(batch.block_table, batch.extend_lens, batch.positions, batch.num_tokens, width)
    assert table.dtype == kv_lens.dtype == torch.int32 and table.is_contiguous() and table.shape == (7, width)
    rows = []
    for b, (s, e) in enumerate(zip(seq_lens, extend_lens, strict=True)):
        rows += [(batch.block_table[b, :width], position + 1) for position in range(s - e, s)]
    assert torch.equal(table, torch.stack([r for r, _ in rows]))
    assert kv_lens.tolist() == [n for _, n in rows]


def cutlass_split_kv(batch: int, max_seq_len: int, sm_count: int) -> int:
    """CUTLASS's MLA::set_split_kv (sm100_mla.hpp, FlashInfer 0.7.2.post1), transcribed."""
    max_splits = -(-max_seq_len // 128)
    sms_per_batch = max(1, sm_count // max(1, batch * 2))
    split_heur = min(max_splits, sms_per_batch)
    k_waves = -(-max_splits // split_heur)
    return -(-max_splits // k_waves)


@pytest.mark.parametrize("sm_count", [148, 132, 20])
def test_workspace_covers_every_split(sm_count: int) -> None:
    for rows in [*range(1, 80), 128, 257, 1024]:
        needed = [(4 * 512 + 4) * 128 * cutlass_split_kv(rows, k, sm_count) * rows
                  for k in range(128, 128 * 300, 128)]  # the kernel's own get_workspace_size
        assert max(needed) == workspace_bytes(rows, sm_count), rows  # covered, and not more than the worst


class FakeWrapper:
    """FlashInfer's BatchMLAPagedAttentionWrapper(backend="cutlass") as far as this backend uses it: plan()
    checks the CUTLASS plan contract; run() checks the launch contract and computes what the kernel does."""

    def __init__(self, workspace: torch.Tensor, backend: str) -> None:
        assert backend == "cutlass"
        self.workspace = workspace
        self.plans = 0
        self.runs: list[tuple[int, int, int]] = []  # data_ptr of query, page table and kv_lens of each run

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
             kv_data_type) -> None:
        assert (num_heads, head_dim_ckv, head_dim_kpe) == (128, 512, 64)
        assert sm_scale == pytest.approx(1 / math.sqrt(128 + head_dim_kpe), rel=1e-5)  # the kernel's fixed scale
        assert q_data_type == kv_data_type and page_size == 128
        cu, table, kv_lens = metadata.cum_seq_lens_q, metadata.block_tables, metadata.seq_lens
        for tensor in (cu, table, kv_lens):
            assert tensor.dtype == torch.int32 and tensor.is_contiguous()
        assert torch.all(cu[1:] - cu[:-1] == 1), "one query token per row"
        assert table.shape[0] == kv_lens.shape[0] == cu.shape[0] - 1
        assert int(((kv_lens + page_size - 1) // page_size).max()) <= table.shape[1]
        rows = table.shape[0]
        assert self.workspace.numel() >= (4 * 512 + 4) * 128 * cutlass_split_kv(rows, table.shape[1] * 128, 148) * rows
        self.table, self.kv_lens, self.plans = table, kv_lens, self.plans + 1

    def run(self, *, query: torch.Tensor, kv_cache: torch.Tensor, kv_len: torch.Tensor | None = None,
            page_table: torch.Tensor | None = None) -> torch.Tensor:
        assert (kv_len is None) == (page_table is None), "kv_len and page_table: both or neither"
        table = self.table if page_table is None else page_table
        kv_lens = self.kv_lens if kv_len is None else kv_len
        rows = self.table.shape[0]  # the planned batch size
        assert query.shape == (rows, 128, 576) and query.is_contiguous()
        assert table.dtype == kv_lens.dtype == torch.int32 and table.shape[0] == kv_lens.shape[0] == rows
        assert kv_cache.shape[1:] == (128, 576) and kv_cache.is_contiguous()
        # Split by the table's width (sm100_mla.hpp): the workspace must hold that split's partials.
        assert self.workspace.numel() >= (4 * 512 + 4) * 128 * cutlass_split_kv(rows, table.shape[1] * 128, 148) * rows
        self.runs.append((query.data_ptr(), table.data_ptr(), kv_lens.data_ptr()))
        out = torch.empty(rows, 128, 512, dtype=query.dtype)
        for row in range(rows):
            n = int(kv_lens[row])
            positions = torch.arange(n)
            keys = kv_cache[table[row, positions // 128].long(), positions % 128].float()  # [n, 576]
            probs = torch.softmax(query[row].float() @ keys.T * KERNEL_SM_SCALE, dim=-1)
            out[row] = (probs @ keys[:, :512]).to(query.dtype)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    metadata = SimpleNamespace(dense=lambda cu, table, lens: SimpleNamespace(
        cum_seq_lens_q=cu, block_tables=table, seq_lens=lens))
    mla = ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper, mla.MLAPlanMetadata = FakeWrapper, metadata
    package = ModuleType("flashinfer")
    package.mla = mla
    modules = sys.modules
    monkeypatch.setitem(modules, "flashinfer", package)
    monkeypatch.setitem(modules, "flashinfer.mla", mla)
    monkeypatch.setattr(Hardware, "detect", classmethod(lambda cls, device=None: B200))


CASES = {
    "decode": (ForwardMode.DECODE, [1, 300, 129, 40], [1, 1, 1, 1]),
    "target_verify": (ForwardMode.TARGET_VERIFY, [5, 260], [4, 4]),
    "draft_extend": (ForwardMode.DRAFT_EXTEND, [12, 130], [3, 1]),
}


@pytest.mark.parametrize("heads", [16, KERNEL_HEADS])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_through_the_kernel_contract(fake_flashinfer, case: str, heads: int) -> None:
    mode, seq_lens, extend_lens = CASES[case]
    spec = AttentionSpec(num_heads=heads, dtype=torch.bfloat16, page_size=128, sm_scale=V3_YARN_SCALE)
    batch = random_batch(mode, seq_lens, extend_lens, spec, CPU)
    prepare_attention(batch)
    backend, reference = CutlassMLAAttention(spec, CPU), TorchRefAttention(spec, CPU)
    backend.plan(batch)
    reference.plan(batch)
    t = batch.num_tokens
    backend.set_kv(LAYER, batch.out_cache_loc, torch.randn(t, 512), torch.randn(t, 64))
    q_nope = torch.randn(heads, t, 512, dtype=torch.bfloat16).transpose(0, 1)
    q_rope = torch.randn(t, heads, 192, dtype=torch.bfloat16)[:, :, 128:]
    out = backend.forward_mla(q_nope, q_rope, LAYER)
    assert out.shape == (t, heads, 512) and out.dtype == torch.bfloat16
    assert_close(out, reference.forward_mla(q_nope, q_rope, LAYER), torch.bfloat16, f"cutlass_mla {case}")
    with pytest.raises(ValueError, match="activation dtype"):
        backend.forward_mla(q_nope.float(), q_rope.float(), LAYER)


def test_plan_refuses_other_page_sizes(fake_flashinfer) -> None:
    spec = AttentionSpec(num_heads=16, page_size=64)
    batch = random_batch(ForwardMode.DECODE, [70], [1], spec, CPU, num_layers=1)
    with pytest.raises(ValueError, match="pages of 128 tokens"):
        CutlassMLAAttention(spec, CPU).plan(batch)


def real_batch(mode: ForwardMode, seq_lens: list[int], per_request: int, pool: MLAKVPool) -> ForwardBatch:
    """Requests on shuffled pages of `pool`, never its last page (the graphs' padding page)."""
    order = torch.randperm(pool.num_pages - 1).tolist()
    pages = [[order.pop() for _ in range(pages_needed(s, pool.page_size))] for s in seq_lens]
    table = torch.tensor([p + [p[0]] * (max(map(len, pages)) - len(p)) for p in pages], dtype=torch.int32)
    return ForwardBatch.build(mode, seq_lens, [per_request] * len(seq_lens), table, pool)


@pytest.mark.parametrize(("mode", "per_request"), [(ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 3)])
def test_cuda_graph_capture_and_replay(fake_flashinfer, mode: ForwardMode, per_request: int) -> None:
    """Each captured size plans its own wrapper once, over leading rows of the fixed buffers (page table at the
    full width); plan_replay plans nothing and rewrites those rows in place (padding rows: the padding page,
    kv_len = position + 1); every run reads the same addresses, and the real rows match the reference."""
    heads, max_bs, max_pages = 16, 4, 3
    spec = AttentionSpec(num_heads=heads, dtype=torch.bfloat16, page_size=128, sm_scale=V3_YARN_SCALE)
    assert mode in CutlassMLAAttention.capabilities.graph_modes
    pool = MLAKVPool(2, max_bs * max_pages + 1, 128, 512, 64, torch.bfloat16, CPU)
    for layer in range(2):
        pool.buffer(layer).copy_(torch.randn(pool.num_slots, 576))
    padding_page = pool.num_pages - 1
    inputs = GraphInputs(max_bs, per_request, max_pages, pool, padding_page)
    backend, reference = CutlassMLAAttention(spec, CPU), TorchRefAttention(spec, CPU)
    max_rows = max_bs * per_request
    backend.init_cuda_graph(max_bs, max_rows, max_pages)
    assert backend._graph_workspace.numel() == max(workspace_bytes(n, 148) for n in range(1, max_rows + 1))

    def forward(static: ForwardBatch, real: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        t, n = static.num_tokens, real.num_tokens
        backend.set_kv(LAYER, static.out_cache_loc, torch.randn(t, 512), torch.randn(t, 64))
        q_nope = torch.randn(t, heads, 512, dtype=torch.bfloat16)
        q_rope = torch.randn(t, heads, 64, dtype=torch.bfloat16)
        out = backend.forward_mla(q_nope, q_rope, LAYER)
        reference.plan(real)
        return out[:n], reference.forward_mla(q_nope[:n], q_rope[:n], LAYER)

    captured = {}
    for size in (max_bs, 2):  # largest first, as the runner captures
        static = inputs.batch(mode, size)
        backend.plan_capture(static)
        wrapper = backend.plan_state.wrapper
        assert wrapper.plans == 1 and wrapper.workspace is backend._graph_workspace
        assert wrapper.table.shape == (size * per_request, max_pages)  # the full width: a split fixed at capture
        forward(static, static)
        captured[size] = wrapper, wrapper.runs[-1]

    for seq_lens, size in (([300, 3, 129], max_bs), ([256 + per_request], 2), ([5], 2)):
        real = real_batch(mode, seq_lens, per_request, pool)
        static = inputs.load(torch.zeros(real.num_tokens, dtype=torch.int64), real, size)
        backend.plan_replay(static)
        wrapper, addresses = captured[size]
        assert backend.plan_state.wrapper is wrapper and wrapper.plans == 1  # no plan (it syncs) in a replay
        n = real.num_tokens
        assert backend.plan_state.kv_lens.tolist() == (static.positions + 1).tolist()
        assert torch.all(backend.plan_state.page_table[n:] == padding_page)  # padding rows read the padding page only
        assert backend.plan_state.page_table[:n, : real.block_table.shape[1]].tolist() == (
            real.block_table.repeat_interleave(per_request, dim=0).tolist())
        out, expected = forward(static, real)
        assert wrapper.runs[-1] == addresses  # what the captured kernel reads, at the captured addresses
        assert_close(out, expected, torch.bfloat16, f"replay {seq_lens}")

    eager = random_batch(ForwardMode.DECODE, [70, 9], [1, 1], spec, CPU)
    backend.plan(eager)  # eager forwards keep their own wrapper and workspace
    assert backend.plan_state.wrapper is backend._wrapper and backend._wrapper.workspace is not backend._graph_workspace
