"""The "cutlass" GEMM on the CPU: availability and what it names, where it finds CUTLASS and how it builds,
the weight checks, and `apply` end to end with the compiled kernels replaced by a float32 emulation that
reads the activation scales the way the kernel's layout does (column kb at offset kb * ld, ld the padded M)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from plugserve.conformance.tolerances import assert_close
from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import Fp8GemmBackend
from plugserve.core.layers.quant import per_token_group_quant_fp8, quantize_block_fp8
from plugserve.core.specs import GemmSpec
from plugserve.plugins.gemm import cutlass
from plugserve.plugins.gemm.cutlass import (
    CSRC,
    CUTLASS_DIR_ENV,
    NVCC_FLAGS,
    SOURCES,
    CutlassFp8Gemm,
    CutlassNotFound,
    build_directory,
    include_dirs,
    locate_cutlass,
    pack_weight,
    parse_cutlass_version,
    pick_kernel,
)
from plugserve.plugins.gemm.torch_ref import block_fp8_matmul
from plugserve.registry import Registry

CPU = torch.device("cpu")
BLOCK = (128, 128)
H100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 << 30, 132)
VERSION_H = "#define CUTLASS_MAJOR {}\n#define CUTLASS_MINOR {}\n#define CUTLASS_PATCH {} \n"


def _fake_cutlass(root: Path, version: tuple[int, int, int] = (4, 2, 0)) -> Path:
    """A CUTLASS-looking include/ folder under root: cutlass/version.h and cute/tensor.hpp."""
    include = root / "include"
    (include / "cutlass").mkdir(parents=True)
    (include / "cute").mkdir()
    (include / "cutlass" / "version.h").write_text(VERSION_H.format(*version))
    (include / "cute" / "tensor.hpp").write_text("#pragma once\n")
    return include


@pytest.fixture
def no_cutlass_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if nvidia-cutlass were not installed, whether or not it is."""
    monkeypatch.setattr(cutlass.importlib.util, "find_spec", lambda name: None)


# -- declaration, availability ---------------------------------------------------------------------------


def test_declared_and_registered() -> None:
    CutlassFp8Gemm.check_declaration()
    registry = Registry(builtin=("plugserve.plugins.gemm.torch_ref", "plugserve.plugins.gemm.cutlass"),
                        entry_points=False)
    assert not registry.broken and registry.get("gemm", "cutlass").cls is CutlassFp8Gemm


def test_availability_on_the_wrong_hardware() -> None:
    assert CutlassFp8Gemm.availability(Hardware.detect(CPU)).reason == "runs on cuda, not cpu"
    for capability, arch in (((8, 0), "sm80"), ((10, 0), "sm100"), ((12, 0), "sm120")):
        reason = CutlassFp8Gemm.availability(Hardware("cuda", "GPU", capability, 80 << 30, 100)).reason
        assert reason.startswith("needs sm90a (Hopper)") and reason.endswith(f"this GPU is {arch}")


def test_availability_names_the_missing_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_cutlass_package: None
) -> None:
    monkeypatch.setattr(cutlass.torch.version, "cuda", "13.0")  # as on the GPU machine
    monkeypatch.delenv(CUTLASS_DIR_ENV, raising=False)
    assert "pip install nvidia-cutlass" in CutlassFp8Gemm.availability(H100).reason
    monkeypatch.setenv(CUTLASS_DIR_ENV, str(tmp_path / "nowhere"))
    assert f"{CUTLASS_DIR_ENV}={tmp_path / 'nowhere'} holds no cutlass/version.h" in (
        CutlassFp8Gemm.availability(H100).reason
    )
    _fake_cutlass(tmp_path / "old", (3, 8, 0))
    monkeypatch.setenv(CUTLASS_DIR_ENV, str(tmp_path / "old"))
    assert "CUTLASS 3.8.0 at" in CutlassFp8Gemm.availability(H100).reason
    _fake_cutlass(tmp_path / "good")
    monkeypatch.setenv(CUTLASS_DIR_ENV, str(tmp_path / "good"))
    monkeypatch.setattr("torch.utils.cpp_extension.CUDA_HOME", None)
    assert "no CUDA toolkit with nvcc (CUDA_HOME=None)" in CutlassFp8Gemm.availability(H100).reason
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_text("")
    monkeypatch.setattr("torch.utils.cpp_extension.CUDA_HOME", str(toolkit))
    monkeypatch.setattr("torch.utils.cpp_extension.is_ninja_available", lambda: False)
    assert "pip install ninja" in CutlassFp8Gemm.availability(H100).reason
    monkeypatch.setattr("torch.utils.cpp_extension.is_ninja_available", lambda: True)
    assert CutlassFp8Gemm.availability(H100)  # headers, nvcc, ninja, triton: nothing missing
    monkeypatch.setattr(cutlass.torch.version, "cuda", None)
    assert "is built without CUDA" in CutlassFp8Gemm.availability(H100).reason


def test_constructing_it_where_it_cannot_run_says_why() -> None:
    with pytest.raises(RuntimeError, match="runs on CUDA, not cpu"):
        CutlassFp8Gemm(GemmSpec(), CPU)


def test_capabilities() -> None:
    check = CutlassFp8Gemm.capabilities.check
    assert check(GemmSpec(), Phase.DECODE) and check(GemmSpec(), Phase.PREFILL)
    assert check(GemmSpec(dtype=torch.float16), Phase.DECODE).reason == (
        "dtype float16 is not supported (supports bfloat16)"
    )


# -- finding CUTLASS, building ------------------------------------------------------------------------------


def test_parse_cutlass_version() -> None:
    text = "#pragma once\n" + VERSION_H.format(4, 2, 0) + "#define CUTLASS_BUILD 0\n"
    assert parse_cutlass_version(text) == (4, 2, 0)
    with pytest.raises(ValueError, match="CUTLASS_PATCH"):
        parse_cutlass_version("#define CUTLASS_MAJOR 3\n#define CUTLASS_MINOR 9\n")


def test_locate_cutlass_from_the_environment(tmp_path: Path, no_cutlass_package: None) -> None:
    include = _fake_cutlass(tmp_path / "checkout", (3, 9, 2))
    assert locate_cutlass({CUTLASS_DIR_ENV: str(tmp_path / "checkout")}) == (include, (3, 9, 2))
    assert locate_cutlass({CUTLASS_DIR_ENV: str(include)}) == (include, (3, 9, 2))  # include/ itself
    with pytest.raises(CutlassNotFound, match="pip install nvidia-cutlass"):
        locate_cutlass({})


def test_locate_cutlass_in_the_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-cutlass installs its headers as cutlass_library/source/include; the environment wins over it."""
    package = tmp_path / "site" / "cutlass_library"
    include = _fake_cutlass(package / "source")
    spec = SimpleNamespace(submodule_search_locations=[str(package)])
    monkeypatch.setattr(cutlass.importlib.util, "find_spec", lambda name: spec if name == "cutlass_library" else None)
    assert locate_cutlass({}) == (include, (4, 2, 0))
    other = _fake_cutlass(tmp_path / "other", (4, 3, 0))
    assert locate_cutlass({CUTLASS_DIR_ENV: str(tmp_path / "other")}) == (other, (4, 3, 0))


def test_build_options(tmp_path: Path) -> None:
    assert "-gencode=arch=compute_90a,code=sm_90a" in NVCC_FLAGS and "-std=c++20" in NVCC_FLAGS
    assert "-DNDEBUG" in NVCC_FLAGS  # device asserts would serialize the wgmma pipeline
    include = _fake_cutlass(tmp_path / "cutlass")
    (tmp_path / "cuda12" / "include").mkdir(parents=True)
    assert include_dirs(include, tmp_path / "cuda12") == [str(include)]
    (tmp_path / "cuda13" / "include" / "cccl").mkdir(parents=True)
    assert include_dirs(include, tmp_path / "cuda13") == [str(include), str(tmp_path / "cuda13" / "include" / "cccl")]
    assert build_directory({"PLUGSERVE_BUILD_DIR": str(tmp_path)}) == tmp_path / "plugserve_cutlass_fp8"
    assert build_directory({}) == Path.home() / ".cache" / "plugserve" / "build" / "plugserve_cutlass_fp8"


def test_sources_define_what_python_calls() -> None:
    assert all((CSRC / source).is_file() for source in SOURCES)
    bindings = (CSRC / "bindings.cpp").read_text()
    assert set(re.findall(r'module\.def\("(\w+)"', bindings)) == {pick_kernel(1), pick_kernel(4096)}
    assert "TORCH_EXTENSION_NAME" in bindings


def test_pick_kernel() -> None:
    assert [pick_kernel(m) for m in (1, 8, 64, 65, 4096)] == ["gemm_64x128"] * 3 + ["gemm_128x128"] * 2


# -- weights and apply -------------------------------------------------------------------------------------


def test_pack_weight_checks_shapes() -> None:
    w_q, w_s = quantize_block_fp8(torch.randn(200, 320), BLOCK)
    packed = pack_weight(w_q, w_s.t().contiguous().t(), CPU, BLOCK)
    assert packed.weight.is_contiguous() and packed.weight_scale_inv.is_contiguous()
    assert torch.equal(packed.weight_scale_inv, w_s)
    with pytest.raises(ValueError, match="N a multiple of 8 and K of 16"):
        pack_weight(*quantize_block_fp8(torch.randn(100, 320), BLOCK), CPU, BLOCK)
    with pytest.raises(ValueError, match=r"got a \[256, 300\] weight"):
        pack_weight(*quantize_block_fp8(torch.randn(256, 300), BLOCK), CPU, BLOCK)
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        pack_weight(w_q, w_s[:, :2], CPU, BLOCK)


class EmulatedKernels:
    """Stands in for the compiled extension: the binding's operand checks, then the product with the
    activation scales read as the kernel's TMA does, from the underlying buffer at m + kb * ld."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _gemm(self, name: str, a, a_scales, b, b_scales, out) -> None:
        self.calls.append(name)
        (m, k), n = a.shape, b.shape[0]
        kb, ld = -(-k // 128), a_scales.stride(1)
        assert a.dtype == b.dtype == torch.float8_e4m3fn and a.is_contiguous() and b.is_contiguous()
        assert k % 16 == 0 and n % 8 == 0 and b.shape[1] == k
        assert a_scales.shape == (m, kb) and a_scales.stride(0) == 1 and ld >= m and ld % 4 == 0
        assert b_scales.shape == (-(-n // 128), kb) and b_scales.is_contiguous()
        assert out.shape == (m, n) and out.dtype == torch.bfloat16 and out.is_contiguous()
        buffer = a_scales.untyped_storage()
        flat = torch.empty(0, dtype=torch.float32).set_(buffer, a_scales.storage_offset(), (ld * kb,))
        sfa = flat.view(kb, ld)[:, :m].t()  # what layout ((1, ld), (128, kb)) : ((0, 1), (0, ld)) addresses
        sa = sfa.repeat_interleave(128, dim=1)[:, :k]
        sb = b_scales.repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)[:, :k]
        out.copy_((a.float() * sa) @ (b.float() * sb).t())

    def gemm_64x128(self, *operands) -> None:
        self._gemm("gemm_64x128", *operands)

    def gemm_128x128(self, *operands) -> None:
        self._gemm("gemm_128x128", *operands)


def _with_emulated_kernels() -> CutlassFp8Gemm:
    backend = CutlassFp8Gemm.__new__(CutlassFp8Gemm)
    Fp8GemmBackend.__init__(backend, GemmSpec(), CPU)  # skips the build: nothing compiles on the CPU
    backend.kernels = EmulatedKernels()
    return backend


@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (7, 384, 1024), (33, 200, 320), (64, 2112, 256), (65, 128, 128)])
def test_apply_matches_reference(m: int, n: int, k: int) -> None:
    """M not a multiple of 4 (scales padded), N not a multiple of 128, K not of 128, both tile choices."""
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w_q, w_s = quantize_block_fp8(torch.randn(n, k, generator=g) / k**0.5, BLOCK)
    backend = _with_emulated_kernels()
    out = backend.apply(x, backend.prepare(w_q, w_s))
    assert backend.kernels.calls == [pick_kernel(m)]
    x_q, x_s = per_token_group_quant_fp8(x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert_close(out, block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, torch.bfloat16), torch.bfloat16,
                 f"cutlass m{m}-n{n}-k{k}")


def test_apply_validates_and_handles_empty_batches() -> None:
    backend = _with_emulated_kernels()
    packed = backend.prepare(*quantize_block_fp8(torch.randn(256, 512), BLOCK))
    with pytest.raises(ValueError, match=r"x must be \[M, 512\] of dtype torch.bfloat16"):
        backend.apply(torch.randn(3, 512), packed)
    assert backend.apply(torch.randn(0, 512, dtype=torch.bfloat16), packed).shape == (0, 256)
    assert backend.kernels.calls == []
