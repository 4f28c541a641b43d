"""The "cutlass" block-FP8 GEMM: our own CUTLASS 3.x kernel for sm90a (csrc/), a TMA warp-specialized GEMM
with CUTLASS's blockwise-scaled FP8 mainloop (1 x 128 activation groups, 128 x 128 weight blocks, float32
accumulation, bf16 out), built from the headers of the `nvidia-cutlass` package (or a CUTLASS checkout
named by $PLUGSERVE_CUTLASS_DIR) at the backend's first construction with torch.utils.cpp_extension.load.

Two tile configurations, chosen per call by M: 64 x 128 ping-pong for M <= 64 (decode), 128 x 128
cooperative with 1 x 2 clusters above. Activations are quantized by plugserve's Triton per-token-group
kernel into M-major scales whose columns are padded to 4 floats (16 bytes, the alignment of the scales'
TMA load); weight scales are used as the checkpoint stores them. N must be a multiple of 8 and K of 16.

The build (two kernels, about a minute or two with nvcc) lands in $PLUGSERVE_BUILD_DIR or
~/.cache/plugserve/build, and is reused while the sources, flags and headers stay the same.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import torch

from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import Availability, Fp8GemmBackend, GemmCapabilities
from plugserve.core.layers.quant import FP8_DTYPE, scale_grid
from plugserve.core.specs import GemmSpec
from plugserve.plugins.triton_support import triton_availability
from plugserve.registry import hookimpl

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("bindings.cpp", "fp8_blockwise_gemm_sm90_64x128.cu", "fp8_blockwise_gemm_sm90_128x128.cu")
EXTENSION_NAME = "plugserve_cutlass_fp8"
CUTLASS_DIR_ENV = "PLUGSERVE_CUTLASS_DIR"  # a CUTLASS checkout, or its include/ folder
BUILD_DIR_ENV = "PLUGSERVE_BUILD_DIR"
MIN_CUTLASS = (3, 9)  # Sm90BlockwiseScaleConfig and the FP8Blockwise schedules appeared; checked with 4.2
SMALL_M_MAX = 64  # the largest M that runs on 64-row tiles
BLOCK = 128
N_ALIGN, K_ALIGN = 8, 16  # bf16 output rows and e4m3 operand rows of 16 bytes (TMA)
NVCC_FLAGS = (
    "-O3",
    "-DNDEBUG",  # device asserts are calls, and a call splits the wgmma pipeline (ptxas C7510: serialized wgmma)
    "-std=c++20",
    "-gencode=arch=compute_90a,code=sm_90a",  # wgmma and setmaxnreg exist only in the "a" target
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    # torch's extension builds define these, which hide the half/bfloat16 operators CUTLASS uses.
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


class CutlassNotFound(LookupError):
    """No usable CUTLASS headers; the message says where it looked and what to do."""


def parse_cutlass_version(version_h: str) -> tuple[int, int, int]:
    """(major, minor, patch) from the text of cutlass/version.h; ValueError when a define is missing."""
    numbers = []
    for name in ("MAJOR", "MINOR", "PATCH"):
        match = re.search(rf"#define\s+CUTLASS_{name}\s+(\d+)", version_h)
        if match is None:
            raise ValueError(f"cutlass/version.h defines no CUTLASS_{name}")
        numbers.append(int(match[1]))
    major, minor, patch = numbers
    return major, minor, patch


def _include_dir(path: Path) -> Path | None:
    """`path` itself or its include/ when it holds cutlass/version.h and cute/tensor.hpp."""
    for candidate in (path, path / "include"):
        if (candidate / "cutlass" / "version.h").is_file() and (candidate / "cute" / "tensor.hpp").is_file():
            return candidate
    return None


def locate_cutlass(environ: Mapping[str, str] = os.environ) -> tuple[Path, tuple[int, int, int]]:
    """The CUTLASS include folder and its version: $PLUGSERVE_CUTLASS_DIR when set, else the headers the
    `nvidia-cutlass` wheel ships (cutlass_library/source/include; found without importing the package).
    Raises CutlassNotFound saying what is missing, or which version was found when it is too old."""
    if environ.get(CUTLASS_DIR_ENV):
        where = Path(environ[CUTLASS_DIR_ENV])
        include = _include_dir(where)
        if include is None:
            raise CutlassNotFound(f"{CUTLASS_DIR_ENV}={where} holds no cutlass/version.h and cute/tensor.hpp "
                                  "(point it at a CUTLASS checkout or its include/ folder)")
    else:
        spec = importlib.util.find_spec("cutlass_library")
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        include = next((i for i in (_include_dir(Path(p) / "source") for p in locations) if i), None)
        if include is None:
            raise CutlassNotFound("CUTLASS headers not found: pip install nvidia-cutlass, or set "
                                  f"{CUTLASS_DIR_ENV} to a CUTLASS checkout")
    version = parse_cutlass_version((include / "cutlass" / "version.h").read_text())
    if version[:2] < MIN_CUTLASS:
        raise CutlassNotFound(f"CUTLASS {_dotted(version)} at {include} is too old: the blockwise-scaled FP8 GEMM "
                              f"needs {_dotted(MIN_CUTLASS)} or newer (pip install -U nvidia-cutlass)")
    return include, version


def cuda_toolkit() -> Path:
    """The CUDA toolkit torch builds extensions with (CUDA_HOME); RuntimeError when it has no nvcc."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").is_file():
        raise RuntimeError(f"no CUDA toolkit with nvcc (CUDA_HOME={CUDA_HOME}): the CUTLASS kernel is built at "
                           "first use; install the CUDA toolkit and set CUDA_HOME")
    return Path(CUDA_HOME)


def include_dirs(cutlass_include: Path, cuda_home: Path) -> list[str]:
    """CUTLASS' include/ and, where it exists, CUDA 13's include/cccl (libcu++'s cuda/std/* moved there)."""
    cccl = cuda_home / "include" / "cccl"
    return [str(cutlass_include)] + ([str(cccl)] if cccl.is_dir() else [])


def build_directory(environ: Mapping[str, str] = os.environ) -> Path:
    """$PLUGSERVE_BUILD_DIR/plugserve_cutlass_fp8, by default under ~/.cache/plugserve/build."""
    root = environ.get(BUILD_DIR_ENV) or Path.home() / ".cache" / "plugserve" / "build"
    return Path(root) / EXTENSION_NAME


@functools.cache
def load_extension() -> ModuleType:
    """Build (or reuse) and import the extension. RuntimeError naming the headers, toolkit and build folder."""
    from torch.utils.cpp_extension import load

    include, version = locate_cutlass()
    cuda_home = cuda_toolkit()
    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return load(
            name=EXTENSION_NAME,
            sources=[str(CSRC / source) for source in SOURCES],
            extra_include_paths=include_dirs(include, cuda_home),
            extra_cflags=["-O3"],
            extra_cuda_cflags=list(NVCC_FLAGS),
            build_directory=str(build_dir),
        )
    except Exception as exc:
        raise RuntimeError(f"building the CUTLASS block-FP8 GEMM ({CSRC}) against CUTLASS "
                           f"{_dotted(version)} at {include} with {cuda_home}/bin/nvcc in {build_dir} "
                           f"failed: {exc}") from exc


def pick_kernel(m: int) -> str:
    """The extension's function for M rows: 64-row ping-pong tiles up to SMALL_M_MAX, 128-row beyond."""
    return "gemm_64x128" if m <= SMALL_M_MAX else "gemm_128x128"


@dataclass(frozen=True)
class CutlassFp8Weight:
    """weight [N, K] float8_e4m3fn and weight_scale_inv [ceil(N/128), ceil(K/128)] float32, both contiguous."""

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor


def pack_weight(
    weight: torch.Tensor, weight_scale_inv: torch.Tensor, device: torch.device, block_shape: tuple[int, int]
) -> CutlassFp8Weight:
    """Checks the kernel's shape rules and makes both tensors contiguous on `device`."""
    if weight.dim() != 2 or weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight must be a 2-D float8_e4m3fn tensor [N, K], got shape {tuple(weight.shape)} "
                         f"of dtype {weight.dtype}")
    expected = scale_grid(*weight.shape, block_shape)
    if tuple(weight_scale_inv.shape) != expected or weight_scale_inv.dtype != torch.float32:
        raise ValueError(f"weight_scale_inv of a {tuple(weight.shape)} weight in {block_shape} blocks must be "
                         f"float32 of shape {expected}, got {weight_scale_inv.dtype} of shape "
                         f"{tuple(weight_scale_inv.shape)}")
    n, k = weight.shape
    if n % N_ALIGN or k % K_ALIGN:
        raise ValueError(f"the cutlass GEMM needs N a multiple of {N_ALIGN} and K of {K_ALIGN} (16-byte rows for TMA), "
                         f"got a [{n}, {k}] weight")
    return CutlassFp8Weight(weight.to(device).contiguous(), weight_scale_inv.to(device).contiguous())


class CutlassFp8Gemm(Fp8GemmBackend):
    name: ClassVar[str] = "cutlass"
    verified: ClassVar[str] = "gpu"
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        dtypes=frozenset({torch.bfloat16}),
        devices=frozenset({"cuda"}),
        min_capability=(9, 0),
        max_capability=(9, 0),
        block_shapes=frozenset({(BLOCK, BLOCK)}),
        cuda_graph=True,  # tile config chosen by M; the workspace comes from torch's allocator (the graph's pool)
        batch_invariant_note="its tile config is chosen by M",
    )
    priority: ClassVar[dict[str, int]] = {"sm90": 45}  # below Triton's 50 until a shootout table ranks them

    def __init__(self, spec: GemmSpec, device: torch.device) -> None:
        """Builds the kernels on first use (minutes); RuntimeError with the reason when that cannot work."""
        super().__init__(spec, device)
        if device.type != "cuda":
            raise RuntimeError(f"the cutlass GEMM runs on CUDA, not {device.type}")
        available = self.availability(Hardware.detect(device))
        if not available:
            raise RuntimeError(f"the cutlass GEMM cannot run here: {available.reason}")
        self.kernels = load_extension()

    @classmethod
    def availability(cls, hardware: Hardware) -> Availability:
        if hardware.is_cuda and hardware.capability != (9, 0):
            return Availability.no(f"needs sm90a (Hopper): the kernel uses wgmma and TMA, this GPU is {hardware.arch}")
        available = super().availability(hardware)
        if not available:
            return available
        if torch.version.cuda is None:
            return Availability.no(f"torch {torch.__version__} is built without CUDA")
        try:
            locate_cutlass()
            cuda_toolkit()
        except (CutlassNotFound, RuntimeError) as exc:
            return Availability.no(str(exc))
        from torch.utils.cpp_extension import is_ninja_available

        if not is_ninja_available():
            return Availability.no("ninja is not installed (torch's extension builds need it): pip install ninja")
        return triton_availability(hardware)

    def prepare(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> CutlassFp8Weight:
        """weight [N, K] float8_e4m3fn (N % 8 == 0, K % 16 == 0), weight_scale_inv [ceil(N/128), ceil(K/128)]
        float32: used as they are (the kernel reads the scales K-major)."""
        return pack_weight(weight, weight_scale_inv, self.device, self.spec.block_shape)

    def apply(self, x: torch.Tensor, packed: CutlassFp8Weight) -> torch.Tensor:
        """x [M, K] bfloat16 -> [M, N] bfloat16."""
        from plugserve.plugins.gemm import triton_kernels

        n, k = packed.weight.shape
        if x.dim() != 2 or x.shape[1] != k or x.dtype != self.spec.dtype:
            raise ValueError(f"x must be [M, {k}] of dtype {self.spec.dtype}, "
                             f"got shape {tuple(x.shape)} of dtype {x.dtype}")
        m = x.shape[0]
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
        if m == 0:
            return out
        x_q, x_scales = triton_kernels.per_token_group_quant_fp8(
            x, BLOCK, column_major_scales=True, tma_aligned_scales=True
        )
        getattr(self.kernels, pick_kernel(m))(x_q, x_scales, packed.weight, packed.weight_scale_inv, out)
        return out

    def quantize_activation(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (x_q [M, K] float8_e4m3fn, scales [M, ceil(K/128)] float32 row-major)."""
        from plugserve.plugins.gemm import triton_kernels

        return triton_kernels.per_token_group_quant_fp8(x, self.spec.block_shape[1])


@hookimpl
def plugserve_backends() -> list[type[Fp8GemmBackend]]:
    return [CutlassFp8Gemm]
