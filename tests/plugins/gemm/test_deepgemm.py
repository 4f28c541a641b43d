"""The "deepgemm" block-FP8 GEMM and what both DeepGEMM backends share (plugserve.plugins.deepgemm_support):
declaration, availability and its every reason, the libstdc++ detection (on fake /proc/self/maps texts and
on real child processes with and without LD_PRELOAD), weight padding, and `apply` against the torch
reference with tests/plugins/fake_deep_gemm.py standing in for the library (Triton's interpreter without
a GPU; see tests/plugins/moe/test_triton.py for why the kernel tests may run in a child pytest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plugserve.conformance.tolerances import assert_close
from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.layers.quant import per_token_group_quant_fp8, quantize_block_fp8
from plugserve.core.specs import GemmSpec
from plugserve.plugins import deepgemm_support
from plugserve.plugins.deepgemm_support import (
    libstdcxx_check,
    libstdcxx_problem,
    mapped_libstdcxx,
    nvcc_path,
    parse_version,
)
from plugserve.plugins.gemm.deepgemm import DeepGemmFp8Gemm, padded_weight
from plugserve.plugins.gemm.torch_ref import TorchRefFp8Gemm
from plugserve.registry import Registry
from tests.interpreter import KERNELS_HERE, interpreter_child
from tests.plugins import fake_deep_gemm

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
REPO = Path(__file__).resolve().parents[3]
H100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 << 30, 132)
A100 = Hardware("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 80 << 30, 108)
B200 = Hardware("cuda", "NVIDIA B200", (10, 0), 180 << 30, 148)
STDCXX = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33"
TORCH_CPU = "/venv/lib/python3.12/site-packages/torch/lib/libtorch_cpu.so"
MAPS = f"""\
5581e5a00000-5581e5a2c000 r--p 00000000 08:01 1835 /usr/bin/python3.12
7f3a10000000-7f3a10021000 rw-p 00000000 00:00 0
7f3a2c000000-7f3a2c0a1000 r--p 00000000 08:01 4412 {STDCXX}
7f3a2c0a1000-7f3a2c1ff000 r-xp 000a1000 08:01 4412 {STDCXX}
7f3a2c400000-7f3a31e00000 r-xp 00000000 08:01 9001 {TORCH_CPU}
7f3a33a00000-7f3a33a21000 r--p 00000000 08:01 5121 /tmp/my libs/libfoo.so
7ffd5b7e1000-7ffd5b802000 rw-p 00000000 00:00 0                          [stack]
"""


# -- declaration and availability -----------------------------------------------------------------------


def test_declaration_and_registration() -> None:
    DeepGemmFp8Gemm.check_declaration()
    registry = Registry(builtin=("plugserve.plugins.gemm.deepgemm",), entry_points=False)
    assert registry.broken == []
    assert registry.get("gemm", "deepgemm").cls is DeepGemmFp8Gemm


def test_capabilities() -> None:
    caps = DeepGemmFp8Gemm.capabilities
    assert caps.check(GemmSpec(torch.bfloat16), Phase.DECODE)
    assert caps.check(GemmSpec(torch.bfloat16), Phase.PREFILL)
    fp16 = caps.check(GemmSpec(torch.float16), Phase.DECODE)
    assert "dtype float16 is not supported (supports bfloat16)" in fp16.reason
    assert "block shape" in caps.check(GemmSpec(torch.bfloat16, (64, 64)), Phase.DECODE).reason
    assert DeepGemmFp8Gemm.priority_on(H100) > 50  # above `triton` on Hopper until a table says otherwise


def test_availability_on_the_cpu() -> None:
    assert DeepGemmFp8Gemm.availability(Hardware.detect("cpu")).reason == "runs on cuda, not cpu"


def test_availability_names_the_architecture() -> None:
    assert DeepGemmFp8Gemm.availability(A100).reason == "needs sm90 or newer, this GPU is sm80"
    reason = DeepGemmFp8Gemm.availability(B200).reason
    assert reason.startswith("supports up to sm90, this GPU is sm100") and "UE8M0" in reason


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """deep_gemm importable (the fake), an nvcc where CUDA_HOME says, no libstdc++ problem: availability OK.
    Returns CUDA_HOME."""
    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    for name in ("DG_JIT_NVCC_COMPILER", "DG_JIT_USE_NVRTC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(deepgemm_support, "libstdcxx_check", lambda: None)
    return tmp_path


def test_availability_ok_when_everything_is_there(installed: Path) -> None:
    assert DeepGemmFp8Gemm.availability(H100)


def test_availability_names_the_missing_package(installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing():
        raise ImportError("No module named 'deep_gemm'")

    monkeypatch.setattr(deepgemm_support, "import_deep_gemm", missing)
    reason = DeepGemmFp8Gemm.availability(H100).reason
    assert reason.startswith("deep_gemm is not installed (No module named 'deep_gemm')")
    assert "tools/device/build_deepgemm.sh" in reason


def test_availability_reports_a_failing_import(installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken():
        raise AssertionError("no CUDA home")

    monkeypatch.setattr(deepgemm_support, "import_deep_gemm", broken)
    assert DeepGemmFp8Gemm.availability(H100).reason == "import deep_gemm failed: AssertionError: no CUDA home"


def test_availability_names_an_old_version(installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake_deep_gemm, "__version__", "2.1.1+local")
    assert DeepGemmFp8Gemm.availability(H100).reason.startswith("deep_gemm 2.1.1+local is too old: needs 2.6 or newer")
    monkeypatch.setattr(fake_deep_gemm, "__version__", "2.6.1+54e2261")
    assert DeepGemmFp8Gemm.availability(H100)


def test_availability_names_a_missing_nvcc(installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (installed / "bin" / "nvcc").unlink()
    reason = DeepGemmFp8Gemm.availability(H100).reason
    assert f"{installed}/bin/nvcc does not exist" in reason and "CUDA_HOME" in reason
    monkeypatch.setenv("DG_JIT_USE_NVRTC", "1")  # NVRTC needs no nvcc
    assert DeepGemmFp8Gemm.availability(H100)


def test_availability_reports_the_libstdcxx_problem(installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deepgemm_support, "libstdcxx_check", lambda: "start with LD_PRELOAD=x")
    assert DeepGemmFp8Gemm.availability(H100).reason == "start with LD_PRELOAD=x"


def test_nvcc_path_follows_deep_gemm() -> None:
    nowhere = lambda name: None  # noqa: E731
    assert nvcc_path({"DG_JIT_NVCC_COMPILER": "/opt/nvcc", "CUDA_HOME": "/c"}, nowhere) == Path("/opt/nvcc")
    assert nvcc_path({"CUDA_HOME": "/c", "CUDA_PATH": "/p"}, nowhere) == Path("/c/bin/nvcc")
    assert nvcc_path({"CUDA_PATH": "/p"}, nowhere) == Path("/p/bin/nvcc")
    assert nvcc_path({}, lambda name: "/usr/local/cuda-13.0/bin/nvcc") == Path("/usr/local/cuda-13.0/bin/nvcc")
    assert nvcc_path({}, nowhere) == Path("/usr/local/cuda/bin/nvcc")


def test_parse_version() -> None:
    assert parse_version("2.6.1") == (2, 6)
    assert parse_version("2.10.0+abc") == (2, 10)
    assert parse_version("unknown") is None


# -- libstdc++ detection --------------------------------------------------------------------------------


def test_mapped_libstdcxx_lists_each_file_once() -> None:
    assert mapped_libstdcxx(MAPS) == [STDCXX]
    two = MAPS + "7f3a40000000-7f3a40001000 r--p 00000000 08:01 77 /opt/conda/lib/libstdc++.so.6.0.29 (deleted)\n"
    assert mapped_libstdcxx(two) == [STDCXX, "/opt/conda/lib/libstdc++.so.6.0.29"]
    assert mapped_libstdcxx("7ffd5b7e1000-7ffd5b802000 rw-p 00000000 00:00 0  [stack]\n") == []


def test_no_problem_when_libstdcxx_resolves_its_own_symbols() -> None:
    providers = dict.fromkeys(deepgemm_support.PROBE_SYMBOLS, "/usr/lib/x86_64-linux-gnu/libstdc++.so.6")
    assert libstdcxx_problem([STDCXX], providers) is None
    assert libstdcxx_problem([], {}) is None  # nothing C++ loaded yet


def test_problem_when_libstdcxx_is_not_global() -> None:
    """libstdc++ loaded only as a dependency of torch's libraries (Python does not link it): DeepGEMM's
    extension would look in torch's libraries first."""
    providers = dict.fromkeys(deepgemm_support.PROBE_SYMBOLS)
    problem = libstdcxx_problem([STDCXX], providers)
    assert problem is not None
    assert "std::locale::classic() is not in the global symbol scope" in problem
    assert problem.endswith(f"start the process with LD_PRELOAD={STDCXX}")


def test_problem_when_torch_shadows_libstdcxx() -> None:
    symbol = "_ZNKSt10filesystem7__cxx114path7compareERKS1_"
    providers = {"_ZNSt6locale7classicEv": STDCXX, symbol: TORCH_CPU}
    problem = libstdcxx_problem([STDCXX], providers)
    assert problem is not None and f"std::filesystem::path::compare(path const&) resolves to {TORCH_CPU}" in problem


def test_problem_when_two_runtimes_are_loaded() -> None:
    problem = libstdcxx_problem([STDCXX, "/opt/conda/lib/libstdc++.so.6.0.29"], {})
    assert problem is not None and problem.startswith(f"two C++ runtimes are loaded ({STDCXX}, /opt/conda/lib/")


def test_check_reads_a_maps_file(tmp_path: Path) -> None:
    """Without a libstdc++ in the (fake) map nothing is probed; an unreadable map (no /proc) is no problem."""
    maps = tmp_path / "maps"
    maps.write_text("5581e5a00000-5581e5a2c000 r--p 00000000 08:01 1835 /usr/bin/python3.12\n")
    assert libstdcxx_check(str(maps)) is None
    assert libstdcxx_check(str(tmp_path / "missing")) is None


def _check_in_child(preload: str | None) -> str:
    env = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = preload
    code = ("import torch\nfrom plugserve.plugins.deepgemm_support import libstdcxx_check\n"
            "print(libstdcxx_check())")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_check_tells_a_preloaded_process_from_one_without() -> None:
    """The real thing, in two fresh processes that import torch: without LD_PRELOAD libstdc++ arrives as
    torch's dependency, outside the global scope (the setup DeepGEMM's JIT crashes in); preloaded, it is
    first there."""
    import torch as _  # noqa: F401  (maps this process's libstdc++, the one to preload)

    mapped = mapped_libstdcxx(Path("/proc/self/maps").read_text())
    if not mapped:
        pytest.skip("this process has no libstdc++ mapped")
    without = _check_in_child(None)
    assert "libstdc++ is not preloaded" in without and "LD_PRELOAD=" in without, without
    assert _check_in_child(mapped[0]) == "None"


# -- weights and apply ----------------------------------------------------------------------------------


def test_padded_weight() -> None:
    w = torch.randn(200, 256).to(torch.float8_e4m3fn)
    assert padded_weight(w) is w
    odd = torch.randn(201, 320).to(torch.float8_e4m3fn)
    padded = padded_weight(odd)
    assert padded.shape == (208, 384) and padded.dtype == torch.float8_e4m3fn
    assert torch.equal(padded[:201, :320].float(), odd.float())
    assert not padded[201:].float().any() and not padded[:, 320:].float().any()


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> DeepGemmFp8Gemm:
    if not KERNELS_HERE:
        pytest.skip("runs in the TRITON_INTERPRET=1 child of test_kernels_in_the_interpreter")
    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm)
    return DeepGemmFp8Gemm(GemmSpec(torch.bfloat16), DEVICE)


test_kernels_in_the_interpreter = interpreter_child(__file__)


@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (7, 384, 1024), (33, 201, 320), (130, 128, 128)])
def test_apply_matches_reference(backend: DeepGemmFp8Gemm, m: int, n: int, k: int) -> None:
    """Through the fake library, which also asserts the layouts DeepGEMM reads (N padded to 8, K to 128,
    scales MN-major and TMA-aligned)."""
    g = torch.Generator().manual_seed(m)
    w_q, w_scale = quantize_block_fp8(torch.randn(n, k, generator=g) / k**0.5)
    x = torch.randn(m, k, generator=g).to(DEVICE, torch.bfloat16)
    reference = TorchRefFp8Gemm(GemmSpec(torch.bfloat16), DEVICE)
    out = backend.apply(x, backend.prepare(w_q, w_scale))
    assert out.shape == (m, n) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert_close(out, reference.apply(x, reference.prepare(w_q, w_scale)), torch.bfloat16, f"deepgemm m{m} n{n} k{k}")


def test_quantize_activation_matches_reference(backend: DeepGemmFp8Gemm) -> None:
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)).to(DEVICE, torch.bfloat16)
    q, scales = backend.quantize_activation(x)
    ref_q, ref_scales = per_token_group_quant_fp8(x.cpu())
    assert torch.equal(scales.cpu(), ref_scales) and torch.equal(q.cpu().float(), ref_q.float())


def test_prepare_and_apply_check_their_arguments(backend: DeepGemmFp8Gemm) -> None:
    w_q, w_scale = quantize_block_fp8(torch.randn(256, 256))
    with pytest.raises(ValueError, match="weight must be a 2-D float8_e4m3fn"):
        backend.prepare(w_q.float(), w_scale)
    with pytest.raises(ValueError, match=r"must be float32 of shape \(2, 2\)"):
        backend.prepare(w_q, w_scale[:1])
    packed = backend.prepare(w_q, w_scale)
    with pytest.raises(ValueError, match=r"x must be \[M, 256\] of dtype torch.bfloat16"):
        backend.apply(torch.randn(3, 256, device=DEVICE), packed)
