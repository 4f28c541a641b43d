"""Tune the "triton" block-FP8 GEMM's launch configs on this GPU and write one JSON file per weight
shape, `N={N},K={K},device_name={GPU},dtype=fp8_w8a8,block_shape=[128, 128].json`, mapping each
batch size M to its fastest config; the backend loads them from plugserve/plugins/gemm/configs/.

Each config is timed replayed from a CUDA graph with L2 flushed before every replay (median; see
benchmarks/gpu_timing.py: as the decode graphs run it, without host launch overhead), on random e4m3
operands; the winner of every M is checked against the torch reference.
Needs a CUDA GPU of sm89 or newer; refuses to run elsewhere.

    python -m benchmarks.tune.tune_fp8_gemm --quick                     # V3's shapes, ~5 min on an H100
    python -m benchmarks.tune.tune_fp8_gemm                             # the full space (hours)
    python -m benchmarks.tune.tune_fp8_gemm --shapes 2112,7168 --batch-sizes 1 64 4096 --output-dir /tmp/cfg
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from plugserve.core.layers.quant import ceil_div, quantize_block_fp8
from plugserve.plugins.gemm.triton import (
    CONFIG_DIR,
    CONFIG_KEYS,
    LAUNCH_FLAGS,
    Config,
    config_file_name,
    default_config,
    load_configs,
)

BLOCK_SHAPE = (128, 128)
# DeepSeek-V3's block-FP8 linear layers on one GPU (no tensor parallelism): (N, K) of the weight.
V3_SHAPES: dict[tuple[int, int], str] = {
    (2112, 7168): "fused q_a + kv_a projection (q_lora 1536 + kv_lora 512 + rope 64)",
    (24576, 1536): "q_b_proj (128 heads x 192)",
    (32768, 512): "kv_b_proj (128 heads x (128 nope + 128 v)), the MHA prefill path",
    (7168, 16384): "o_proj (128 heads x 128 -> hidden)",
    (36864, 7168): "dense MLP gate_up of layers 0-2 (2 x 18432)",
    (7168, 18432): "dense MLP down of layers 0-2",
    (4096, 7168): "shared expert gate_up (2 x 2048)",
    (7168, 2048): "shared expert down",
}
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Values per config key; BLOCK_SIZE_K is always the scale group, 128. SPLIT_K > 1 is tried only where the
# output tiles are fewer than the SMs (see `candidates`); a space without a launch flag leaves it off.
FULL_SPACE: dict[str, tuple[int, ...]] = {
    "BLOCK_SIZE_M": (16, 32, 64, 128),
    "BLOCK_SIZE_N": (32, 64, 128, 256),
    "GROUP_SIZE_M": (1, 8, 16, 32),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4, 5),
    "SPLIT_K": (1, 2, 3, 4, 6, 8, 12, 16),
    "TMA": (0, 1),
}
QUICK_SPACE: dict[str, tuple[int, ...]] = {
    "BLOCK_SIZE_M": (16, 32, 64, 128),
    "BLOCK_SIZE_N": (64, 128),
    "GROUP_SIZE_M": (1, 8),
    "num_warps": (4, 8),
    "num_stages": (3, 4),
    "SPLIT_K": (1, 2, 4, 8, 16),
}
# The quick search from PREFILL_M rows on: the large tiles, with and without TMA. (Triton 3.6's warp specialization
# on Hopper fails to compile this kernel's K loop: PassManager errors, or an assertion that aborts the process.)
PREFILL_M = 512
QUICK_PREFILL_SPACE: dict[str, tuple[int, ...]] = {
    "BLOCK_SIZE_M": (64, 128),
    "BLOCK_SIZE_N": (64, 128, 256),
    "GROUP_SIZE_M": (8,),
    "num_warps": (4, 8),
    "num_stages": (3, 4),
    "SPLIT_K": (1,),
    "TMA": (0, 1),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def candidates(m: int, space: dict[str, tuple[int, ...]], smem_bytes: int, n: int, k: int,
               num_sms: int) -> list[Config]:
    """The configs of `space` worth timing at batch size m for an [n, k] weight on a GPU of num_sms SMs:
    no M tile taller than m needs (beyond the smallest, 16), grouped ordering only with several M tiles,
    pipelined stages of e4m3 A and B tiles that fit `smem_bytes` of shared memory, and split-K only
    while the output tiles are fewer than the SMs, with at least two K blocks per split."""
    block_k = BLOCK_SHAPE[1]
    tallest = max(16, 1 << (m - 1).bit_length())
    k_blocks = ceil_div(k, block_k)
    configs = []
    grid = itertools.product(space["BLOCK_SIZE_M"], space["BLOCK_SIZE_N"], space["GROUP_SIZE_M"],
                             space["num_warps"], space["num_stages"], space["SPLIT_K"],
                             *(space.get(flag, (0,)) for flag in LAUNCH_FLAGS))
    for bm, bn, group, warps, stages, split_k, *flags in grid:
        if bm > tallest or (group > 1 and ceil_div(m, bm) == 1) or stages * (bm + bn) * block_k > smem_bytes:
            continue
        if split_k > 1 and (ceil_div(m, bm) * ceil_div(n, bn) >= num_sms or 2 * split_k > k_blocks):
            continue
        configs.append({**dict(zip(CONFIG_KEYS, (bm, bn, block_k, group, warps, stages), strict=True)),
                        "SPLIT_K": split_k, **{flag: 1 for flag, on in zip(LAUNCH_FLAGS, flags, strict=True) if on}})
    return configs


def write_configs(best: dict[int, Config], n: int, k: int, device_name: str, output_dir: Path,
                  update: bool = False) -> Path:
    """{M: config} -> `config_file_name(n, k, device_name)` in output_dir, keys in increasing M; `update`: the
    existing file's entries for other M are kept."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / config_file_name(n, k, device_name, BLOCK_SHAPE)
    kept = {int(m): config for m, config in json.loads(path.read_text()).items()} if update and path.is_file() else {}
    merged = kept | best
    path.write_text(json.dumps({str(m): merged[m] for m in sorted(merged)}, indent=4) + "\n")
    return path


def _check_device() -> torch.device:
    """The CUDA device to tune on; SystemExit with the reason when there is none fit for it."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("tune_fp8_gemm.py: TRITON_INTERPRET=1 is set; timings need compiled kernels: unset it")
    if not torch.cuda.is_available():
        raise SystemExit("tune_fp8_gemm.py times kernels on a CUDA GPU and none is visible here (this is a CPU "
                         "machine?): run it on the GPU the configs are for")
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        raise SystemExit(f"tune_fp8_gemm.py: the fp8 GEMM needs sm89 or newer; this GPU is "
                         f"sm{capability[0]}{capability[1]}")
    return torch.device("cuda")


def tune_shape(
    n: int, k: int, batch_sizes: Sequence[int], space: dict[str, tuple[int, ...]], dtype: torch.dtype,
    reps: int, device: torch.device, kept: dict[int, Config] | None = None,
) -> dict[int, Config]:
    """The fastest config per M for an [N, K] weight, each checked against the torch reference. `kept`: the
    configs a file already holds (--update), timed beside the space's, so that re-tuning never writes a slower one."""
    from benchmarks.gpu_timing import time_cold_graph_ms
    from plugserve.conformance.tolerances import assert_close
    from plugserve.plugins.gemm import triton_kernels
    from plugserve.plugins.gemm.torch_ref import block_fp8_matmul

    properties = torch.cuda.get_device_properties(device)
    smem, num_sms = properties.shared_memory_per_block_optin, properties.multi_processor_count
    w_q, w_s = quantize_block_fp8(torch.randn(n, k, device=device) / k**0.5, BLOCK_SHAPE)
    x = torch.randn(max(batch_sizes), k, device=device, dtype=dtype)
    x_q, x_s = triton_kernels.per_token_group_quant_fp8(x, BLOCK_SHAPE[1], column_major_scales=True)
    reference = block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK_SHAPE, dtype)
    best: dict[int, Config] = {}
    for m in batch_sizes:
        a_q, a_s = x_q[:m], x_s[:m]  # the first m rows; column-major scales, as the backend passes them
        timings: list[tuple[float, Config]] = []
        skipped = 0
        m_space = QUICK_PREFILL_SPACE if space is QUICK_SPACE and m >= PREFILL_M else space
        tried = candidates(m, m_space, smem, n, k, num_sms)
        if kept and m in kept and kept[m] not in tried:
            tried.append(kept[m])
        for config in tried:
            run = functools.partial(triton_kernels.w8a8_block_fp8_matmul, a_q, a_s, w_q, w_s, BLOCK_SHAPE, dtype,
                                    config)
            try:
                timings.append((time_cold_graph_ms(run, reps=reps), config))
            except Exception as exc:  # a config the compiler rejects (out of registers or shared memory)
                skipped += 1
                print(f"    skipped {config}: {type(exc).__name__}: {exc}".splitlines()[0])
        if not timings:
            raise SystemExit(f"no config ran for N={n} K={k} M={m}")
        ms, config = min(timings, key=lambda t: t[0])
        assert_close(triton_kernels.w8a8_block_fp8_matmul(a_q, a_s, w_q, w_s, BLOCK_SHAPE, dtype, config),
                     reference[:m], dtype, f"N={n} K={k} M={m} with {config}")
        fallback = default_config(m, BLOCK_SHAPE, n, k, num_sms)
        default_ms = next((t for t, c in timings if c == fallback), None)
        if default_ms is None:  # the untuned split-K is not always in the space
            default_ms = time_cold_graph_ms(functools.partial(
                triton_kernels.w8a8_block_fp8_matmul, a_q, a_s, w_q, w_s, BLOCK_SHAPE, dtype, fallback), reps=reps)
        vs_default = f", default config {default_ms * 1e3:8.1f} us (SPLIT_K {fallback['SPLIT_K']})"
        print(f"  M={m:5d}: {ms * 1e3:8.1f} us, {2 * m * n * k / ms / 1e9:7.1f} TFLOP/s, "
              f"weight read at {n * k / ms / 1e6:6.0f} GB/s "
              f"({len(timings)} configs, {skipped} skipped{vs_default}) {config}")
        best[m] = config
    return best


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", metavar="N,K", default=None,
                        help="weight shapes to tune, N,K or NxK (default: DeepSeek-V3's, see V3_SHAPES)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES), metavar="M")
    parser.add_argument("--quick", action="store_true",
                        help="a reduced space (BLOCK_SIZE_N 64/128, GROUP_SIZE_M 1/8, 3-4 stages; from M 512 on, "
                             "the large tiles with and without TMA) and shorter timing")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="activation and output dtype")
    parser.add_argument("--update", action="store_true",
                        help="merge into existing files: their entries for other batch sizes are kept, and their "
                             "entry for a re-tuned one is timed beside the candidates")
    parser.add_argument("--output-dir", type=Path, default=CONFIG_DIR)
    args = parser.parse_args(argv)
    try:
        shapes = ([tuple(int(v) for v in s.replace("x", ",").split(",")) for s in args.shapes] if args.shapes
                  else list(V3_SHAPES))
    except ValueError:
        parser.error(f"--shapes takes N,K pairs such as 2112,7168, got {args.shapes}")
    if any(len(shape) != 2 for shape in shapes) or min(args.batch_sizes) < 1:
        parser.error("--shapes takes N,K pairs and --batch-sizes positive integers")
    device = _check_device()
    torch.manual_seed(0)
    device_name = torch.cuda.get_device_name(device).replace(" ", "_")
    space = QUICK_SPACE if args.quick else FULL_SPACE
    reps = 10 if args.quick else 50
    batch_sizes = sorted(set(args.batch_sizes))
    print(f"Tuning {len(shapes)} shapes x {len(batch_sizes)} batch sizes on {device_name} "
          f"({'quick' if args.quick else 'full'} space) into {args.output_dir}")
    start = time.perf_counter()
    for n, k in shapes:
        print(f"N={n} K={k}: {V3_SHAPES.get((n, k), 'custom shape')}")
        shape_start = time.perf_counter()
        kept = load_configs.__wrapped__(n, k, device_name, BLOCK_SHAPE, args.output_dir) if args.update else None
        best = tune_shape(n, k, batch_sizes, space, DTYPES[args.dtype], reps, device, kept)
        path = write_configs(best, n, k, device_name, args.output_dir, args.update)
        print(f"  wrote {path} ({time.perf_counter() - shape_start:.0f} s)")
    print(f"Tuning took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
