"""The fused MLA norm + rope + KV pool write + W_UK absorption kernel (`triton_small_ops.mla_prepare`) against its
eager op and a float64 product, alone and in the tiny model's decode; the RMSNorm (with and without the residual
add) and SiLU-and-mul kernels against transformers' DeepseekV3RMSNorm / SiLU and the eager ops; which path the model
takes for which backend; the selection.

Without a GPU the kernel runs in Triton's interpreter, in fp32 / fp16 only: the interpreter truncates float32
to bf16 where the GPU rounds to nearest even.
Where they cannot run in this process, the kernel tests run in an interpreted child pytest (tests/interpreter.py).
The bf16 test at DeepSeek's shapes runs only on a GPU (`test_bf16_on_the_gpu_at_deepseek_shapes`).
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

from plugserve.core.batch_invariant import batch_invariant
from plugserve.core.forward_batch import AttnForwardMethod, ForwardMode
from plugserve.core.layers import eager_ops, small_ops
from plugserve.core.layers.small_ops import EAGER, SmallOps
from plugserve.core.models.deepseek import DeepseekForCausalLM
from plugserve.plugins.attention.torch_ref import TorchRefAttention
from tests.checkpoints import random_hf_model, save_hf_model, tiny_v3_config
from tests.interpreter import interpreter_child, kernels_fixture
from tests.paged_runner import PagedRunner, Request, load_reference_model

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
EPS = 1e-6
NOPE = 24  # q's nope columns before its rope part (not a power of two: the absorbing tile is masked)
DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if ON_GPU else [])]


kernels = kernels_fixture("plugserve.core.layers.triton_small_ops")


test_kernels_in_the_interpreter = interpreter_child(__file__)


def _inputs(t: int, h: int, r: int, p: int, dtype: torch.dtype, pool_dtype: torch.dtype,
            weight_dtype: torch.dtype | None = None, num_slots: int | None = None, seed: int = 0):
    """(kv_a, q_nope, q_rope, w_kc, weight, cos, sin, buffer, slots) laid out as the model hands them over: kv_a a
    column slice of the wider qkv_a GEMM output, q_nope / q_rope the columns of q [T, H, nope + P], W_UK [H, nope, R],
    shuffled slots, a buffer already holding other tokens' rows, cos / sin as `rope_cos_sin` makes them."""
    g = torch.Generator().manual_seed(seed)
    qkv_a = torch.randn(t, 24 + r + p, generator=g).to(DEVICE, dtype)
    kv_a = qkv_a[:, 24:]
    q_nope, q_rope = torch.randn(t, h, NOPE + p, generator=g).to(DEVICE, dtype).split([NOPE, p], dim=-1)
    w_kc = (torch.randn(h, NOPE, r, generator=g) / NOPE**0.5).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(r, generator=g)).to(DEVICE, weight_dtype or dtype)
    positions = torch.randint(0, 4096, (t,), generator=g).to(DEVICE)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, p, 2, dtype=torch.float32) / p)).to(DEVICE)
    cos, sin = small_ops.rope_cos_sin(positions, inv_freq, 1.2)
    num_slots = num_slots or max(40, 2 * t)  # rows for other tokens too
    buffer = torch.randn(num_slots, r + p, generator=g).to(DEVICE, pool_dtype)
    slots = torch.randperm(num_slots, generator=g)[:t].to(DEVICE)
    return kv_a, q_nope, q_rope, w_kc, weight, cos, sin, buffer, slots


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values apart two 16-bit float tensors are, elementwise (sign-magnitude bits
    mapped to a monotonic integer line)."""
    def line(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (line(a) - line(b)).abs()


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str, max_ulps: int = 1) -> None:
    """float32: within 1e-6 relative; 16-bit: at most `max_ulps` units in the last place apart."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6, msg=what)
    else:
        ulps = _ulps(actual, expected)
        assert int(ulps.max()) <= max_ulps, (f"{what}: {int((ulps > max_ulps).sum())} values over {max_ulps} ulp "
                                             f"apart (max {int(ulps.max())})")


def _check_against_eager(kernels: ModuleType, t: int, h: int, r: int, p: int, dtype: torch.dtype,
                         pool_dtype: torch.dtype, weight_dtype: torch.dtype | None = None, kv_scale: float = 1.0
                         ) -> None:
    kv_a, q_nope, q_rope, w_kc, weight, cos, sin, buffer, slots = _inputs(t, h, r, p, dtype, pool_dtype, weight_dtype)
    before, expected_buffer = buffer.clone(), buffer.clone()
    _, expected_q = small_ops.mla_prepare(kv_a, q_nope, q_rope, w_kc, weight, EPS, cos, sin, expected_buffer, slots,
                                          kv_scale)
    q_abs, q = kernels.mla_prepare(kv_a, q_nope, q_rope, w_kc, weight, EPS, cos, sin, buffer, slots, kv_scale)
    _assert_matches(q, expected_q, "rotated q_rope")
    if t <= kernels.FUSED_ABSORB_MAX_TOKENS:  # the kernel's own product: one rounding of the exact sum
        _assert_matches(q_abs, torch.einsum("thd,hdr->thr", q_nope.double(), w_kc.double()).to(dtype), "absorbed q")
    else:  # the bmm's (cuBLAS may round 16-bit partial sums): exactly the eager op's
        assert torch.equal(q_abs, small_ops.absorb_q(q_nope, w_kc)), "absorbed q past the fused tokens"
    if pool_dtype == torch.float8_e4m3fn:  # the same rounding on e4m3's grid: the same bytes
        assert torch.equal(buffer.view(torch.uint8)[slots], expected_buffer.view(torch.uint8)[slots]), "fp8 pool rows"
    else:
        _assert_matches(buffer[slots, :r], expected_buffer[slots, :r], "normed latent in the pool")
        _assert_matches(buffer[slots, r:], expected_buffer[slots, r:], "rotated rope key in the pool")
    others = torch.ones(buffer.shape[0], dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.equal(buffer.view(torch.uint8)[others], before.view(torch.uint8)[others]), "rows outside `slots`"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("r", "p"), [(32, 16), (48, 16)], ids=["R32", "R48"])  # 48: masked tail of the row
@pytest.mark.parametrize("h", [1, 4])
@pytest.mark.parametrize("t", [1, 3, 9])  # 9: past FUSED_ABSORB_MAX_TOKENS, W_UK's product by the bmm
def test_equals_the_eager_op(kernels: ModuleType, t: int, h: int, r: int, p: int, dtype: torch.dtype) -> None:
    _check_against_eager(kernels, t, h, r, p, dtype, dtype)


@pytest.mark.parametrize(("dtype", "pool_dtype", "weight_dtype"), [
    (torch.float16, torch.float32, None),  # the pool wider than the activations
    (torch.float32, torch.float16, None),  # and narrower
    (torch.float16, torch.float16, torch.float32),  # a float32 norm weight: the product stays float32
], ids=["fp16-pool32", "fp32-pool16", "fp16-weight32"])
def test_casts_like_the_eager_op(kernels: ModuleType, dtype: torch.dtype, pool_dtype: torch.dtype,
                                 weight_dtype: torch.dtype | None) -> None:
    _check_against_eager(kernels, 3, 20, 32, 8, dtype, pool_dtype, weight_dtype)  # 20 heads: two head blocks


@pytest.mark.parametrize("t", [1, 3, 9])
def test_absorbs_by_the_bmm_at_every_count_under_batch_invariance(kernels: ModuleType, t: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `batch_invariant` W_UK's product is `eager_ops.absorb_q`'s (row-invariant) bmm at every count, as past
    the fused tokens, not the fused kernel's own sums: a token's absorbed q is the same bits in a batch of 3 as in one
    of 9."""
    calls = []
    absorb_q = eager_ops.absorb_q
    monkeypatch.setattr(eager_ops, "absorb_q", lambda *args: calls.append(t) or absorb_q(*args))
    kv_a, q_nope, q_rope, w_kc, weight, cos, sin, buffer, slots = _inputs(t, 4, 48, 16, torch.float32, torch.float32)
    with torch.inference_mode(), batch_invariant():
        q_abs, _ = kernels.mla_prepare(kv_a, q_nope, q_rope, w_kc, weight, EPS, cos, sin, buffer, slots)
        assert calls == [t]
        assert torch.equal(q_abs, absorb_q(q_nope, w_kc))


def test_no_tokens_is_a_no_op(kernels: ModuleType) -> None:
    kv_a, q_nope, q_rope, w_kc, weight, cos, sin, buffer, slots = _inputs(0, 4, 32, 16, torch.float32, torch.float32)
    before = buffer.clone()
    q_abs, q = kernels.mla_prepare(kv_a, q_nope, q_rope, w_kc, weight, EPS, cos, sin, buffer, slots)
    assert q_abs.shape == (0, 4, 32) and q.shape == (0, 4, 16) and torch.equal(buffer, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kv_scale", [1.0, 0.3, 2.0**-8], ids=["scale1", "scale0.3", "saturating"])
def test_an_fp8_pool_is_quantized_in_the_kernel_like_the_eager_op(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                                  dtype: torch.dtype, kv_scale: float) -> None:
    """value / kv_scale, saturated and rounded to nearest even on e4m3's grid, byte for byte the eager op's (2^-8:
    most values past 448, clamped); the kernel itself writes it, not the eager op."""
    def no_eager(*args: object) -> None:
        raise AssertionError("the fp8 pool took the eager op")

    monkeypatch.setattr(kernels.eager_ops, "mla_prepare", no_eager)  # small_ops keeps its own name for it
    _check_against_eager(kernels, 9, 4, 48, 16, dtype, torch.float8_e4m3fn, kv_scale=kv_scale)


@pytest.mark.skipif(not ON_GPU, reason="bf16 at DeepSeek's shapes, compiled: needs a GPU")
@pytest.mark.parametrize("h", [16, 128])  # V3's heads per rank at TP 8, and all of them
@pytest.mark.parametrize("t", [1, 7, 64])
def test_bf16_on_the_gpu_at_deepseek_shapes(kernels: ModuleType, t: int, h: int) -> None:
    _check_against_eager(kernels, t, h, 512, 64, torch.bfloat16, torch.bfloat16)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_captures_in_a_cuda_graph_and_replays_on_new_inputs(kernels: ModuleType) -> None:
    kv_a, q_nope, q_rope, w_kc, weight, cos, sin, buffer, slots = _inputs(8, 16, 512, 64, torch.bfloat16,
                                                                          torch.bfloat16)
    kernels.mla_prepare(kv_a, q_nope, q_rope, w_kc, weight, EPS, cos, sin, buffer, slots)  # compiles outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_abs, q = kernels.mla_prepare(kv_a, q_nope, q_rope, w_kc, weight, EPS, cos, sin, buffer, slots)
    new = _inputs(8, 16, 512, 64, torch.bfloat16, torch.bfloat16, seed=1)
    for static, fresh in zip((kv_a, q_nope, q_rope, cos, sin, slots), (new[0], new[1], new[2], new[5], new[6], new[8]),
                             strict=True):
        static.copy_(fresh)
    expected_buffer = buffer.clone()
    _, expected_q = small_ops.mla_prepare(kv_a, q_nope, q_rope, w_kc, weight, EPS, cos, sin, expected_buffer, slots)
    graph.replay()
    _assert_matches(q, expected_q, "rotated q_rope (replayed)")
    _assert_matches(q_abs, torch.einsum("thd,hdr->thr", q_nope.double(), w_kc.double()).to(torch.bfloat16),
                    "absorbed q (replayed)")
    _assert_matches(buffer, expected_buffer, "pool (replayed)")


# ----------------------------------------------------------------------------------------------------
# RMSNorm and SiLU-and-mul


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' DeepseekV3RMSNorm (the oracle the model is checked against) with `weight`."""
    norm = DeepseekV3RMSNorm(x.shape[-1], eps=EPS).to(DEVICE)
    norm.weight.data = weight.clone()
    with torch.no_grad():
        return norm(x)


NORM_CASES = [(1, 256), (5, 200)]  # 200: a masked tail of the row
# A norm rounds twice in 16 bits (the normed row, then its product with the weight): a one-ulp difference in the
# first (another summation order, rsqrt's last bit) can become two in the second.
NORM_ULPS = 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("t", "d"), NORM_CASES, ids=["1x256", "5x200"])
def test_rms_norm_equals_transformers_norm(kernels: ModuleType, t: int, d: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(t)
    wide = (3 * torch.randn(t, d + 40, generator=g)).to(DEVICE, dtype)
    x = wide[:, 40:]  # a column slice, as q_a_layernorm reads the qkv_a GEMM's output
    weight = (1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE, dtype)
    out = kernels.rms_norm(x, weight, EPS)
    _assert_matches(out, _hf_rms_norm(x, weight), "rms_norm", NORM_ULPS)
    _assert_matches(out, small_ops.rms_norm(x, weight, EPS), "rms_norm against the eager op", NORM_ULPS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("t", "d"), NORM_CASES, ids=["1x256", "5x200"])
def test_add_rms_norm_writes_the_sum_and_its_norm(kernels: ModuleType, t: int, d: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(10 + t)
    x, residual = (3 * torch.randn(2, t, d, generator=g)).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE, dtype)
    normed, summed = kernels.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(summed, x + residual)  # one rounding of the float32 sum, as torch's add
    _assert_matches(normed, _hf_rms_norm(x + residual, weight), "add_rms_norm", NORM_ULPS)


def test_rms_norm_keeps_leading_dims_and_promotes_like_torch(kernels: ModuleType) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 64, generator=g).to(DEVICE, torch.float16)
    weight = (1 + 0.1 * torch.randn(64, generator=g)).to(DEVICE)  # a float32 weight: the product stays float32
    out = kernels.rms_norm(x, weight, EPS)
    expected = small_ops.rms_norm(x, weight, EPS)
    assert out.shape == (2, 3, 64) and expected.dtype == torch.float32
    _assert_matches(out, expected, "rms_norm, fp16 x and fp32 weight")


def test_add_rms_norm_of_mixed_dtypes_takes_the_eager_op(kernels: ModuleType) -> None:
    x = torch.randn(3, 64).to(DEVICE, torch.float16)
    residual, weight = torch.randn(3, 64).to(DEVICE), torch.ones(64).to(DEVICE, torch.float16)
    normed, summed = kernels.add_rms_norm(x, residual, weight, EPS)
    expected = small_ops.add_rms_norm(x, residual, weight, EPS)
    assert summed.dtype == torch.float32 and torch.equal(summed, expected[1]) and torch.equal(normed, expected[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("t", "i"), [(1, 64), (3, 1500)], ids=["1x64", "3x1500"])  # 1500: two blocks, masked
def test_silu_and_mul_equals_the_eager_op(kernels: ModuleType, t: int, i: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(i)
    gate_up = (4 * torch.randn(t, 2 * i, generator=g)).to(DEVICE, dtype)
    out = kernels.silu_and_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    plain = torch.nn.SiLU()(gate.to(dtype)).double() * up  # torch.nn's SiLU, rounded to dtype like the eager op
    _assert_matches(out, plain.to(dtype), "silu_and_mul against SiLU")
    _assert_matches(out, small_ops.silu_and_mul(gate_up), "silu_and_mul against the eager op")


def test_no_rows_give_empty_outputs(kernels: ModuleType) -> None:
    x, weight = torch.empty(0, 64, device=DEVICE), torch.ones(64, device=DEVICE)
    assert kernels.rms_norm(x, weight, EPS).shape == (0, 64)
    assert [y.shape for y in kernels.add_rms_norm(x, x, weight, EPS)] == [(0, 64), (0, 64)]
    assert kernels.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)


@pytest.mark.skipif(not ON_GPU, reason="bf16 at DeepSeek's widths, compiled: needs a GPU")
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_bf16_norms_and_silu_on_the_gpu_at_deepseek_widths(kernels: ModuleType, t: int) -> None:
    g = torch.Generator().manual_seed(t)
    for d in (7168, 2048, 1536):  # V3's and V2-Lite's hidden sizes, V3's q_lora_rank
        x, residual = (3 * torch.randn(2, t, d, generator=g)).to(DEVICE, torch.bfloat16)
        weight = (1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE, torch.bfloat16)
        normed, summed = kernels.add_rms_norm(x, residual, weight, EPS)
        assert torch.equal(summed, x + residual)
        _assert_matches(normed, _hf_rms_norm(x + residual, weight), f"add_rms_norm, {t}x{d}", NORM_ULPS)
    for i in (18432, 1408):  # V3's dense intermediate size, V2-Lite's experts'
        gate_up = (4 * torch.randn(t, 2 * i, generator=g)).to(DEVICE, torch.bfloat16)
        _assert_matches(kernels.silu_and_mul(gate_up), small_ops.silu_and_mul(gate_up), f"silu_and_mul, {t}x{i}")


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_norm_and_silu_capture_in_a_cuda_graph(kernels: ModuleType) -> None:
    x, residual = torch.randn(2, 8, 2048, device=DEVICE, dtype=torch.bfloat16)
    gate_up = torch.randn(8, 2816, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.ones(2048, device=DEVICE, dtype=torch.bfloat16)
    kernels.add_rms_norm(x, residual, weight, EPS), kernels.silu_and_mul(gate_up)  # compiles outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, summed = kernels.add_rms_norm(x, residual, weight, EPS)
        activated = kernels.silu_and_mul(gate_up)
    for static in (x, residual, gate_up):
        static.copy_(torch.randn_like(static))
    graph.replay()
    expected_normed, expected_summed = small_ops.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(summed, expected_summed)
    _assert_matches(normed, expected_normed, "add_rms_norm (replayed)", NORM_ULPS)
    _assert_matches(activated, small_ops.silu_and_mul(gate_up), "silu_and_mul (replayed)")


# ----------------------------------------------------------------------------------------------------
# In the model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> DeepseekForCausalLM:
    directory = save_hf_model(random_hf_model(tiny_v3_config()), tmp_path_factory.mktemp("v3"))
    return load_reference_model(directory)


def _decode_logits(model: DeepseekForCausalLM, steps: int = 3) -> torch.Tensor:
    """Prefill two prompts, then `steps` greedy decode steps of both: the decode logits [steps, 2, vocab]."""
    runner = PagedRunner(model, page_size=4)
    requests = [Request(), Request()]
    prompts = [[5, 17, 99, 3, 250, 8, 41], [12, 7, 300, 64]]
    last = runner.step(ForwardMode.EXTEND, requests, prompts)
    tokens = [int(last[len(prompts[0]) - 1].argmax()), int(last[-1].argmax())]
    rows = []
    for _ in range(steps):
        logits = runner.step(ForwardMode.DECODE, requests, [[token] for token in tokens])
        assert runner.last_batch.attn_method is AttnForwardMethod.MLA
        rows.append(logits)
        tokens = [int(row.argmax()) for row in logits]
    return torch.stack(rows)


def _counting(function):
    def run(*args):
        run.calls += 1
        return function(*args)

    run.calls = 0
    return run


@pytest.mark.skipif(ON_GPU, reason="the tiny model runs on the CPU, where the kernel runs only interpreted; on a GPU "
                    "benchmarks/accuracy.py checks the fused decode end to end")
def test_model_decode_with_the_fused_kernel_equals_eager(kernels: ModuleType, tiny_model: DeepseekForCausalLM
                                                         ) -> None:
    eager = _decode_logits(tiny_model)
    fused = {name: _counting(getattr(kernels, name)) for name in ("rms_norm", "add_rms_norm", "silu_and_mul",
                                                                   "mla_prepare")}
    tiny_model.use_small_ops(SmallOps(**fused))
    try:
        logits = _decode_logits(tiny_model)
    finally:
        tiny_model.use_small_ops(EAGER)
    layers = tiny_model.config.num_hidden_layers
    assert fused["mla_prepare"].calls == 3 * layers  # every layer of every decode step
    assert fused["add_rms_norm"].calls >= 3 * 2 * (layers - 1)  # the pre-norms of every layer but the first's input
    assert fused["rms_norm"].calls > 0 and fused["silu_and_mul"].calls > 0
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)


class _OwnSetKv(TorchRefAttention):
    """A backend with its own set_kv (here: the pool write, recorded)."""

    calls = 0

    def set_kv(self, layer_id: int, slots: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
        type(self).calls += 1
        super().set_kv(layer_id, slots, latent, k_rope)


def test_a_backend_overriding_set_kv_keeps_the_unfused_path(tiny_model: DeepseekForCausalLM) -> None:
    eager = _decode_logits(tiny_model)
    backends = tiny_model.backends
    default = backends.attention_decode
    fused = _counting(small_ops.mla_prepare)
    backends.attention_decode = _OwnSetKv(default.spec, default.device)
    tiny_model.use_small_ops(SmallOps(mla_prepare=fused))
    try:
        logits = _decode_logits(tiny_model)
    finally:
        backends.attention_decode = default
        tiny_model.use_small_ops(EAGER)
    assert fused.calls == 0 and _OwnSetKv.calls == 3 * tiny_model.config.num_hidden_layers
    assert torch.equal(logits, eager)


def test_fused_kernels_are_selected_on_cuda_only(kernels: ModuleType) -> None:
    assert EAGER.with_fused_kernels(torch.device("cpu")) is EAGER
    compiled = SmallOps.compiled(4)
    assert compiled.with_fused_kernels(torch.device("cpu")) is compiled
    fused = compiled.with_fused_kernels(torch.device("cuda"))  # selects without touching a GPU
    for name in ("rms_norm", "add_rms_norm", "silu_and_mul", "mla_prepare"):
        assert getattr(fused, name).__module__ == "plugserve.core.layers.triton_small_ops", name
    assert fused.apply_rope is compiled.apply_rope and fused.rope_cos_sin is compiled.rope_cos_sin
