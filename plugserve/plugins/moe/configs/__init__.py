"""Launch configurations of the `triton` MoE backend's grouped GEMM: tuned JSON files in this folder
(written by benchmarks/tune/tune_fused_moe.py), else a built-in default.

One file per (E, N, device, dtype):
``E={E},N={N},device_name={device},dtype={dtype}.json``, and for block-FP8 experts
``E={E},N={N},device_name={device},dtype=fp8_w8a8,block_shape=[128, 128].json``, where N is the expert
intermediate size I as one GPU holds it (w13 [E, 2N, H], w2 [E, H, N]; DeepSeek-V3 with 8-way tensor
parallelism: N = 2048 / 8 = 256; under expert parallelism E is one rank's n / P experts of whole width),
device is `Hardware.device_key` ("NVIDIA_H100_80GB_HBM3") and dtype the activation dtype ("bfloat16",
"float16", "float32") of unquantized experts. A GPU without its own file for (E, N, dtype) takes the
closest measured GPU's of its compute capability (plugserve.core.device_match; the choice is logged).

A file maps token counts M (T, not T * k) to a configuration; a batch uses the entry of the nearest M:
  {"64": {"BLOCK_SIZE_M": 32,
          "w13": {"BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 3},
          "w2": {...}}, ...}
BLOCK_SIZE_M is shared by both passes (the pairs are padded to it once); each pass has its own tile, which may
add "TMA": 1 (weight tiles as TMA boxes), "SPLIT_K": n (K cut into n runs, for decode batches too small to
fill the GPU with blocks alone) and "COLUMN_BLOCKS": n (the w2 pass: n column blocks a program).
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from plugserve.core.device_match import DeviceMatch, closest_measured, measured_device_keys
from plugserve.core.hardware import Hardware

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent


@dataclass(frozen=True)
class GemmConfig:
    """Tile of one grouped-GEMM pass (w13 or w2): BLOCK_SIZE_N x BLOCK_SIZE_K per step, GROUP_SIZE_M
    M-blocks per sweep over N, Triton's num_warps / num_stages, `tma`: the expert weight tiles loaded as TMA
    boxes (files say "TMA": 1; absent is off), `split_k`: K cut into that many runs, each its own program
    (files say "SPLIT_K": n; absent is 1), and `column_blocks`: that many column blocks a program, one after another
    (the w2 pass at prefill sizes, whose short K leaves each program few K steps to pipeline; files say
    "COLUMN_BLOCKS": n; absent is 1; its programs walk the M-blocks first, so group_m does not apply)."""

    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    tma: bool = False
    split_k: int = 1
    column_blocks: int = 1

    def __post_init__(self) -> None:
        if self.split_k > 1 and self.column_blocks > 1:
            raise ValueError("SPLIT_K and COLUMN_BLOCKS exclude each other: a program runs a run of K blocks of one "
                             "column block, or whole K for several")

    def to_json(self) -> dict[str, int]:
        return ({"BLOCK_SIZE_N": self.block_n, "BLOCK_SIZE_K": self.block_k, "GROUP_SIZE_M": self.group_m,
                 "num_warps": self.num_warps, "num_stages": self.num_stages} | ({"TMA": 1} if self.tma else {})
                | ({"SPLIT_K": self.split_k} if self.split_k > 1 else {})
                | ({"COLUMN_BLOCKS": self.column_blocks} if self.column_blocks > 1 else {}))

    @classmethod
    def from_json(cls, entry: dict[str, int]) -> GemmConfig:
        if entry.get("TMA", 0) not in (0, 1):
            raise ValueError(f"TMA must be 0 or 1, got {entry['TMA']!r}")
        for key in ("SPLIT_K", "COLUMN_BLOCKS"):
            if not isinstance(entry.get(key, 1), int) or entry.get(key, 1) < 1:
                raise ValueError(f"{key} must be a positive integer, got {entry[key]!r}")
        return cls(entry["BLOCK_SIZE_N"], entry["BLOCK_SIZE_K"], entry["GROUP_SIZE_M"], entry["num_warps"],
                   entry["num_stages"], bool(entry.get("TMA", 0)), entry.get("SPLIT_K", 1),
                   entry.get("COLUMN_BLOCKS", 1))


@dataclass(frozen=True)
class MoEConfig:
    """BLOCK_SIZE_M (the padding of each expert's run of pairs) and the tile of each pass."""

    block_m: int
    w13: GemmConfig
    w2: GemmConfig

    def to_json(self) -> dict[str, object]:
        return {"BLOCK_SIZE_M": self.block_m, "w13": self.w13.to_json(), "w2": self.w2.to_json()}

    @classmethod
    def from_json(cls, entry: dict) -> MoEConfig:
        if "COLUMN_BLOCKS" in entry["w13"]:
            raise ValueError("COLUMN_BLOCKS is a w2 option (the w13 pass's SiLU-and-mul holds gate and up tiles)")
        return cls(entry["BLOCK_SIZE_M"], GemmConfig.from_json(entry["w13"]), GemmConfig.from_json(entry["w2"]))


def config_file_name(
    num_experts: int, intermediate: int, device_key: str, dtype: torch.dtype, block_shape: tuple[int, int] | None
) -> str:
    """block_shape: that of block-FP8 experts (w8a8), None for unquantized ones of `dtype`."""
    if block_shape is not None:
        kind = f"dtype=fp8_w8a8,block_shape=[{block_shape[0]}, {block_shape[1]}]"
    else:
        kind = f"dtype={str(dtype).removeprefix('torch.')}"
    return f"E={num_experts},N={intermediate},device_name={device_key},{kind}.json"


def write_config_file(path: Path, configs: dict[int, MoEConfig]) -> None:
    """configs: {token count M: configuration}, written in increasing M."""
    path.write_text(json.dumps({str(m): configs[m].to_json() for m in sorted(configs)}, indent=2) + "\n")


@functools.cache
def load_config_file(path: Path) -> dict[int, MoEConfig] | None:
    """{M: configuration} of a tuned file, None when there is none."""
    if not path.is_file():
        return None
    return {int(m): MoEConfig.from_json(entry) for m, entry in json.loads(path.read_text()).items()}


def default_config(num_tokens: int, top_k: int, num_experts: int, fp8: bool, dtype: torch.dtype,
                   device_type: str) -> MoEConfig:
    """Untuned: a BLOCK_SIZE_M near the pairs an expert gets (T * k / E), tiles that fit the shared
    memory of any sm80+ GPU (3 stages; 2 for float32). On the CPU (Triton's interpreter), few large
    programs, since each costs Python time."""
    if device_type == "cpu":
        tile = GemmConfig(block_n=128, block_k=128, group_m=1, num_warps=4, num_stages=1)
        return MoEConfig(16, tile, tile)
    pairs_per_expert = num_tokens * top_k / num_experts
    block_m = 16 if pairs_per_expert <= 16 else 32 if pairs_per_expert <= 64 else 64
    block_k = 128 if fp8 else 32 if dtype == torch.float32 else 64
    stages = 2 if dtype == torch.float32 and not fp8 else 3
    group_m = 1 if block_m == 16 else 16
    return MoEConfig(
        block_m,
        GemmConfig(block_n=64, block_k=block_k, group_m=group_m, num_warps=4, num_stages=stages),
        GemmConfig(block_n=128 if block_m > 16 else 64, block_k=block_k, group_m=group_m, num_warps=4,
                   num_stages=stages),
    )


def batch_invariant_config(fp8: bool, dtype: torch.dtype, device_type: str) -> MoEConfig:
    """The one configuration of every token count under batch invariance (a block size or split-K that follows the
    token count changes a pair's summation order). On the GPU: BLOCK_SIZE_M 16, the least padding of a decode batch,
    whose 64 tokens give DeepSeek-V3's 256 experts (top-8) about 2 pairs each (the tuned H100 / H200 files pick 16 at
    every decode size); narrow column blocks, 32 for w13 and 64 for w2, so that a decode batch's few M-blocks still
    make enough programs to stream the expert weights at bandwidth without split-K (the tuned files' decode choice
    for w13); K blocks, warps and stages as `default_config` (the FP8 scale group, shared memory of any sm80+ GPU).
    On the CPU (Triton's interpreter) `default_config`, which is the same for every token count there."""
    config = default_config(1, 1, 1, fp8, dtype, device_type)  # BLOCK_SIZE_M 16: a pair an expert
    if device_type == "cpu":
        return config
    return replace(config, w13=replace(config.w13, block_n=32))


@functools.cache
def config_device(hardware: Hardware, num_experts: int, intermediate: int, dtype: torch.dtype,
                  block_shape: tuple[int, int] | None, config_dir: Path) -> DeviceMatch:
    """Whose tuned file of these experts this GPU uses: its own, else the closest measured GPU's; logged
    once per shape when not its own."""
    measured = measured_device_keys(
        config_dir, lambda key: config_file_name(num_experts, intermediate, key, dtype, block_shape))
    match = closest_measured(hardware, measured, f"tuned config E={num_experts},N={intermediate}")
    if not match.exact:
        logger.info("triton MoE: %s%s", match.reason, "" if match.key else "; default configs")
    return match


def get_config(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    intermediate: int,
    dtype: torch.dtype,
    block_shape: tuple[int, int] | None,
    hardware: Hardware,
) -> MoEConfig:
    """The tuned entry of the nearest token count for these experts (one rank's: `num_experts` local experts of
    width `intermediate`) on this device or the closest measured one, else the default. A file tuned only up to
    some M (a decode-sized tuning) does not speak for batches beyond twice its largest M: those take the default.
    block_shape: that of block-FP8 experts, None for unquantized ones."""
    device_key = config_device(hardware, num_experts, intermediate, dtype, block_shape, CONFIG_DIR).key
    tuned = device_key and load_config_file(
        CONFIG_DIR / config_file_name(num_experts, intermediate, device_key, dtype, block_shape))
    if tuned and num_tokens <= 2 * max(tuned):
        return tuned[min(tuned, key=lambda m: abs(m - num_tokens))]
    return default_config(num_tokens, top_k, num_experts, block_shape is not None, dtype, hardware.device_type)
