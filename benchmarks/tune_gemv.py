"""Measure where the Triton GEMV (plugserve/core/layers/triton_gemv.py) beats torch at decode, and write the table
the model reads on this GPU.

    python -m benchmarks.tune_gemv --model-preset deepseek-v2-lite deepseek-v3 [--rows 1 2 4] [--quick]

For each model, the 16-bit products a decode step runs: its model-dtype Linears (--fp8-models: none, their weights
are block-FP8) and absorbed MLA's two per-head products. At each row count, torch's way (F.linear or bmm, cuBLAS)
and every candidate config, each replayed from a CUDA graph with a cold L2 (benchmarks/gpu_timing.py); the best
config's output is checked against torch. The shapes and row counts where the best config takes at most
WIN_RATIO of torch's time are merged into `gemv_configs/device_name=<this GPU>,dtype=16bit.json` (--output-dir),
beside the shapes measured before; a measured shape where it lost is dropped. Prints one line per shape and row count.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from plugserve.core.config import ModelConfig, preset_config
from plugserve.core.hardware import Hardware

WIN_RATIO = 0.95  # a win must beat torch by 5 %: the two time the same bytes, and noise is a few percent


def products(config: ModelConfig, fp8: bool) -> dict[str, tuple[int, int, int, bool]]:
    """name -> (B, N, K, k_contiguous) of a decode step's 16-bit products: Linear weights [N, K] (B = 1, K
    contiguous) unless `fp8`, and the absorption weights [H, K, N] (N contiguous)."""
    c, h = config, config.num_attention_heads
    shapes: dict[str, tuple[int, int, int, bool]] = {}
    if not fp8:
        kv_a = c.kv_lora_rank + c.qk_rope_head_dim
        if c.q_lora_rank is None:
            shapes["q_proj+kv_a"] = (1, h * c.qk_head_dim + kv_a, c.hidden_size, True)
        else:
            shapes["q_a+kv_a"] = (1, c.q_lora_rank + kv_a, c.hidden_size, True)
            shapes["q_b"] = (1, h * c.qk_head_dim, c.q_lora_rank, True)
        shapes["o_proj"] = (1, c.hidden_size, h * c.v_head_dim, True)
        if c.first_k_dense_replace:
            shapes["dense gate_up"] = (1, 2 * c.intermediate_size, c.hidden_size, True)
            shapes["dense down"] = (1, c.hidden_size, c.intermediate_size, True)
        if c.n_shared_experts:
            width = c.moe_intermediate_size * c.n_shared_experts
            shapes["shared gate_up"] = (1, 2 * width, c.hidden_size, True)
            shapes["shared down"] = (1, c.hidden_size, width, True)
    shapes["absorb q"] = (h, c.kv_lora_rank, c.qk_nope_head_dim, False)
    shapes["absorb out"] = (h, c.v_head_dim, c.kv_lora_rank, False)
    return shapes


def candidates(rows: int, quick: bool):
    """Configs whose [rows, BLOCK_N, BLOCK_K] product fits 64 float32 registers a thread."""
    from plugserve.core.layers.triton_gemv import GemvConfig

    warps = (4,) if quick else (2, 4, 8)
    stages = (1, 3) if quick else (1, 2, 3)
    for block_n, block_k, num_warps, num_stages in itertools.product((4, 8, 16, 32), (64, 128, 256, 512), warps,
                                                                     stages):
        if _next_pow2(rows) * block_n * block_k <= 64 * 32 * num_warps:
            yield GemvConfig(block_n, block_k, num_warps, num_stages)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def tune(name: str, shape: tuple[int, int, int, bool], rows_list: Sequence[int], quick: bool, reps: int,
         device: torch.device) -> dict[int, list[int]]:
    """{rows: config as a list} where the GEMV won, for one product; prints each row count's result."""
    from benchmarks.gpu_timing import time_cold_graph_ms
    from plugserve.core.layers import small_ops, triton_gemv
    from plugserve.testing.tolerances import assert_close

    b, n, k, k_contiguous = shape
    dtype = torch.bfloat16
    if k_contiguous:  # a Linear's weight [N, K]
        weight = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
        gemv_weight = weight[None]

        def torch_way(x: torch.Tensor) -> torch.Tensor:
            return small_ops.linear(x[:, 0], weight)[:, None]
    else:  # an absorption weight [H, K, N]
        weight = torch.randn(b, k, n, device=device, dtype=dtype) / k**0.5
        gemv_weight = weight.transpose(1, 2)

        def torch_way(x: torch.Tensor) -> torch.Tensor:
            return small_ops.absorb(x, weight)
    weight_bytes = b * n * k * weight.element_size()
    won: dict[int, list[int]] = {}
    for rows in rows_list:
        x = torch.randn(rows, b, k, device=device, dtype=dtype)
        torch_ms = time_cold_graph_ms(functools.partial(torch_way, x), reps=reps)
        timings = []
        for config in candidates(rows, quick):
            try:
                timings.append((time_cold_graph_ms(functools.partial(triton_gemv.gemv, x, gemv_weight, config),
                                                   reps=reps), config))
            except Exception as exc:  # a config the compiler rejects
                print(f"    skipped {config}: {type(exc).__name__}: {exc}".splitlines()[0])
        ms, best = min(timings, key=lambda t: t[0])
        assert_close(triton_gemv.gemv(x, gemv_weight, best), torch_way(x), dtype, f"{name} rows={rows} {best}")
        verdict = "GEMV" if ms <= WIN_RATIO * torch_ms else "torch"
        print(f"{name:>15} B={b:<4d} N={n:<6d} K={k:<6d} rows={rows}: torch {torch_ms * 1e3:7.1f} us, GEMV "
              f"{ms * 1e3:7.1f} us ({best}), ratio {ms / torch_ms:5.2f}; weight read at "
              f"{weight_bytes / torch_ms / 1e6:5.0f} / {weight_bytes / ms / 1e6:5.0f} GB/s -> {verdict}", flush=True)
        if verdict == "GEMV":
            won[rows] = [best.block_n, best.block_k, best.num_warps, best.num_stages]
    return won


def main(argv: Sequence[str] | None = None) -> None:
    from plugserve.core.layers import triton_gemv

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-preset", nargs="+", default=["deepseek-v2-lite", "deepseek-v3"])
    parser.add_argument("--fp8-models", nargs="*", default=["deepseek-v3"],
                        help="presets served block-FP8 (--quantization fp8): only their absorption products")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--quick", action="store_true", help="4 warps, 1 or 3 stages only")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--output-dir", type=Path, default=triton_gemv.CONFIG_DIR)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        raise SystemExit("tune_gemv.py times compiled kernels on a CUDA GPU: run it there, without TRITON_INTERPRET=1")
    if max(args.rows) > triton_gemv.MAX_ROWS:
        raise SystemExit(f"--rows: the GEMV takes at most {triton_gemv.MAX_ROWS} rows")
    device = torch.device("cuda")
    path = args.output_dir / triton_gemv.config_file_name(Hardware.detect(device).device_key)
    table = json.loads(path.read_text()) if path.exists() else {"shapes": {}}
    for preset in args.model_preset:
        config = preset_config(preset)
        for name, shape in products(config, preset in args.fp8_models).items():
            key = ",".join(str(v) for v in shape[:3])
            won = tune(name, shape, args.rows, args.quick, args.reps, device)
            table["shapes"].pop(key, None)
            if won:
                table["shapes"][key] = {str(rows): config for rows, config in won.items()}
    table["device_name"] = torch.cuda.get_device_name(device)
    table["command"] = "python -m benchmarks.tune_gemv " + " ".join(argv if argv is not None else sys.argv[1:])
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}: {len(table['shapes'])} shapes")


if __name__ == "__main__":
    main()
