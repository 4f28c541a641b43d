"""The "triton" block-FP8 GEMM backend: a Triton per-token-group quantizer and a w8a8 GEMM whose
K loop applies the activation and weight block scales to a float32 accumulator, one 128-wide K
block at a time (DeepSeek-V3's recipe). At decode-sized M, where the output tiles alone would leave
SMs idle, K is split over several programs per tile (SPLIT_K) and their float32 partials summed.

Under `GemmSpec.batch_invariant` (--enable-deterministic-inference) every M runs the Triton kernel with
`BATCH_INVARIANT_CONFIG`: one tile, no split-K, no Gluon kernel, so a row's sums do not depend on the rows beside it.

Kernel launch configs are tuned per weight shape and GPU (benchmarks/tune/tune_fp8_gemm.py) into
`configs/N={N},K={K},device_name={device},dtype=fp8_w8a8,block_shape=[128, 128].json` (or the
folder $PLUGSERVE_GEMM_CONFIG_DIR names), mapping batch sizes M to configs; a call takes the entry
of the nearest M, or `default_config` when the shape has no file for this GPU nor for the closest
measured one of its compute capability (plugserve.core.device_match; the choice is logged).

The kernels (plugserve.plugins.gemm.triton_kernels) are imported on first use, not with the
plugin: triton reads TRITON_INTERPRET when it defines them. fp8 `tl.dot` needs sm89 (Ada) or
newer; on the CPU the backend runs only in Triton's interpreter (TRITON_INTERPRET=1), for tests.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from plugserve.core.device_match import DeviceMatch, closest_measured, measured_device_keys
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import Availability, Fp8GemmBackend, GemmCapabilities
from plugserve.core.layers.quant import ceil_div
from plugserve.core.specs import GemmSpec
from plugserve.plugins.triton_support import triton_availability
from plugserve.registry import hookimpl

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "configs"
# Where the backend looks for tuned configs instead of CONFIG_DIR (the tuning script's --output-dir).
CONFIG_DIR_ENV = "PLUGSERVE_GEMM_CONFIG_DIR"
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
# A launch config: CONFIG_KEYS and SPLIT_K (K cut over that many programs per output tile; 1 when a file
# omits it) -> int, and where set, the kernel's LAUNCH_FLAGS (0 or 1; 0 when absent).
Config = dict[str, int]
LAUNCH_FLAGS = ("TMA",)
# Untuned split-K aims at this many programs per SM, and gives each at least this many K blocks.
_SPLIT_K_WAVES = 2
_SPLIT_K_MIN_BLOCKS = 4
# Under batch invariance, for every M (any split-K or tile that follows M changes a row's summation order): 64-row
# tiles hold a decode batch of up to 64 rows in one row tile, so each weight tile streams from memory once a step,
# and are one warpgroup's wgmma M on Hopper; 64-column tiles give a narrow weight the most programs it gets without
# split-K (a decode GEMM is weight-bandwidth bound; the tuned H100 / H200 files pick 64 x 64 at M 64); the K block is
# the 128-wide scale group; 4 stages keep four K blocks of loads in flight per program, which a decode batch's one
# program an SM needs to stream at bandwidth.
BATCH_INVARIANT_CONFIG: Config = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                                  "num_warps": 4, "num_stages": 4, "SPLIT_K": 1}


def config_file_name(n: int, k: int, device_name: str, block_shape: tuple[int, int] = (128, 128)) -> str:
    """`N=2112,K=7168,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8,block_shape=[128, 128].json`.
    device_name: torch.cuda.get_device_name() with spaces as underscores (Hardware.device_key)."""
    return f"N={n},K={k},device_name={device_name},dtype=fp8_w8a8,block_shape=[{block_shape[0]}, {block_shape[1]}].json"


@functools.cache
def load_configs(
    n: int, k: int, device_name: str, block_shape: tuple[int, int], config_dir: Path
) -> dict[int, Config] | None:
    """The tuned configs of an [N, K] weight on `device_name`, by M in increasing order, or None when
    there is no file. Raises ValueError naming the file when it is malformed. Cached: do not mutate."""
    path = config_dir / config_file_name(n, k, device_name, block_shape)
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        configs = {int(m): {**{key: int(entry[key]) for key in CONFIG_KEYS}, "SPLIT_K": int(entry.get("SPLIT_K", 1)),
                            **{flag: int(entry[flag]) for flag in LAUNCH_FLAGS if flag in entry}}
                   for m, entry in raw.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: expected {{M: {{{', '.join(CONFIG_KEYS)}}}}}: {exc!r}") from exc
    wrong = sorted(m for m, config in configs.items()
                   if config["BLOCK_SIZE_K"] != block_shape[1] or config["SPLIT_K"] < 1
                   or any(config.get(flag, 0) not in (0, 1) for flag in LAUNCH_FLAGS))
    if not configs or wrong:
        raise ValueError(f"{path}: needs at least one entry, each with BLOCK_SIZE_K {block_shape[1]}, SPLIT_K "
                         f">= 1 and {' / '.join(LAUNCH_FLAGS)} 0 or 1 where given (wrong for M {wrong})")
    return dict(sorted(configs.items()))


@functools.cache
def config_device(hardware: Hardware, n: int, k: int, block_shape: tuple[int, int], config_dir: Path) -> DeviceMatch:
    """Whose tuned configs of an [N, K] weight this GPU uses: its own file's, else the closest measured GPU's;
    logged once per shape when not its own."""
    measured = measured_device_keys(config_dir, lambda key: config_file_name(n, k, key, block_shape))
    match = closest_measured(hardware, measured, f"tuned config N={n},K={k}")
    if not match.exact:
        logger.info("triton fp8 GEMM: %s%s", match.reason, "" if match.key else "; default configs")
    return match


def default_config(m: int, block_shape: tuple[int, int] = (128, 128), n: int | None = None, k: int | None = None,
                   num_sms: int | None = None) -> Config:
    """Untuned fallback, from a short tuning run of V3's shapes on an H100: 16-row tiles for
    decode-sized batches (weight-bandwidth bound: many narrow N tiles), 64 x 128 tiles with grouped
    ordering for prefill. Given the weight's N and K and the GPU's SM count, split-K where the output
    tiles would leave SMs idle (decode-sized M against a narrow N), keeping several K blocks per split."""
    if m <= 16:
        bm, bn, group, warps, stages = 16, 64, 1, 4, 4
    elif m <= 64:
        bm, bn, group, warps, stages = 32, 64, 8, 4, 3
    else:
        bm, bn, group, warps, stages = 64, 128, 8, 4, 3
    split_k = 1
    if n is not None and k is not None and num_sms:
        tiles = ceil_div(m, bm) * ceil_div(n, bn)
        split_k = max(1, min(_SPLIT_K_WAVES * num_sms // tiles, ceil_div(k, block_shape[1]) // _SPLIT_K_MIN_BLOCKS))
    return {**dict(zip(CONFIG_KEYS, (bm, bn, block_shape[1], group, warps, stages), strict=True)), "SPLIT_K": split_k}


def pick_config(m: int, configs: dict[int, Config] | None, block_shape: tuple[int, int] = (128, 128),
                n: int | None = None, k: int | None = None, num_sms: int | None = None) -> Config:
    """The config of the nearest tuned M (ties go to the smaller M), or `default_config` for this M and
    weight shape on a GPU of `num_sms` SMs."""
    if not configs:
        return default_config(m, block_shape, n, k, num_sms)
    return configs[min(configs, key=lambda tuned: (abs(tuned - m), tuned))]


@dataclass(frozen=True)
class TritonFp8Weight:
    """weight [N, K] float8_e4m3fn and weight_scale_inv [ceil(N/bn), ceil(K/bk)] float32, both
    contiguous on the backend's device, and the tuned configs of this shape (None: defaults)."""

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor
    configs: dict[int, Config] | None


class TritonFp8Gemm(Fp8GemmBackend):
    """Block-FP8 GEMM in Triton (Gluon on sm90 for large M): see the module docstring. Batch-invariant under the
    spec's flag: one launch config (`BATCH_INVARIANT_CONFIG`) for every M, no split-K, no Gluon kernel."""

    name: ClassVar[str] = "triton"
    verified: ClassVar[str] = "gpu"
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        devices=frozenset({"cuda", "cpu"}),
        min_capability=(8, 9),  # float8e4nv tl.dot: Ada / Hopper tensor cores
        block_shapes=frozenset({(128, 128)}),
        cuda_graph=True,  # launch configs chosen by M, a shape
        batch_invariant=True,  # under the spec's flag: BATCH_INVARIANT_CONFIG at every M, no split-K, no Gluon
    )
    priority: ClassVar[dict[str, int]] = {"cuda": 50, "cpu": -1}  # on the CPU (interpreter) the reference wins

    def __init__(self, spec: GemmSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self.hardware = Hardware.detect(device)
        self.config_dir = Path(os.environ.get(CONFIG_DIR_ENV, CONFIG_DIR))

    @classmethod
    def availability(cls, hardware: Hardware) -> Availability:
        available = super().availability(hardware)
        return triton_availability(hardware) if available else available

    def prepare(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> TritonFp8Weight:
        """weight [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/bn), ceil(K/bk)] float32, made
        contiguous on this backend's device; looks up the tuned configs of [N, K] (this rank's slice of a
        tensor-parallel layer) on this GPU, or the closest measured one, once."""
        self.check_weight(weight, weight_scale_inv)
        n, k = weight.shape
        block = self.spec.block_shape
        device_key = config_device(self.hardware, n, k, block, self.config_dir).key
        return TritonFp8Weight(
            weight.to(self.device).contiguous(),
            weight_scale_inv.to(self.device).contiguous(),
            None if device_key is None else load_configs(n, k, device_key, block, self.config_dir),
        )

    def apply(self, x: torch.Tensor, packed: TritonFp8Weight) -> torch.Tensor:
        """x [M, K] of spec.dtype -> [M, N] of spec.dtype. Quantizes x with column-major scales (the
        GEMM reads one K block's M scales at a time), then runs the GEMM: the Gluon kernel where
        `gluon_gemm_fits` (sm90, from GLUON_MIN_M rows and GLUON_MIN_K deep), else the Triton kernel with the
        config for M. Under spec.batch_invariant the Triton kernel with BATCH_INVARIANT_CONFIG at every M."""
        from plugserve.plugins.gemm import triton_kernels

        k = packed.weight.shape[1]
        if x.dim() != 2 or x.shape[1] != k or x.dtype != self.spec.dtype:
            raise ValueError(f"x must be [M, {k}] of dtype {self.spec.dtype}, "
                             f"got shape {tuple(x.shape)} of dtype {x.dtype}")
        block = self.spec.block_shape
        x_q, x_scales = triton_kernels.per_token_group_quant_fp8(x, block[1], column_major_scales=True)
        if self.hardware.device_type == "cuda" and not self.spec.batch_invariant:
            from plugserve.plugins.gemm import gluon_gemm

            if gluon_gemm.gluon_gemm_fits(x_q, packed.weight, block, self.hardware.capability,
                                          self.hardware.multiprocessors):
                return gluon_gemm.gluon_block_fp8_matmul(x_q, x_scales, packed.weight, packed.weight_scale_inv,
                                                         self.spec.dtype, self.hardware.multiprocessors)
        if self.spec.batch_invariant:
            config = BATCH_INVARIANT_CONFIG
        else:
            # The interpreter has no SMs to fill: no split-K there.
            sms = self.hardware.multiprocessors if self.hardware.device_type == "cuda" else None
            config = pick_config(x.shape[0], packed.configs, block, packed.weight.shape[0], k, sms)
        return triton_kernels.w8a8_block_fp8_matmul(
            x_q, x_scales, packed.weight, packed.weight_scale_inv, block, self.spec.dtype, config
        )

    def quantize_activation(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (x_q [M, K] float8_e4m3fn, scales [M, ceil(K/bk)] float32 row-major)."""
        from plugserve.plugins.gemm import triton_kernels

        return triton_kernels.per_token_group_quant_fp8(x, self.spec.block_shape[1])


@hookimpl
def plugserve_backends() -> list[type[Fp8GemmBackend]]:
    return [TritonFp8Gemm]
