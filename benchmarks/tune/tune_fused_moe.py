"""Tune the `triton` MoE backend's grouped-GEMM launch configurations on this GPU and write them to
plugserve/plugins/moe/configs (the format is described in that package's docstring).

Shapes (one GPU's experts: w13 [E, 2N, H], w2 [E, H, N]):
  v3       DeepSeek-V3/R1: E=256, top-8, H=7168, N=2048/TP (TP 8: N=256), block-FP8 w8a8, 128 x 128 blocks
  v2-lite  DeepSeek-V2-Lite: E=64, top-6, H=2048, N=1408/TP (TP 1: N=1408), bfloat16 experts
  v2       DeepSeek-V2: E=160, top-6, H=5120, N=1536/TP (TP 1: N=1536; one layer's experts fit one GPU), bfloat16
With --ep (expert parallelism, = --tp) a GPU holds E/EP whole experts instead: files E=256/8=32, N=2048 for V3 at
--tp 8 --ep 8, the names the backend looks up on each rank (routing still ranks all E; the other ranks' pairs drop).

For each token count M the BLOCK_SIZE_M candidates are tried in turn; for each, every tile candidate
of the w13 pass (with its fused SiLU-and-mul) and of the w2 pass (with its weighted epilogue) is timed
on its own, and the BLOCK_SIZE_M with the fastest w13 + w2 is kept. Routing is the backend's router
on random logits. The default search takes hours; --quick (a small space, six token counts) about
five minutes on an H100 for both models. Token counts up to --decode-max-tokens (default 64) search the
decode space instead: BLOCK_SIZE_M near the pairs an expert gets and narrow, deep, many-staged tiles, the
shapes that stream the routed experts' weights fastest when there are few rows to multiply, and the w13 pass's
fastest tiles again with K cut into 2, 4 or 8 runs (SPLIT_K), for batches whose blocks alone cannot fill the
GPU. Larger counts time the w2 pass's fastest tiles again with 4, 16 or 64 column blocks a program
(COLUMN_BLOCKS), where its K, the intermediate size per rank, is short (at most COLUMN_MAX_K, 512). Every count
also prints its fraction of the weight-read limit (the bytes of the distinct experts the batch routes to
over the read bandwidth measured at start). --update keeps the other token counts of an existing file.

    python -m benchmarks.tune.tune_fused_moe --quick
    python -m benchmarks.tune.tune_fused_moe --model v2-lite --batch-sizes 1 2 4 8 --update
    python -m benchmarks.tune.tune_fused_moe --model v3 --tp 8 --batch-sizes 1 64 512 --output-dir /tmp/configs
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from plugserve.conformance.cases import V2_LITE_ROUTER, V2_ROUTER, V3_ROUTER
from plugserve.core.hardware import Hardware
from plugserve.core.layers.quant import FP8_DTYPE
from plugserve.core.specs import MoESpec, RouterConfig
from plugserve.plugins.moe import configs
from plugserve.plugins.moe.configs import GemmConfig, MoEConfig

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
QUICK_BATCH_SIZES = (1, 16, 64, 256, 1024, 4096)
PREFILL_M = 512  # the quick search's prefill space from here on (see `search_space`)
ROUTED_SCALING = 2.5  # DeepSeek-V3's routed_scaling_factor, in the timed w2 pass and the check
BLOCK_SHAPE = (128, 128)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Model:
    hidden: int
    intermediate: int  # before tensor parallelism
    default_tp: int
    router: RouterConfig
    default_dtype: str  # "fp8_w8a8" or an activation dtype


MODELS = {
    "v3": Model(7168, 2048, 8, V3_ROUTER, "fp8_w8a8"),
    "v2-lite": Model(2048, 1408, 1, V2_LITE_ROUTER, "bfloat16"),
    "v2": Model(5120, 1536, 1, V2_ROUTER, "bfloat16"),
}


def search_space(fp8: bool, dtype: torch.dtype, quick: bool, num_tokens: int
                 ) -> tuple[tuple[int, ...], list[GemmConfig]]:
    """(BLOCK_SIZE_M candidates, tile candidates of one pass, each with and without TMA weight loads) for M =
    num_tokens. FP8: BLOCK_SIZE_K divides the 128 block. The quick search from PREFILL_M tokens on adds 256-wide
    tiles and 8 warps (a 128 x 128 FP8 tile on 4 warps holds its float32 accumulator and each K step's product in
    registers: it spilled, 3.5x slower than 64-row blocks on the H100) and takes 64- and 128-row blocks only."""
    if quick:
        block_k = (128,) if fp8 else (32,) if dtype == torch.float32 else (64,)
        if num_tokens >= PREFILL_M:
            return (64, 128), [GemmConfig(*values) for values in itertools.product(
                (64, 128, 256), block_k, (1, 16), (4, 8), (3, 4), (False, True))]
        axes = [(64, 128), block_k, (1, 16), (4,), (3, 4), (False, True)]
    else:
        block_k = (64, 128) if fp8 else (32, 64) if dtype == torch.float32 else (32, 64, 128)
        axes = [(32, 64, 128, 256), block_k, (1, 16, 32, 64), (4, 8), (2, 3, 4, 5), (False, True)]
    return (16, 32, 64, 128), [GemmConfig(*values) for values in itertools.product(*axes)]


def decode_space(fp8: bool, dtype: torch.dtype, pairs_per_expert: float) -> tuple[tuple[int, ...], list[GemmConfig]]:
    """(BLOCK_SIZE_M candidates, tile candidates) for decode-sized batches: memory-bound passes, so many
    narrow programs with deep K steps and several stages in flight. FP8: BLOCK_SIZE_K divides the block."""
    block_ms = (16,) if pairs_per_expert <= 2 else (16, 32)
    block_k = (64, 128) if fp8 else (64, 128) if dtype == torch.float32 else (128, 256)
    axes = [(16, 32, 64, 128), block_k, (1,), (4,), (3, 4, 5), (False, True)]
    return block_ms, [GemmConfig(*values) for values in itertools.product(*axes)]


def read_bandwidth(device: torch.device) -> float:
    """Bytes per second of the faster of reading 1 GiB once and copying it (benchmarks/gpu_timing.py): the
    weight-read limit's rate."""
    from benchmarks.gpu_timing import memory_ceilings

    return memory_ceilings(device, 1 << 30)["memory_gbps"] * 1e9


def time_ms(fn: Callable[[], None], quick: bool) -> float:
    """Median milliseconds of fn replayed from a CUDA graph with a cold L2 (as the decode graphs run it), or
    inf when the configuration does not compile or launch here."""
    from benchmarks.gpu_timing import time_cold_graph_ms

    try:
        return time_cold_graph_ms(fn, reps=10 if quick else 50)
    except Exception as exc:  # out of shared memory or registers: not a candidate on this GPU
        print(f"      skipped: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
        return float("inf")


def ranked(run: Callable[..., None], tiles: list[GemmConfig], quick: bool) -> list[tuple[float, GemmConfig]]:
    """(milliseconds, tile) of each tile for the pass that run(config=tile) launches, fastest first."""
    return sorted(((time_ms(functools.partial(run, config=tile), quick), tile) for tile in tiles), key=lambda c: c[0])


# Decode: the w13 pass's K (the hidden size) cut into this many runs, tried on its fastest uncut tiles. At one pair
# an M-block a batch of a few tokens has too few blocks to draw the bandwidth (V3 under TP 8, 1 token: 64 programs
# on 132 SMs); w2's K, the intermediate size per rank, is short already.
DECODE_SPLITS = (2, 4, 8)
SPLIT_CANDIDATES = 3
# Prefill: the w2 pass's fastest tiles again with this many column blocks a program (COLUMN_BLOCKS). Its K, the
# intermediate size per rank (V3 under TP 8: 256), is two K steps at BLOCK_SIZE_K 128: one program a column block
# fills and drains its pipeline for each (V3 TP 8 at 4096 tokens: 42784 programs of two steps, ncu, session 17).
PREFILL_COLUMN_BLOCKS = (4, 16, 64)


@dataclass(frozen=True)
class Experts:
    """One model's experts on the GPU, random (timing does not depend on the values)."""

    spec: MoESpec
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale_inv: torch.Tensor | None
    w2_scale_inv: torch.Tensor | None

    @classmethod
    def random(cls, spec: MoESpec, device: torch.device) -> Experts:
        e, h, n, dtype = spec.num_local_experts, spec.hidden_size, spec.intermediate_size, spec.dtype
        g = torch.Generator(device).manual_seed(0)
        w13 = torch.randn(e, 2 * n, h, device=device, generator=g, dtype=dtype) / h**0.5
        w2 = torch.randn(e, h, n, device=device, generator=g, dtype=dtype) / n**0.5
        if not spec.is_fp8:
            return cls(spec, w13, w2, None, None)
        # e4m3 values over their range, scales near 1 / 448.
        bn, bk = spec.block_shape
        s13 = torch.rand(e, -(-2 * n // bn), -(-h // bk), device=device, generator=g) / 448 + 1e-4
        s2 = torch.rand(e, -(-h // bn), -(-n // bk), device=device, generator=g) / 448 + 1e-4
        return cls(spec, (w13 * 64).to(FP8_DTYPE), (w2 * 64).to(FP8_DTYPE), s13, s2)


def tune_batch(experts: Experts, num_tokens: int, block_ms: tuple[int, ...] | None, tiles: list[GemmConfig] | None,
               quick: bool, kept: MoEConfig | None = None) -> tuple[MoEConfig, float, float, int]:
    """(best configuration, its w13 + w2 milliseconds, the default configuration's, the bytes of the distinct
    experts' weights the batch reads) for M = num_tokens. block_ms / tiles None: the decode space. `kept`: a
    configuration to time beside the space's (the file's for this M under --update)."""
    from plugserve.plugins.moe.align import align_pairs
    from plugserve.plugins.moe.grouped_gemm import COLUMN_MAX_K, grouped_gemm
    from plugserve.plugins.moe.quant import per_token_group_quant
    from plugserve.plugins.moe.triton import TritonMoE

    spec, device = experts.spec, experts.w13.device
    e, k, h, n, fp8 = spec.num_experts, spec.top_k, spec.hidden_size, spec.intermediate_size, spec.is_fp8
    x = torch.randn(num_tokens, h, device=device, dtype=spec.dtype)
    bias = torch.randn(e, device=device) * 0.1 if spec.router.topk_method == "noaux_tc" else None
    topk_weights, topk_ids = TritonMoE(spec, device).route(torch.randn(num_tokens, e, device=device), bias)
    decode = block_ms is None or tiles is None
    if decode:
        block_ms, tiles = decode_space(fp8, spec.dtype, num_tokens * k / e)
    a, a_scale = per_token_group_quant(x, spec.block_shape[1]) if fp8 else (x, None)
    h_buf = torch.empty(num_tokens * k, n, device=device, dtype=torch.float32 if fp8 else spec.dtype)
    y = torch.empty(num_tokens * k, h, device=device, dtype=spec.dtype)
    w13_pass = functools.partial(grouped_gemm, a, a_scale, experts.w13, experts.w13_scale_inv, h_buf, a_row_div=k,
                                 silu_mul=True, block_shape=spec.block_shape)
    w2_pass = functools.partial(grouped_gemm, w=experts.w2, w_scale=experts.w2_scale_inv, out=y, a_row_div=1,
                                silu_mul=False, topk_weights=topk_weights, routed_scaling_factor=ROUTED_SCALING,
                                block_shape=spec.block_shape)

    local_ids = topk_ids - spec.first_expert  # as the backend's forward: ids outside [0, local) are dropped
    read = torch.unique(local_ids)
    expert_bytes = (experts.w13[0].nbytes + experts.w2[0].nbytes) * int(((read >= 0) & (read < spec.num_local_experts))
                                                                        .sum())

    def passes(block_m: int, w13_tiles: list[GemmConfig], w2_tiles: list[GemmConfig]) -> tuple[float, MoEConfig]:
        alignment = align_pairs(local_ids, spec.num_local_experts, block_m)
        run13 = functools.partial(w13_pass, alignment=alignment)
        timed13 = ranked(run13, w13_tiles, quick)
        if decode and len(w13_tiles) > 1:
            cut = [replace(tile, split_k=split) for _, tile in timed13[:SPLIT_CANDIDATES] for split in DECODE_SPLITS]
            timed13 = sorted(timed13 + ranked(run13, cut, quick), key=lambda c: c[0])
        t13, tile13 = timed13[0]
        w13_pass(alignment=alignment, config=tile13)  # the w2 pass's input
        h_in, h_scale = per_token_group_quant(h_buf, spec.block_shape[1]) if fp8 else (h_buf, None)
        run2 = functools.partial(w2_pass, h_in, h_scale, alignment=alignment)
        timed2 = ranked(run2, w2_tiles, quick)
        if not decode and len(w2_tiles) > 1 and n <= COLUMN_MAX_K:
            looped = [replace(tile, column_blocks=blocks) for _, tile in timed2[:SPLIT_CANDIDATES]
                      for blocks in PREFILL_COLUMN_BLOCKS]
            timed2 = sorted(timed2 + ranked(run2, looped, quick), key=lambda c: c[0])
        t2, tile2 = timed2[0]
        return t13 + t2, MoEConfig(block_m, tile13, tile2)

    choices = []
    for block_m in block_ms:
        choices.append(passes(block_m, tiles, tiles))
        print(f"  M={num_tokens} BLOCK_SIZE_M={block_m}: {choices[-1][0] * 1e3:.1f} us", flush=True)
    if kept is not None:  # --update: the file's entry, timed beside the candidates (re-tuning never slows it)
        choices.append(passes(kept.block_m, [kept.w13], [kept.w2]))
    total, best = min(choices, key=lambda c: c[0])
    check_config(experts, best, x, topk_ids, topk_weights)
    default = configs.default_config(num_tokens, k, spec.num_local_experts, fp8, spec.dtype, "cuda")
    return best, total, passes(default.block_m, [default.w13], [default.w2])[0], expert_bytes


def check_config(experts: Experts, config: MoEConfig, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> None:
    """The routed experts' forward with `config` (x [T, H], topk_ids [T, k] of all experts, topk_weights [T, k])
    against the torch reference; AssertionError naming the config when it is off (the kit's bound for
    block-FP8), so that no tuned file holds a configuration that computes something else."""
    from plugserve.conformance.tolerances import W8A8_MOE_ATOL, assert_close
    from plugserve.plugins.moe.experts import fused_experts
    from plugserve.plugins.moe.torch_ref import fused_experts_reference

    spec = experts.spec
    out = fused_experts(x, experts.w13, experts.w2, experts.w13_scale_inv, experts.w2_scale_inv,
                        topk_ids - spec.first_expert, topk_weights, ROUTED_SCALING, config, spec.block_shape)
    expected = fused_experts_reference(x, experts.w13, experts.w2, topk_ids, topk_weights, ROUTED_SCALING,
                                       experts.w13_scale_inv, experts.w2_scale_inv, spec.block_shape,
                                       spec.first_expert)
    assert_close(out, expected, spec.dtype, f"tuned MoE config {config.to_json()} at M={x.shape[0]}",
                 W8A8_MOE_ATOL if spec.is_fp8 else None)


def rank_spec(model: Model, tp: int, ep: int, dtype_name: str) -> MoESpec:
    """Rank 0's experts at --tp / --ep, as ModelConfig.moe_spec gives them to the backend (fp8_w8a8: block-FP8
    experts under bfloat16 activations)."""
    fp8 = dtype_name == "fp8_w8a8"
    return MoESpec(model.hidden, model.intermediate // (tp // ep), torch.bfloat16 if fp8 else DTYPES[dtype_name],
                   FP8_DTYPE if fp8 else None, BLOCK_SHAPE, model.router, ep_size=ep)


def tune_model(name: str, model: Model, tp: int, ep: int, dtype_name: str, batch_sizes: tuple[int, ...], quick: bool,
               decode_max_tokens: int, out_dir: Path, update: bool = False) -> Path:
    """Tune every token count of one model's rank 0 (experts of width I / tp, or E / ep whole ones) and write its
    configuration file (`update`: merged into the existing file's other token counts); returns its path."""
    device = torch.device("cuda")
    hardware = Hardware.detect(device)
    spec = rank_spec(model, tp, ep, dtype_name)
    fp8, dtype = spec.is_fp8, spec.dtype
    print(f"{name}: E={spec.num_local_experts} of {spec.num_experts} top-{spec.top_k} H={spec.hidden_size} "
          f"N={spec.intermediate_size} (TP {tp}, EP {ep}) {dtype_name} on {hardware.describe()}", flush=True)
    experts = Experts.random(spec, device)
    bandwidth = read_bandwidth(device)
    print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s (the weight-read limit's)", flush=True)
    path = out_dir / configs.config_file_name(spec.num_local_experts, spec.intermediate_size, hardware.device_key,
                                              dtype, BLOCK_SHAPE if fp8 else None)
    kept = (configs.load_config_file.__wrapped__(path) or {}) if update else {}
    best: dict[int, MoEConfig] = {}
    rows = []
    for m in batch_sizes:
        start = time.perf_counter()
        block_ms, tiles = (None, None) if m <= decode_max_tokens else search_space(fp8, dtype, quick, m)
        best[m], total, untuned, expert_bytes = tune_batch(experts, m, block_ms, tiles, quick, kept.get(m))
        limit_ms = expert_bytes / bandwidth * 1e3
        rows.append((m, total, untuned, limit_ms))
        print(f"M={m}: best {total * 1e3:.1f} us (default configuration {untuned * 1e3:.1f} us, weight-read limit "
              f"{limit_ms * 1e3:.1f} us): {best[m].to_json()} [{time.perf_counter() - start:.0f} s]", flush=True)
        configs.write_config_file(path, kept | best)  # after each count: a run cut short keeps what it finished
    print(f"\n{name} E={spec.num_local_experts} N={spec.intermediate_size} {dtype_name}: w13 + w2 passes, us")
    print("| M | tuned | default | weight-read limit | tuned: of limit |\n|---|---|---|---|---|")
    for m, total, untuned, limit_ms in rows:
        print(f"| {m} | {total * 1e3:.1f} | {untuned * 1e3:.1f} | {limit_ms * 1e3:.1f} | {limit_ms / total:.2f} |")
    print(f"wrote {path}" + (f" (kept M {sorted(set(kept) - set(best))})" if kept else ""), flush=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["v3", "v2-lite"],
                        help="shapes to tune (default: v3 and v2-lite)")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: v3 8, v2-lite 1)")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel size: 1, or --tp (a GPU holds E / EP whole experts)")
    parser.add_argument("--dtype", choices=["fp8_w8a8", *DTYPES], default=None,
                        help="expert format (default: v3 fp8_w8a8, v2-lite bfloat16)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="token counts M to tune")
    parser.add_argument("--quick", action="store_true", help="a small search over six token counts (~5 min)")
    parser.add_argument("--decode-max-tokens", type=int, default=64,
                        help="token counts up to this search the decode space (0: none)")
    parser.add_argument("--update", action="store_true",
                        help="merge into the existing file: its entries for other token counts are kept, and its "
                             "entry for a re-tuned one is timed beside the candidates")
    parser.add_argument("--output-dir", type=Path, default=configs.CONFIG_DIR)
    args = parser.parse_args(argv)
    for name in args.model:
        tp = args.tp or MODELS[name].default_tp
        if args.ep not in (1, tp):
            parser.error(f"--ep {args.ep} must be 1 or the tensor-parallel size ({name}: --tp {tp})")
        if MODELS[name].router.num_experts % args.ep or MODELS[name].intermediate % (tp // args.ep):
            parser.error(f"{name}'s experts do not split over --tp {tp} --ep {args.ep}")
    if not torch.cuda.is_available():
        sys.exit("tune_fused_moe.py times Triton kernels on a CUDA GPU and none is visible here; on the CPU they "
                 "run only in Triton's interpreter, whose timings mean nothing. Run it on the GPU machine.")
    batch_sizes = tuple(args.batch_sizes or (QUICK_BATCH_SIZES if args.quick else BATCH_SIZES))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name in args.model:
        model = MODELS[name]
        tune_model(name, model, args.tp or model.default_tp, args.ep, args.dtype or model.default_dtype, batch_sizes,
                   args.quick, args.decode_max_tokens, args.output_dir, args.update)


if __name__ == "__main__":
    main()
