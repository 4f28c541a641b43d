"""The Triton block-FP8 GEMM at decode sizes with the activation quantized inside the GEMM (one launch) and by
the quantization kernel first (two launches), side by side in one process: the evidence for
`plugserve.plugins.gemm.triton.FUSED_QUANT_MAX_M`.

    PYTHONPATH=. python -m benchmarks.ab_gemm_fused_quant [--ms 1 2 4 8 16 32 64] [--output ab.json]

For each of DeepSeek-V3's GEMM shapes (`shootout.gemm_shapes`) and each M, both ways run the backend's config for
M (`pick_config`), each replayed in a CUDA graph (`shootout.timed`, median of --reps); their outputs must be
equal, bit for bit. Prints a line per run and a table of the fused / two-launch time ratios by M.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

from benchmarks.shootout import GEMM_MODEL, gemm_shapes, timed
from plugserve.core.config import preset_config
from plugserve.core.interfaces import GemmSpec
from plugserve.core.layers.quant import quantize_block_fp8
from plugserve.plugins.gemm import triton as triton_gemm


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    from plugserve.plugins.gemm import triton_kernels as kernels

    backend = triton_gemm.TritonFp8Gemm(GemmSpec(dtype=torch.bfloat16), device)
    block = backend.spec.block_shape
    runs = []
    for n, k in gemm_shapes(preset_config(GEMM_MODEL), 1):
        w_q, w_s = quantize_block_fp8(torch.randn(n, k, device=device) / k**0.5, block)
        packed = backend.prepare(w_q, w_s)
        for m in args.ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            config = triton_gemm.pick_config(m, packed.configs, block, n, k, backend.hardware.multiprocessors)

            def two_launches(x: torch.Tensor = x, config: dict = config,
                             packed: triton_gemm.TritonFp8Weight = packed) -> torch.Tensor:
                x_q, x_s = kernels.per_token_group_quant_fp8(x, block[1], column_major_scales=True)
                return kernels.w8a8_block_fp8_matmul(x_q, x_s, packed.weight, packed.weight_scale_inv, block,
                                                     torch.bfloat16, config)

            fused = partial(kernels.w8a8_block_fp8_matmul, x, None, packed.weight, packed.weight_scale_inv, block,
                            torch.bfloat16, config)
            equal = torch.equal(fused(), two_launches())
            (t_fused, how), (t_two, _) = (timed(f, device, args.warmup, args.reps) for f in (fused, two_launches))
            runs.append(dict(n=n, k=k, m=m, config=config, fused_us=t_fused * 1e6, two_launches_us=t_two * 1e6,
                             ratio=t_fused / t_two, equal=equal, timing=how))
            print(f"n{n} k{k} m{m}: fused {t_fused * 1e6:.1f} us, two launches {t_two * 1e6:.1f} us, "
                  f"ratio {t_fused / t_two:.2f}" + ("" if equal else "  OUTPUTS DIFFER"), flush=True)
    print("\n| M | fused / two launches: median | worst | shapes |")
    print("|---|---|---|---|")
    for m in args.ms:
        ratios = [r["ratio"] for r in runs if r["m"] == m]
        print(f"| {m} | {statistics.median(ratios):.2f} | {max(ratios):.2f} | {len(ratios)} |")
    if args.output:
        args.output.write_text(json.dumps({"device": torch.cuda.get_device_name(device),
                                           "command": " ".join(sys.argv), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
