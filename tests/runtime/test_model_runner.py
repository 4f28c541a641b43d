import logging
from types import SimpleNamespace

import pytest
import torch

from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.specs import KV_DTYPES
from plugserve.runtime.metrics import report_late_triton_compiles
from plugserve.runtime.model_runner import ModelRunner
from plugserve.runtime.server_args import ServerArgs


def test_backends_are_chosen_through_the_registry_with_reasons():
    runner = ModelRunner(ServerArgs(model_preset="tiny", max_total_tokens=256))
    chosen = {(c.kind, c.phase): c for c in runner.backends.chosen}
    assert set(chosen) == {("attention", "decode"), ("attention", "prefill"), ("moe", "decode")}
    assert all(c.name == "torch_ref" and "priority" in c.reason for c in chosen.values())
    assert runner.page_size == 1 and runner.max_total_tokens == 256


def test_fp8_quantization_selects_a_gemm_backend_and_page_size_is_honoured():
    runner = ModelRunner(ServerArgs(model_preset="tiny", quantization="fp8", page_size=16, max_total_tokens=512))
    assert ("gemm", "decode") in {(c.kind, c.phase) for c in runner.backends.chosen}
    assert runner.page_size == 16 and runner.allocator.num_pages == 32
    assert runner.pool.num_pages == 33 and runner.padding_page == 32  # never handed out: CUDA graphs' padding


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "bfloat16"])
def test_a_kv_cache_of_another_dtype_warms_up_and_serves_close_to_the_float32_one(kv_cache_dtype: str):
    """An fp8 (or bf16) pool under float32 activations: the pool holds that dtype, in the CPU's fixed memory twice
    (four times) the float32 pool's tokens; the warm-up runs (prefill, extension over the cached prefix, decode)
    and a prompt plus one decode step give logits close to the float32 pool's."""
    from plugserve.runtime.warmup import warm_up

    common = {"model_preset": "tiny", "dtype": "float32"}
    wide = ModelRunner(ServerArgs(**common))
    narrow = ModelRunner(ServerArgs(kv_cache_dtype=kv_cache_dtype, **common))
    ratio = 4 if kv_cache_dtype == "fp8_e4m3" else 2
    assert narrow.pool.dtype == KV_DTYPES[kv_cache_dtype] and narrow.pool.scale == 1.0
    assert narrow.bytes_per_token * ratio == wide.bytes_per_token
    assert narrow.max_total_tokens == ratio * wide.max_total_tokens
    warm_up(narrow)
    logits = []
    for runner in (wide, narrow):
        pages = torch.arange(8, dtype=torch.int32)[None]  # page size 1: token i in page i
        prompt = ForwardBatch.build(ForwardMode.EXTEND, [5], [5], pages, runner.pool)
        runner.forward(torch.tensor([5, 17, 42, 7, 99]), prompt, torch.tensor([4]))
        step = ForwardBatch.build(ForwardMode.DECODE, [6], [1], pages, runner.pool)
        logits.append(runner.forward(torch.tensor([3]), step, torch.tensor([0])))
    assert not torch.equal(logits[0], logits[1])  # the narrow pool is read as it is
    torch.testing.assert_close(logits[1], logits[0], rtol=0.05, atol=0.05 * logits[0].abs().max().item())


def test_cuda_graph_max_bs_on_the_cpu_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--cuda-graph-max-bs needs a CUDA device"):
        ModelRunner(ServerArgs(model_preset="tiny", cuda_graph_max_bs=8, max_total_tokens=64))


def test_torch_compile_swaps_in_compiled_small_ops_and_graphs_are_off_on_the_cpu():
    runner = ModelRunner(ServerArgs(model_preset="tiny", enable_torch_compile=True, torch_compile_max_bs=4,
                                    max_total_tokens=64))
    norm = runner.model.layers[0].input_layernorm
    assert norm.ops.rms_norm.__name__ == "compiled_rms_norm"
    assert runner.model.rotary.ops is norm.ops and runner.model.layers[0].mlp.ops is norm.ops
    assert runner.model.layers[0].self_attn.ops is norm.ops  # the CPU has no fused kernels: compiled ops alone
    assert not runner.graphs.runners and runner.graphs.status == "no CUDA graphs on the CPU"


def test_deterministic_inference_runs_one_backend_of_each_kind_at_every_size(bucketed_table):
    """Batch-invariant backends give a row the same bits in any batch, but two backends give it different ones: under
    --enable-deterministic-inference no kind switches backend with the batch's size, whatever the table ranks."""
    runner = ModelRunner(ServerArgs(model_preset="tiny", max_total_tokens=128, max_running_requests=8,
                                    chunked_prefill_size=64, enable_deterministic_inference=True))
    backends = runner.backends
    assert len(backends.decode_buckets) == len(backends.prefill_buckets) == 1
    assert backends.model.moe.name == "torch_ref" and backends.by_rows["moe"] == "torch_ref at every row count"


def test_a_pool_too_small_to_hold_anything_is_refused():
    with pytest.raises(ValueError, match="--max-total-tokens"):
        ModelRunner(ServerArgs(model_preset="tiny", max_total_tokens=1))


@pytest.fixture
def bucketed_table(tmp_path, monkeypatch) -> None:
    """A CPU selection table ranking triton first for decode batches up to 2, prefill up to 16 tokens and MoE
    calls of prefill sizes; the torch reference elsewhere."""
    import json

    from plugserve.core.hardware import Hardware
    from plugserve.registry import TABLES_ENV

    hardware = Hardware.detect("cpu")
    table = {"device_name": hardware.name, "rankings": {"attention": {
        "decode": [{"max_batch_size": 2, "order": ["triton"]}, {"max_batch_size": 512, "order": ["torch_ref"]}],
        "prefill": [{"max_batch_size": 16, "order": ["triton"]}, {"max_batch_size": 512, "order": ["torch_ref"]}],
    }, "moe": {"decode": [{"max_batch_size": 512, "order": ["torch_ref"]}],
               "prefill": [{"max_batch_size": 8192, "order": ["triton"]}]}}}
    (tmp_path / f"{hardware.device_key}.json").write_text(json.dumps(table))
    monkeypatch.setenv(TABLES_ENV, str(tmp_path))


def test_auto_runs_the_measured_fastest_backend_per_batch_bucket(bucketed_table):
    """The table's buckets run triton (one instance per backend, one pool), the others the torch reference."""
    from plugserve.backends_report import describe
    from plugserve.core.forward_batch import ForwardBatch, ForwardMode
    from plugserve.core.hardware import Hardware
    from plugserve.registry import get_registry
    from plugserve.runtime.row_buckets import MoEByRows

    hardware = Hardware.detect("cpu")
    runner = ModelRunner(ServerArgs(model_preset="tiny", max_total_tokens=128, max_running_requests=8,
                                    chunked_prefill_size=64))
    decode, prefill = runner.backends.decode_buckets, runner.backends.prefill_buckets
    assert [(b.max_size, b.backend.name) for b in decode] == [(2, "triton"), (8, "torch_ref")]
    assert [(b.max_size, b.backend.name) for b in prefill] == [(16, "triton"), (64, "torch_ref")]
    assert decode[0].backend is prefill[0].backend  # one instance per backend
    # MoE by rows, as `backends --explain` lists it: the decode ranking up to 8 rows, the prefill ranking above.
    moe = runner.backends.model.moe
    assert isinstance(moe, MoEByRows) and moe.rows.describe() == "torch_ref up to 8 rows, triton above"
    assert [(c.phase, c.name, c.max_batch_size) for c in runner.backends.chosen if c.kind == "moe"] == [
        ("decode", "torch_ref", 8), ("prefill", "triton", 64)]
    assert runner.backends.by_rows["moe"].startswith("torch_ref up to 8 rows, triton above; their packs add")
    # ... which is what `plugserve backends --explain` shows for those rows.
    picks = {(r["phase"], r["max_batch_size"]): r["backend"]
             for r in describe(get_registry(), hardware, ["moe"], explain=True)["auto"]}
    assert [moe.rows.of(m).name for m in (1, 8, 64, 512)] == [picks[("decode", 1)], picks[("decode", 8)],
                                                              picks[("prefill", 64)], picks[("prefill", 512)]]

    def batch(mode: ForwardMode, n: int, new: int) -> ForwardBatch:
        return ForwardBatch.build(mode, [new] * n, [new] * n, torch.zeros(n, 32, dtype=torch.int32), runner.pool)

    assert runner.backends.attention(batch(ForwardMode.DECODE, 2, 1)).name == "triton"
    assert runner.backends.attention(batch(ForwardMode.DECODE, 3, 1)).name == "torch_ref"
    assert runner.backends.attention(batch(ForwardMode.EXTEND, 1, 16)).name == "triton"
    assert runner.backends.attention(batch(ForwardMode.EXTEND, 1, 17)).name == "torch_ref"


def test_an_explicit_backend_serves_every_bucket():
    runner = ModelRunner(ServerArgs(model_preset="tiny", max_total_tokens=128, attention_backend="torch_ref",
                                    max_running_requests=8))
    assert [(b.max_size, b.backend.name) for b in runner.backends.decode_buckets] == [(8, "torch_ref")]


def test_a_plugin_that_fails_to_load_is_logged_at_start(monkeypatch, caplog):
    import logging

    from plugserve.registry import BUILTIN_PLUGINS, Registry
    from plugserve.runtime import backends

    registry = Registry(builtin=(*BUILTIN_PLUGINS, "plugserve.plugins.no_such_plugin"), entry_points=False)
    monkeypatch.setattr(backends, "get_registry", lambda: registry)
    with caplog.at_level(logging.WARNING):
        ModelRunner(ServerArgs(model_preset="tiny", max_total_tokens=64))
    [record] = [r for r in caplog.records if "failed to load" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == ("plugin plugserve.plugins.no_such_plugin (package plugserve) failed to load and is "
                                   "skipped: import failed: ModuleNotFoundError: No module named "
                                   "'plugserve.plugins.no_such_plugin'")


def test_shared_experts_fuse_into_a_backend_that_can_and_give_the_same_logits():
    """--enable-shared-experts-fusion: the embedded model's shared experts as extra experts of the triton MoE
    (interpreted here), the same logits as their own MLP; /server_info's line says which. A backend that
    cannot fuse is an error naming the flag."""
    common = {"moe_runner_backend": "triton", "dtype": "float32", "max_total_tokens": 64}
    fused = ModelRunner(ServerArgs(model_preset="tiny", enable_shared_experts_fusion=True, **common))
    plain = ModelRunner(ServerArgs(model_preset="tiny", **common))
    assert fused.model.backends.moe.spec.num_shared_experts == fused.config.n_shared_experts > 0
    assert fused.backends.shared_experts_mode == "fused into the triton MoE backend's GEMMs"
    assert plain.model.backends.moe.spec.num_shared_experts == 0
    assert plain.backends.shared_experts_mode == "own MLP on the main stream"
    with pytest.raises(ValueError, match="--enable-shared-experts-fusion: the moe backend torch_ref does not fuse"):
        ModelRunner(ServerArgs(model_preset="tiny", enable_shared_experts_fusion=True, max_total_tokens=64))
    ids = torch.tensor([5, 17, 42, 7, 99])
    logits = []
    for runner in (fused, plain):
        pages = torch.arange(8, dtype=torch.int32)[None]  # page size 1: token i in page i
        batch = ForwardBatch.build(ForwardMode.EXTEND, [5], [5], pages, runner.pool)
        logits.append(runner.forward(ids, batch, torch.tensor([4])))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_a_triton_compile_after_the_warm_up_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    knobs = pytest.importorskip("triton").knobs
    before = knobs.runtime.jit_post_compile_hook
    counted = []
    try:
        report_late_triton_compiles(lambda: counted.append(1))
        hook = knobs.runtime.jit_post_compile_hook
        assert hook is not None
        # The keywords triton's JIT passes once it compiled a kernel (triton 3.9, runtime/jit.py `_call_hook`).
        compile_info = {"signature": {"x_ptr": "*bf16", "stride_x": "i32", "BLOCK": "constexpr"},
                        "constants": {(2,): 256}, "configs": [{(0,): [["tt.divisibility", 16]]}]}
        with caplog.at_level(logging.WARNING, logger="plugserve.runtime.model_runner"):
            hook(key=("k",), repr="unused", fn=SimpleNamespace(name="_rms_norm_kernel"), compile=compile_info,
                 is_manual_warmup=False, already_compiled=False)
            hook(key=("k",), repr="_other_kernel[num_warps=4](...)", fn=None, compile={})  # another release's
    finally:
        knobs.runtime.jit_post_compile_hook = before
    assert ("_rms_norm_kernel(x_ptr: *bf16, stride_x: i32) divisible by 16: ['x_ptr'] constexprs {'BLOCK': 256}"
            in caplog.text)
    assert "_other_kernel[num_warps=4](...)" in caplog.text
    assert len(counted) == 2  # the engine's plugserve_late_triton_compiles counter, once per compile
