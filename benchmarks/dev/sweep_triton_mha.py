"""Sweep the launch parameters of the Triton ragged MHA kernel (prefill / extend) on the GPU, against the limit
measured in the same run: causal flops / bf16 TFLOP/s, as benchmarks/shootout.py computes it for prefill.

    PYTHONPATH=. python benchmarks/dev/sweep_triton_mha.py [--heads 128] [--shapes 4096x0 16384x0 4096x4096] \
        [--output sweep.json]

For each (new tokens, cached prefix) shape of one request (DeepSeek's MHA heads: qk 192, v 128; causal,
bottom-right) it times the kernel's own choice (the Gluon kernel where it fits, else `mha_configs`' first) and
each candidate `MhaConfig`, every call captured in a CUDA graph and replayed (median of --reps), and checks each
output against the default's. Prints a line per run and the default and fastest per shape. (`--device cpu
--dtype float16 --shapes 64x16 --heads 2` checks the script in Triton's interpreter.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.shootout import measure_ceilings, timed
from plugserve.plugins.attention import mha_prefill as kernels

MhaConfig = kernels.MhaConfig
QK_DIM, V_DIM = 192, 128
CANDIDATES = [MhaConfig(128, 128, 8, 2, gluon=True), MhaConfig(128, 64, 8, 2, gluon=True),
              MhaConfig(128, 64, 8, 2), MhaConfig(128, 128, 8, 2), MhaConfig(128, 128, 8, 3), MhaConfig(128, 32, 8, 4),
              MhaConfig(128, 64, 4, 3), MhaConfig(64, 64, 4, 3), MhaConfig(64, 128, 4, 2), MhaConfig(64, 64, 4, 4),
              MhaConfig(256, 64, 8, 2), MhaConfig(128, 64, 8, 3, tma=True), MhaConfig(128, 128, 8, 2, tma=True),
              MhaConfig(128, 64, 8, 4, tma=True), MhaConfig(64, 64, 4, 3, tma=True),
              # Last: Triton 3.6 aborted the process compiling a warp-specialized FP8 GEMM loop.
              MhaConfig(128, 64, 8, 3, True), MhaConfig(128, 128, 8, 2, True), MhaConfig(128, 64, 8, 3, True, True)]


def causal_flops(tokens: int, prefix: int, heads: int) -> int:
    """QK and PV multiply-adds (times 2) of `tokens` queries over the prefix and the keys up to each one."""
    visible = tokens * prefix + tokens * (tokens + 1) // 2
    return 2 * heads * visible * (QK_DIM + V_DIM)


def sweep_shape(tokens: int, prefix: int, heads: int, ceilings: dict[str, float], args: argparse.Namespace
                ) -> list[dict]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(tokens, heads, QK_DIM, device=device, dtype=dtype, generator=generator)
    k = torch.randn(prefix + tokens, heads, QK_DIM, device=device, dtype=dtype, generator=generator)
    v = torch.randn(prefix + tokens, heads, V_DIM, device=device, dtype=dtype, generator=generator)
    cu_q = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    cu_kv = torch.tensor([0, prefix + tokens], dtype=torch.int32, device=device)
    limit = causal_flops(tokens, prefix, heads) / (ceilings["bf16_tflops"] * 1e12)
    scale = QK_DIM**-0.5

    def run(config: MhaConfig | None) -> torch.Tensor:
        return kernels.mha_varlen(q, k, v, cu_q, cu_kv, tokens, scale, True, config)[0]

    expected = run(None).float()
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    default = (kernels.GLUON_MHA if kernels.mha_gluon_fits(kernels.GLUON_MHA, q, k, v, capability)
               else kernels.mha_configs(device.type == "cuda", V_DIM, q.element_size())[0])
    runs = []
    for config in [None, *args.candidates]:
        row = dict(tokens=tokens, prefix=prefix, heads=heads, limit_us=limit * 1e6, default=config is None,
                   config=str(config or default))
        try:
            diff = (run(config).float() - expected).abs().max().item()
            seconds, how = timed(lambda config=config: run(config), device, args.warmup, args.reps)
        except Exception as exc:  # a config that does not fit or compile here: report it, go on
            runs.append(row | dict(error=f"{type(exc).__name__}: {exc}"[:300]))
            print(f"t{tokens} p{prefix} {row['config']}: {runs[-1]['error']}", flush=True)
            continue
        runs.append(row | dict(us=seconds * 1e6, fraction=limit / seconds, timing=how, max_abs_diff=diff))
        print(f"t{tokens} p{prefix} {'default ' if config is None else ''}{row['config']}: {seconds * 1e6:.1f} us, "
              f"{limit / seconds:.2f} of limit ({how})" + ("" if diff < 2e-2 else f"  WRONG ({diff:.3g})"), flush=True)
    return runs


def parse_config(text: str) -> MhaConfig:
    """'128x64x8x3' (BLOCK_M, BLOCK_N, num_warps, num_stages), then optionally 'tma', 'ws' and / or 'gluon'."""
    parts = text.split("x")
    flags = set(parts[4:])
    if len(parts) < 4 or not all(p.isdigit() for p in parts[:4]) or not flags <= {"tma", "ws", "gluon"}:
        raise ValueError(f"{text!r} is not MxNxWARPSxSTAGES[xtma][xws][xgluon]")
    return MhaConfig(*map(int, parts[:4]), warp_specialize="ws" in flags, tma="tma" in flags, gluon="gluon" in flags)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--shapes", nargs="+", default=["4096x0", "16384x0", "4096x4096"], help="TOKENSxPREFIX ...")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--output", type=Path, default=None, help="write every run as JSON")
    parser.add_argument("--configs", nargs="*", default=None, metavar="MxNxWARPSxSTAGES[xtma][xws]",
                        help="time these configs beside the default instead of the built-in candidates (none: the "
                             "default only), e.g. 128x64x8x3xtma")
    args = parser.parse_args(argv)
    try:
        args.candidates = CANDIDATES if args.configs is None else [parse_config(c) for c in args.configs]
    except ValueError as exc:
        parser.error(f"--configs: {exc}")
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    ceilings = measure_ceilings(device, quick=device.type != "cuda")
    print(f"{name}: bf16 {ceilings['bf16_tflops']:.0f} TFLOP/s", flush=True)
    runs = []
    for tokens, prefix in (map(int, s.split("x")) for s in args.shapes):
        runs += sweep_shape(tokens, prefix, args.heads, ceilings, args)
    for tokens, prefix in (map(int, s.split("x")) for s in args.shapes):
        done = [r for r in runs if (r["tokens"], r["prefix"]) == (tokens, prefix) and "us" in r]
        default = next((r for r in done if r["default"]), None)
        best = min(done, key=lambda r: r["us"], default=None)
        if default and best:
            print(f"t{tokens} p{prefix}: default {default['config']} {default['fraction']:.2f} of limit; fastest "
                  f"{best['config']} {best['us']:.1f} us, {best['fraction']:.2f}")
    if args.output:
        args.output.write_text(json.dumps({"device": name, "ceilings": ceilings, "command": " ".join(sys.argv),
                                           "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
