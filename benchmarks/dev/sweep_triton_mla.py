"""Sweep the launch parameters of the Triton MLA decode kernel on the GPU, against the limit measured in
the same run: max(KV bytes / memory GB/s, flops / bf16 TFLOP/s), as benchmarks/shootout.py computes it.

    PYTHONPATH=. python benchmarks/dev/sweep_triton_mla.py [--heads 16 128] [--shapes 1x32768 32x8192] \
        [--quick] [--output sweep.json]

For each head count and (batch, kv) decode shape (page 64, bf16, DeepSeek's latent 512 + rope 64) it times
the backend's own choice (`mla_config` and `mla_num_splits`, through `TritonAttention.forward_mla`) and
each candidate `MlaConfig` at the host's split count for it, half and twice that, and the most splits that keep
one wave of programs, each call captured in a CUDA graph and replayed (median of --reps). Every candidate's
output is checked against the default's.
Prints one line per run and a table per shape: the default and the fastest, in microseconds and as a
fraction of the limit, with the registers, spills and shared memory of the compiled kernels.
(`--device cpu --dtype float16 --quick --shapes 1x256` checks the script in Triton's interpreter.)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.shootout import measure_ceilings, timed
from plugserve.conformance.batches import random_batch
from plugserve.core.forward_batch import ForwardMode
from plugserve.core.specs import AttentionSpec
from plugserve.plugins.attention import mla_decode as kernels
from plugserve.plugins.attention.triton import TritonAttention

SHAPES = [(1, 32768), (32, 8192), (128, 8192), (1, 256), (64, 512)]
MlaConfig = kernels.MlaConfig


def candidates(heads: int, quick: bool) -> list[MlaConfig]:
    """Configs worth timing for `heads` on sm90. 64-head blocks take wgmma; blocks of 16 / 32 mma.sync,
    which wants the query loaded inside the KV loop (`MlaConfig.reload_q`)."""
    wide = [MlaConfig(64, 64, 8, 2, tma) for tma in (False, True)]
    wide += [MlaConfig(64, 64, 8, 2, gluon=True)]
    narrow = [MlaConfig(16, 32, 4, 5, tma, reload_q=True) for tma in (False, True)]
    if quick:
        return wide if heads > 32 else narrow
    wide += [MlaConfig(64, 32, 8, 5), MlaConfig(64, 32, 8, 5, tma=True), MlaConfig(64, 32, 8, 3),
             MlaConfig(64, 16, 8, 5)]
    narrow += [MlaConfig(16, 32, 4, 3, reload_q=True), MlaConfig(16, 16, 4, 5, reload_q=True),
               MlaConfig(16, 64, 8, 4, reload_q=True)]
    if heads > 32:
        return [*wide, MlaConfig(32, 64, 8, 5, reload_q=True), MlaConfig(16, 32, 4, 5, reload_q=True)]
    return [*narrow, MlaConfig(64, 32, 8, 5)]


def kernel_resources(device: torch.device) -> dict[int, tuple[int, int, int]]:
    """(registers, spilled bytes, shared memory) of every `_mla_kernel` compiled so far, by object id.
    Reads Triton's JIT cache (the first element of its per-device entry in 3.x); empty where it cannot
    (the interpreter compiles nothing)."""
    entry = getattr(kernels._mla_kernel, "device_caches", {}).get(device.index or 0)
    if not entry:
        return {}
    return {id(k): (getattr(k, "n_regs", -1), getattr(k, "n_spills", -1), getattr(k.metadata, "shared", -1))
            for k in entry[0].values()}


def sweep_shape(heads: int, batch_size: int, kv: int, ceilings: dict[str, float], args: argparse.Namespace
                ) -> list[dict]:
    """The default and every candidate run at one decode shape, as dicts (an `error` where one failed)."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    spec = AttentionSpec(num_heads=heads, dtype=dtype, page_size=args.page_size)
    batch = random_batch(ForwardMode.DECODE, [kv] * batch_size, [1] * batch_size, spec, device, num_layers=1)
    q_nope = torch.randn(batch_size, heads, spec.kv_lora_rank, device=device, dtype=dtype)
    q_rope = torch.randn(batch_size, heads, spec.qk_rope_head_dim, device=device, dtype=dtype)
    kv_bytes = batch_size * kv * (spec.kv_lora_rank + spec.qk_rope_head_dim) * 2
    flops = 2 * batch_size * heads * kv * (2 * spec.kv_lora_rank + spec.qk_rope_head_dim)
    limit = max(kv_bytes / (ceilings["memory_gbps"] * 1e9), flops / (ceilings["bf16_tflops"] * 1e12))
    backend = TritonAttention(spec, device)
    backend.plan(batch)
    expected = backend.forward_mla(q_nope, q_rope, 0).float()
    runs: list[dict] = []

    def record(config: MlaConfig, splits: int, default: bool, run: Callable[[], torch.Tensor]) -> None:
        row = dict(heads=heads, batch=batch_size, kv=kv, limit_us=limit * 1e6, config=str(config), splits=splits,
                   default=default, **{f"cfg_{k}": v for k, v in asdict(config).items()})
        known = kernel_resources(device)
        try:
            diff = (run().float() - expected).abs().max().item() / expected.abs().max().item()
            seconds, how = timed(run, device, args.warmup, args.reps)
        except Exception as exc:  # a config that does not compile or launch here: report it, go on
            runs.append(row | dict(error=f"{type(exc).__name__}: {exc}"[:300]))
            print(f"h{heads} b{batch_size} kv{kv} {config} x{splits}: {runs[-1]['error']}", flush=True)
            return
        new = [v for k, v in kernel_resources(device).items() if k not in known]
        runs.append(row | dict(us=seconds * 1e6, fraction=limit / seconds, timing=how, max_rel_diff=diff,
                               resources=new))
        print(f"h{heads} b{batch_size} kv{kv} {'default ' if default else ''}{config} x{splits}: "
              f"{seconds * 1e6:.1f} us, {limit / seconds:.2f} of limit ({how})" + ("" if diff < 2e-2 else "  WRONG")
              + (f", new kernels' (registers, spilled bytes, shared memory): {new}" if new else ""), flush=True)

    record(backend._mla_config, backend.plan_state.num_splits, True, lambda: backend.forward_mla(q_nope, q_rope, 0))
    for config in candidates(heads, args.quick):
        rows = batch_size * -(-heads // config.block_h)
        host = kernels.mla_num_splits(rows, kv, backend._multiprocessors, kernels.mla_min_split_keys(heads))
        # One wave of programs on every SM: the most one split's keys can shrink without a second wave.
        wave = max(1, min(kernels.MLA_MAX_SPLITS, backend._multiprocessors // rows))
        for splits in sorted({host, max(1, host // 2), min(kernels.MLA_MAX_SPLITS, 2 * host), wave}):
            size = kernels.mla_workspace_size(batch_size, heads, splits)
            workspace = (torch.empty(size * spec.kv_lora_rank, device=device), torch.empty(size, device=device))
            record(config, splits, False, functools.partial(
                kernels.mla_attention, q_nope, q_rope, batch.kv_pool.buffer(0), batch.block_table,
                backend.plan_state.token_req, backend.plan_state.token_kv_len, args.page_size, spec.softmax_scale,
                config, splits, workspace))
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--shapes", nargs="+", default=[f"{b}x{kv}" for b, kv in SHAPES], help="BATCHxKV ...")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="two candidates per head count")
    parser.add_argument("--output", type=Path, default=None, help="write every run as JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    ceilings = measure_ceilings(device, quick=device.type != "cuda")
    print(f"{name}: read {ceilings['read_gbps']:.0f} GB/s, "
          f"bf16 {ceilings['bf16_tflops']:.0f} TFLOP/s", flush=True)
    runs = []
    for heads in args.heads:
        for batch_size, kv in (map(int, s.split("x")) for s in args.shapes):
            runs += sweep_shape(heads, batch_size, kv, ceilings, args)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print_tables(runs)
    if args.output:
        args.output.write_text(json.dumps({"device": name, "ceilings": ceilings,
                                           "command": " ".join(sys.argv), "runs": runs}, indent=1))


def print_tables(runs: list[dict]) -> None:
    """Per shape: the default and the fastest correct run."""
    print("\n| heads | batch | kv | limit (us) | default | us | of limit | fastest | us | of limit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    shapes = dict.fromkeys((r["heads"], r["batch"], r["kv"]) for r in runs)
    for heads, batch, kv in shapes:
        mine = [r for r in runs if (r["heads"], r["batch"], r["kv"]) == (heads, batch, kv) and "us" in r]
        good = [r for r in mine if r["max_rel_diff"] < 2e-2]
        default = next((r for r in mine if r["default"]), None)
        best = min(good, key=lambda r: r["us"], default=None)
        if default is None or best is None:
            print(f"| {heads} | {batch} | {kv} | | no result | | | | | |")
            continue
        print(f"| {heads} | {batch} | {kv} | {default['limit_us']:.1f} | {default['config']} x{default['splits']} | "
              f"{default['us']:.1f} | {default['fraction']:.2f} | {best['config']} x{best['splits']} | "
              f"{best['us']:.1f} | {best['fraction']:.2f} |")


if __name__ == "__main__":
    main()
