"""The FlashMLA backend on the CPU: declaration, availability texts, the layout helpers against independent
torch code, and the whole wrapper run against the torch reference through a torch stand-in for `flash_mla`
that follows FlashMLA 9241ae3's dense decode API and argument checks. The real kernels run in the kit on sm90."""

from __future__ import annotations

import math
import sys
import textwrap
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from plugserve.conformance.batches import random_batch
from plugserve.conformance.tolerances import assert_close
from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode, Phase
from plugserve.core.graph_inputs import GraphInputs
from plugserve.core.hardware import Hardware
from plugserve.core.kv_cache import MLAKVPool, pages_needed, token_slots
from plugserve.core.specs import AttentionSpec
from plugserve.plugins.attention import flashmla
from plugserve.plugins.attention.flashmla import (
    FlashMLAAttention,
    flashmla_kv_cache,
    flashmla_output,
    flashmla_query,
    padded_query_rows,
)
from plugserve.plugins.attention.torch_ref import TorchRefAttention

CPU = torch.device("cpu")
LAYER = 1  # not 0: a backend ignoring layer_id reads the wrong buffer


def gpu(capability: tuple[int, int]) -> Hardware:
    return Hardware("cuda", "NVIDIA test GPU", capability, 80 << 30, 132)


@pytest.fixture
def clean_flash_mla(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Whatever a test imports as flash_mla (or below it) is forgotten afterwards."""
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "flash_mla"}
    for name in saved:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [n for n in sys.modules if n.split(".")[0] == "flash_mla"]:
        del sys.modules[name]
    sys.modules.update(saved)


# ----------------------------------------------------------------------------------------------------
# Declaration and availability


def test_declaration_and_hook() -> None:
    FlashMLAAttention.check_declaration()
    assert flashmla.plugserve_backends() == [FlashMLAAttention]
    caps = FlashMLAAttention.capabilities
    assert caps.forced_page_size() == 64
    assert caps.phases() == frozenset({Phase.DECODE})
    assert caps.methods == frozenset({AttnForwardMethod.MLA})
    assert FlashMLAAttention.priority_on(gpu((9, 0))) > 50  # above Triton on Hopper


def test_capabilities_fit_deepseek_v3_only() -> None:
    caps = FlashMLAAttention.capabilities
    assert caps.check(AttentionSpec(), Phase.DECODE)
    assert caps.check(AttentionSpec(page_size=64, num_heads=16), Phase.DECODE)
    assert "page size 16" in caps.check(AttentionSpec(page_size=16), Phase.DECODE).reason
    assert "float16" in caps.check(AttentionSpec(dtype=torch.float16), Phase.DECODE).reason
    assert "kv_lora_rank 256" in caps.check(AttentionSpec(kv_lora_rank=256), Phase.DECODE).reason
    assert "rope head dim 32" in caps.check(AttentionSpec(qk_rope_head_dim=32), Phase.DECODE).reason
    fp8_cache = AttentionSpec(kv_cache_dtype=torch.float8_e4m3fn)
    assert "kv cache dtype" in caps.check(fp8_cache, Phase.DECODE).reason
    assert "does not run prefill" in caps.check(AttentionSpec(), Phase.PREFILL).reason


def test_availability_on_this_cpu_names_the_device_and_the_package(clean_flash_mla: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # not importable, whatever is installed here
    available = FlashMLAAttention.availability(Hardware.detect(CPU))
    assert not available
    assert "runs on cuda, not cpu" in available.reason
    assert "flash_mla is not installed" in available.reason


def test_availability_on_hopper_without_flash_mla(clean_flash_mla: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    reason = FlashMLAAttention.availability(gpu((9, 0))).reason
    assert reason.startswith("flash_mla is not installed; ")
    assert "pip install -v ." in reason and "tools/device/build_flashmla.sh" in reason


def test_availability_names_the_compute_capability(clean_flash_mla: None, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    write_package(tmp_path, monkeypatch, COMPLETE)
    assert FlashMLAAttention.availability(gpu((9, 0)))
    assert FlashMLAAttention.availability(gpu((8, 0))).reason == "needs sm90 or newer, this GPU is sm80"
    assert FlashMLAAttention.availability(gpu((10, 0))).reason == "supports up to sm90, this GPU is sm100"


COMPLETE = """
    def get_mla_metadata(*args, **kwargs): ...
    def flash_mla_with_kvcache(*args, **kwargs): ...
"""


def write_package(root: Path, monkeypatch: pytest.MonkeyPatch, init: str) -> None:
    (root / "flash_mla").mkdir()
    (root / "flash_mla" / "__init__.py").write_text(textwrap.dedent(init))
    monkeypatch.syspath_prepend(str(root))


@pytest.mark.parametrize(("init", "expected"), [
    ("raise ImportError('cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEa')",
     "flash_mla is installed but its CUDA module does not load (cuda.so: undefined symbol"),
    ("import flash_mla.cuda", "flash_mla is installed but does not import (No module named 'flash_mla.cuda')"),
    ("def get_mla_metadata(): ...", "lacks flash_mla_with_kvcache"),
], ids=["abi", "no-module", "old-api"])
def test_availability_of_a_broken_flash_mla(init: str, expected: str, clean_flash_mla: None, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    write_package(tmp_path, monkeypatch, init)
    reason = FlashMLAAttention.availability(gpu((9, 0))).reason
    assert expected in reason, reason


# ----------------------------------------------------------------------------------------------------
# Layout helpers against independent torch code


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [4, 4], [3, 1, 0, 5], [0, 2], [7]])
def test_padded_query_rows(q_lens: list[int]) -> None:
    s_q = max(q_lens)
    expected = [b * s_q + s_q - n + j for b, n in enumerate(q_lens) for j in range(n)]
    rows = padded_query_rows(torch.tensor(q_lens, dtype=torch.int32), sum(q_lens), s_q)
    assert rows.dtype == torch.int64
    assert rows.tolist() == expected


def test_query_and_output_layouts_uniform() -> None:
    b, s_q, h, r, p = 3, 2, 5, 8, 4
    q_nope, q_rope = torch.randn(b * s_q, h, r), torch.randn(b * s_q, h, p)
    q = flashmla_query(q_nope, q_rope, b, s_q, None)
    assert q.shape == (b, s_q, h, r + p) and q.is_contiguous()
    for t in range(b * s_q):
        assert torch.equal(q[t // s_q, t % s_q, :, :r], q_nope[t])
        assert torch.equal(q[t // s_q, t % s_q, :, r:], q_rope[t])
    out = torch.randn(b, s_q, h, r)
    flat = flashmla_output(out, None)
    assert flat.data_ptr() == out.data_ptr()  # a view, no copy
    assert torch.equal(flat, torch.stack([out[t // s_q, t % s_q] for t in range(b * s_q)]))


def test_query_and_output_layouts_padded() -> None:
    q_lens, h, r, p = [3, 1, 0, 2], 4, 8, 4
    b, s_q, t = len(q_lens), max(q_lens), sum(q_lens)
    rows = padded_query_rows(torch.tensor(q_lens), t, s_q)
    # Strided inputs, as the model hands them over (W_UK product head-major, q_rope a slice).
    q_nope = torch.randn(h, t, r).transpose(0, 1)
    q_rope = torch.randn(t, h, p + 3)[..., 3:]
    q = flashmla_query(q_nope, q_rope, b, s_q, rows)
    expected = torch.zeros(b, s_q, h, r + p)
    token = 0
    for req, n in enumerate(q_lens):
        for j in range(n):  # the request's last n rows, in order
            expected[req, s_q - n + j] = torch.cat([q_nope[token], q_rope[token]], dim=-1)
            token += 1
    assert torch.equal(q, expected)
    out = torch.randn(b, s_q, h, r)
    back = flashmla_output(out, rows)
    assert torch.equal(back, torch.cat([out[req, s_q - n:] for req, n in enumerate(q_lens)]))
    assert torch.equal(flashmla_output(q, rows), torch.cat([q_nope, q_rope], dim=-1))  # a round trip


def test_kv_cache_view_with_the_block_table() -> None:
    """Every token FlashMLA reads through k_cache[block_table[b, pos // 64], pos % 64, 0] is pool slot
    token_slots(b, pos), without a copy."""
    spec = AttentionSpec(num_heads=2, page_size=64)
    seq_lens = [1, 64, 65, 200]
    batch = random_batch(ForwardMode.DECODE, seq_lens, [1] * len(seq_lens), spec, CPU)
    buffer = batch.kv_pool.buffer(LAYER)
    k_cache = flashmla_kv_cache(buffer, 64)
    assert k_cache.shape == (batch.kv_pool.num_pages, 64, 1, 576)
    assert k_cache.data_ptr() == buffer.data_ptr()
    for b, n in enumerate(seq_lens):
        positions = torch.arange(n)
        read = k_cache[batch.block_table[b, positions // 64].long(), positions % 64, 0]
        slots = token_slots(batch.block_table, torch.full((n,), b), positions, 64)
        assert torch.equal(read, buffer[slots])


# ----------------------------------------------------------------------------------------------------
# The backend through a torch stand-in for FlashMLA


@dataclass
class SchedMeta:
    config: tuple | None = None


class FakeFlashMLA(types.ModuleType):
    """FlashMLA 9241ae3's dense path in float32 torch: get_mla_metadata returns an empty scheduler object that
    the first flash_mla_with_kvcache call fills and later calls must match; the C++ interface's checks apply.
    Attention per request over its first seq_len cached tokens, causal bottom-right when s_q > 1, a query that
    sees no key gets zeros (FlashMLA's own test reference)."""

    def __init__(self) -> None:
        super().__init__("flash_mla")
        self.metadata_made = 0
        self.metadata_filled = 0
        self.calls: list[tuple[SchedMeta, int, int]] = []  # (metadata, block_table and cache_seqlens data_ptr)

    def get_mla_metadata(self, *args: object, **kwargs: object) -> tuple[SchedMeta, None]:
        self.metadata_made += 1
        return SchedMeta(), None

    def flash_mla_with_kvcache(self, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                               cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata: SchedMeta,
                               num_splits: None = None, softmax_scale: float | None = None, causal: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        b, s_q, h_q, d = q.shape
        _, page, h_k, d_k = k_cache.shape
        assert isinstance(tile_scheduler_metadata, SchedMeta) and num_splits is None
        assert q.dtype == k_cache.dtype == torch.bfloat16 and d == d_k == 576 and head_dim_v == 512
        assert page == 64 and h_k == 1 and q.stride(-1) == 1 and k_cache.stride(-1) == 1
        assert block_table.dtype == cache_seqlens.dtype == torch.int32 and block_table.stride(-1) == 1
        assert block_table.shape[0] == cache_seqlens.shape[0] == b and cache_seqlens.is_contiguous()
        config = (b, s_q, h_q, page, h_k, causal)
        self.calls.append((tile_scheduler_metadata, block_table.data_ptr(), cache_seqlens.data_ptr()))
        if tile_scheduler_metadata.config is None:
            tile_scheduler_metadata.config = config
            self.metadata_filled += 1
        assert tile_scheduler_metadata.config == config, "inconsistent with sched_meta"
        scale = softmax_scale if softmax_scale is not None else d ** -0.5
        out = torch.zeros(b, s_q, h_q, head_dim_v)
        for i in range(b):
            n = int(cache_seqlens[i])
            kv = k_cache[block_table[i, : math.ceil(n / page)].long()].reshape(-1, d)[:n].float()
            scores = torch.einsum("qhd,kd->qhk", q[i].float(), kv) * scale
            if causal and s_q > 1:
                visible = torch.arange(n)[None, :] <= (n - s_q + torch.arange(s_q))[:, None]
                scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no key: all -inf -> NaN -> 0
            out[i] = torch.einsum("qhk,kd->qhd", probs, kv[:, :head_dim_v])
        return out.to(q.dtype), torch.zeros(b, h_q, s_q)


@pytest.fixture
def fake_flash_mla(clean_flash_mla: None, monkeypatch: pytest.MonkeyPatch) -> FakeFlashMLA:
    fake = FakeFlashMLA()
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    return fake


MLA_CASES = {
    "decode": (ForwardMode.DECODE, [1, 64, 130, 33], [1, 1, 1, 1]),
    "target_verify": (ForwardMode.TARGET_VERIFY, [5, 80, 129], [4, 4, 4]),
    "draft_extend": (ForwardMode.DRAFT_EXTEND, [12, 66], [3, 1]),
    # Request 0's padding rows 0..8 see no key at all (4 keys, 13 rows); request 2 adds nothing.
    "extend_prefix": (ForwardMode.EXTEND, [4, 90, 20], [3, 13, 0]),
}


def planned(spec: AttentionSpec, batch: ForwardBatch) -> tuple[FlashMLAAttention, TorchRefAttention]:
    backend, reference = FlashMLAAttention(spec, CPU), TorchRefAttention(spec, CPU)
    backend.plan(batch)
    reference.plan(batch)
    return backend, reference


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("case", list(MLA_CASES))
def test_forward_mla_against_the_reference(case: str, heads: int, fake_flash_mla: FakeFlashMLA) -> None:
    mode, seq_lens, extend_lens = MLA_CASES[case]
    spec = AttentionSpec(num_heads=heads, page_size=64, sm_scale=0.07)
    batch = random_batch(mode, seq_lens, extend_lens, spec, CPU, num_layers=2)
    backend, reference = planned(spec, batch)
    t = batch.num_tokens
    backend.set_kv(LAYER, batch.out_cache_loc, torch.randn(t, 512), torch.randn(t, 64))
    q_nope = torch.randn(heads, t, 512, dtype=torch.bfloat16).transpose(0, 1)  # strided, as the W_UK product
    q_rope = torch.randn(t, heads, 64, dtype=torch.bfloat16)
    for layer in (LAYER, 0):
        out = backend.forward_mla(q_nope, q_rope, layer)
        assert out.dtype == torch.bfloat16 and out.shape == (t, heads, 512)
        assert_close(out, reference.forward_mla(q_nope, q_rope, layer), torch.bfloat16, f"{case} layer {layer}")
    # One scheduler metadata for the forward, filled by the first layer's call and reused by the next.
    assert (fake_flash_mla.metadata_made, fake_flash_mla.metadata_filled) == (1, 1)
    backend.plan(batch)
    backend.forward_mla(q_nope, q_rope, LAYER)
    assert (fake_flash_mla.metadata_made, fake_flash_mla.metadata_filled) == (2, 2)


def test_plan_refuses_pages_other_than_64(fake_flash_mla: FakeFlashMLA) -> None:
    spec = AttentionSpec(num_heads=4, page_size=16)
    batch = random_batch(ForwardMode.DECODE, [20], [1], spec, CPU)
    with pytest.raises(ValueError, match="pages of 64 tokens, the KV pool has pages of 16"):
        FlashMLAAttention(spec, CPU).plan(batch)


def test_forward_mla_checks_its_inputs(fake_flash_mla: FakeFlashMLA) -> None:
    spec = AttentionSpec(num_heads=4, page_size=64)
    batch = random_batch(ForwardMode.DECODE, [20, 7], [1, 1], spec, CPU)
    backend, _ = planned(spec, batch)
    with pytest.raises(ValueError, match="activation dtype"):
        backend.forward_mla(torch.randn(2, 4, 512), torch.randn(2, 4, 64), LAYER)
    with pytest.raises(ValueError, match="forward_mla expects"):
        backend.forward_mla(torch.randn(3, 4, 512, dtype=torch.bfloat16), torch.randn(3, 4, 64), LAYER)


def test_a_batch_without_new_tokens_calls_nothing(fake_flash_mla: FakeFlashMLA) -> None:
    spec = AttentionSpec(num_heads=4, page_size=64)
    batch = random_batch(ForwardMode.EXTEND, [5, 9], [0, 0], spec, CPU)
    backend, _ = planned(spec, batch)
    empty = torch.zeros(0, 4, 512, dtype=torch.bfloat16), torch.zeros(0, 4, 64, dtype=torch.bfloat16)
    assert backend.forward_mla(*empty, LAYER).shape == (0, 4, 512)
    assert fake_flash_mla.metadata_made == fake_flash_mla.metadata_filled == 0


# ----------------------------------------------------------------------------------------------------
# CUDA graphs


def real_batch(mode: ForwardMode, seq_lens: list[int], per_request: int, pool: MLAKVPool) -> ForwardBatch:
    """Requests on shuffled pages of `pool`, never its last page (the graphs' padding page)."""
    order = torch.randperm(pool.num_pages - 1).tolist()
    pages = [[order.pop() for _ in range(pages_needed(s, pool.page_size))] for s in seq_lens]
    table = torch.tensor([p + [p[0]] * (max(map(len, pages)) - len(p)) for p in pages], dtype=torch.int32)
    return ForwardBatch.build(mode, seq_lens, [per_request] * len(seq_lens), table, pool)


@pytest.mark.parametrize(("mode", "per_request"), [(ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 3),
                                                   (ForwardMode.DRAFT_EXTEND, 2)])
def test_cuda_graph_capture_and_replay(mode: ForwardMode, per_request: int, fake_flash_mla: FakeFlashMLA,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashMLA reads the static block table and seq_lens as they are; the captured forward makes a fresh
    scheduler metadata at its first layer (filled inside the graph) even after warm-up runs made one, later
    layers reuse it, and plan_replay makes none (the graph refills its own from the static seq_lens)."""
    heads, max_bs, max_pages = 16, 4, 3
    spec = AttentionSpec(num_heads=heads, page_size=64, sm_scale=0.07)
    assert mode in FlashMLAAttention.capabilities.graph_modes
    pool = MLAKVPool(2, max_bs * max_pages + 1, 64, 512, 64, torch.bfloat16, CPU)
    for layer in range(2):
        pool.buffer(layer).copy_(torch.randn(pool.num_slots, 576))
    inputs = GraphInputs(max_bs, per_request, max_pages, pool, padding_page=pool.num_pages - 1)
    backend, reference = FlashMLAAttention(spec, CPU), TorchRefAttention(spec, CPU)
    backend.init_cuda_graph(max_bs, max_bs * per_request, max_pages)

    def forward(static: ForwardBatch, real: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers 0 and LAYER over `static`: the real rows of LAYER's output, and the reference's over `real`."""
        t, n = static.num_tokens, real.num_tokens
        backend.set_kv(LAYER, static.out_cache_loc, torch.randn(t, 512), torch.randn(t, 64))
        q_nope = torch.randn(t, heads, 512, dtype=torch.bfloat16)
        q_rope = torch.randn(t, heads, 64, dtype=torch.bfloat16)
        out = [backend.forward_mla(q_nope, q_rope, layer) for layer in (0, LAYER)][-1]
        reference.plan(real)
        return out[:n], reference.forward_mla(q_nope[:n], q_rope[:n], LAYER)

    for size in (max_bs, 2):  # largest first, as the runner captures
        static = inputs.batch(mode, size)
        backend.plan_capture(static)
        assert fake_flash_mla.metadata_made == fake_flash_mla.metadata_filled  # plans make no metadata
        forward(static, static)  # a warm-up run: its metadata is made and filled outside the capture
        warm_up = fake_flash_mla.calls[-1][0]
        monkeypatch.setattr(flashmla, "stream_capturing", lambda device: True)
        forward(static, static)  # the captured run
        monkeypatch.setattr(flashmla, "stream_capturing", lambda device: False)
        (first, table, lens), (second, _, _) = fake_flash_mla.calls[-2:]
        assert first is second is not warm_up and first.config[:2] == (size, per_request)
        assert table == inputs.block_table.data_ptr() and lens == inputs.seq_lens.data_ptr()  # the static ones

    made = fake_flash_mla.metadata_made
    for seq_lens, size in (([70, 3, 150], max_bs), ([129], 2)):
        real = real_batch(mode, seq_lens, per_request, pool)
        static = inputs.load(torch.zeros(real.num_tokens, dtype=torch.int64), real, size)
        backend.plan_replay(static)
        assert fake_flash_mla.metadata_made == made
        out, expected = forward(static, real)  # eagerly, what the replay computes
        assert fake_flash_mla.calls[-1][1:] == (inputs.block_table.data_ptr(), inputs.seq_lens.data_ptr())
        assert_close(out, expected, torch.bfloat16, f"replay {seq_lens}")
        made = fake_flash_mla.metadata_made

    ragged = random_batch(ForwardMode.DRAFT_EXTEND, [12, 66], [3, 1], spec, CPU)
    with pytest.raises(ValueError, match="one query length"):
        backend.plan_capture(ragged)
