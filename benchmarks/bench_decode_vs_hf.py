"""Decode step latency: plugserve against Hugging Face transformers and the weight-read limit, one process.

    python -m benchmarks.bench_decode_vs_hf --model-preset deepseek-v2-lite --load-format dummy \\
        --batch-size 1 8 32 64 128 --input-len 256 --output-len 32 --result-filename decode_vs_hf.json

1. plugserve: bench_one_batch's static batch (its runner and run_once): the median decode step. Every server
   flag passes through (--disable-cuda-graph, --enable-torch-compile, --attention-backend ...).
2. transformers: DeepseekV2/V3ForCausalLM of the same ModelConfig, random weights of the same dtype, greedy
   `generate` with a StaticCache, compiled by `generate` itself (a compileable cache on CUDA compiles the
   decode forward with the CompileConfig given, mode "reduce-overhead": CUDA graphs); --hf-no-compile runs
   it eagerly. Per step: the time from the first token to the last within one `generate` call, over
   output_len - 1 (the prefill is outside it).
3. The limit: the bytes one decode step must read (decode_step_bytes) over the memory rate measured in this run
   (the shootout's ceiling: the faster of reading 2 GiB once and copying it, counting read + write).

The two models do not fit one 80 GB GPU together: plugserve's is freed before transformers' is built.
Prints one table and writes --result-filename (JSON, rewritten after each phase so a cut-off run keeps
what it measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks import bench_one_batch
from benchmarks.shootout import measure_ceilings
from plugserve.core.config import ModelConfig
from plugserve.core.hardware import Hardware
from plugserve.core.loader import read_config, resolve_dtype
from plugserve.core.specs import KV_DTYPES
from plugserve.server.launch import server_args_from

FP8_SCALE_BYTES = 4  # DeepSeek's block-FP8 checkpoints store one float32 scale_inv per block


# -- the weight-read limit ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StepBytes:
    """What one decode step of a batch must read at least: every non-expert weight, the routed experts
    its tokens pick, and the KV cache."""

    weights: float
    experts: float
    kv_cache: float

    @property
    def total(self) -> float:
        return self.weights + self.experts + self.kv_cache


def _linear_bytes(n_out: int, n_in: int, dtype_bytes: int, block: tuple[int, int] | None) -> float:
    """One checkpoint linear weight [n_out, n_in] as stored: `dtype_bytes` per element, or (block-FP8) one
    byte per element plus a float32 scale per (block_n x block_k) block."""
    if block is None:
        return n_out * n_in * dtype_bytes
    return n_out * n_in + math.ceil(n_out / block[0]) * math.ceil(n_in / block[1]) * FP8_SCALE_BYTES


def expected_distinct_experts(num_experts: int, top_k: int, batch_size: int) -> float:
    """Expected number of distinct experts `batch_size` tokens touch when each picks `top_k` of `num_experts`
    uniformly (random weights route about uniformly): E * (1 - (1 - k/E)^b)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch_size)


def decode_step_bytes(config: ModelConfig, batch_size: int, context_len: float, dtype_bytes: int = 2,
                      kv_bytes: int | None = None) -> StepBytes:
    """Bytes one decode step of `batch_size` requests reads at least, each attending to `context_len` cached
    tokens (a run of output_len steps after input_len prompt tokens averages input_len + output_len / 2).

    Weights count as the checkpoint stores them: the decoder layers' linear weights at `dtype_bytes`, or
    block-FP8 (1 byte + a float32 scale per block) when `config.fp8_block` is set; norms, the router gate
    and the lm head at `dtype_bytes`, noaux_tc's correction bias in float32. Every non-expert weight is read
    once per step (attention, dense MLPs, shared experts, router, norms, lm head; the embedding's b rows are
    negligible and left out; the NextN layer does not run at decode). Per MoE layer, the routed experts the
    batch touches (expected_distinct_experts) are read once each. The KV cache: the latent and rope key of
    every cached token in every layer, at `kv_bytes` (default `dtype_bytes`).

    plugserve's absorbed MLA reads kv_b_proj split as W_UK / W_UV in the activation dtype; with FP8 weights
    that is one byte per element more than counted here (a few percent of a V3 layer)."""
    c = config
    h, heads, layers = c.hidden_size, c.num_attention_heads, c.num_hidden_layers
    linear = partial(_linear_bytes, dtype_bytes=dtype_bytes, block=c.fp8_block)

    def mlp(intermediate: int) -> float:  # gate_proj, up_proj, down_proj
        return 2 * linear(intermediate, h) + linear(h, intermediate)

    if c.q_lora_rank is None:
        q = linear(heads * c.qk_head_dim, h)
    else:  # q_a_proj, q_a_layernorm, q_b_proj
        q = linear(c.q_lora_rank, h) + c.q_lora_rank * dtype_bytes + linear(heads * c.qk_head_dim, c.q_lora_rank)
    attention = (q + linear(c.kv_lora_rank + c.qk_rope_head_dim, h) + c.kv_lora_rank * dtype_bytes
                 + linear(heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
                 + linear(h, heads * c.v_head_dim))
    moe_layers = sum(c.is_moe_layer(i) for i in range(layers))
    weights = layers * (attention + 2 * h * dtype_bytes) + (layers - moe_layers) * mlp(c.intermediate_size)
    experts = 0.0
    if moe_layers:
        num_experts = c.n_routed_experts or 0
        router = num_experts * h * dtype_bytes + (num_experts * 4 if c.topk_method == "noaux_tc" else 0)
        shared = mlp(c.moe_intermediate_size * c.n_shared_experts) if c.n_shared_experts else 0
        weights += moe_layers * (router + shared)
        touched = expected_distinct_experts(num_experts, c.num_experts_per_tok, batch_size)
        experts = moe_layers * touched * mlp(c.moe_intermediate_size)
    weights += h * dtype_bytes + c.vocab_size * h * dtype_bytes  # final norm, lm head
    kv_cache = (batch_size * context_len * layers * (c.kv_lora_rank + c.qk_rope_head_dim)
                * (dtype_bytes if kv_bytes is None else kv_bytes))
    return StepBytes(weights, experts, kv_cache)


# -- transformers ------------------------------------------------------------------------------------


def hf_config(config: ModelConfig) -> Any:
    """transformers' DeepseekV2Config / DeepseekV3Config of the same model, field for field
    (ModelConfig.from_hf of it gives `config` back: tested). Raises ValueError for what transformers'
    models cannot express."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    c = config
    if c.fp8_block is not None:
        raise ValueError("transformers has no block-FP8 DeepSeek model to compare with: add --skip-hf")
    if c.n_routed_experts is None or c.moe_layer_freq != 1:
        raise ValueError("transformers' DeepSeek models need routed experts in every layer from first_k_dense_replace")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        rope = {"rope_type": "yarn", "rope_theta": c.rope_theta, **dataclasses.asdict(c.rope_scaling)}
    fields = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
        rms_norm_eps=c.rms_norm_eps, rope_parameters=rope, max_position_embeddings=c.max_position_embeddings,
        n_routed_experts=c.n_routed_experts, num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size, n_shared_experts=c.n_shared_experts,
        first_k_dense_replace=c.first_k_dense_replace, n_group=c.n_group, topk_group=c.topk_group,
        norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else next(iter(c.eos_token_ids), None),
    )
    if c.model_type == "deepseek_v3":
        if (c.topk_method, c.scoring_func) != ("noaux_tc", "sigmoid"):
            raise ValueError(f"transformers' DeepSeek-V3 routes by sigmoid noaux_tc, not {c.scoring_func} "
                             f"{c.topk_method}")
        return DeepseekV3Config(**fields, num_nextn_predict_layers=c.num_nextn_predict_layers)
    if c.scoring_func != "softmax" or c.topk_method == "noaux_tc":
        raise ValueError(f"transformers' DeepSeek-V2 routes by softmax, not {c.scoring_func} {c.topk_method}")
    return DeepseekV2Config(**fields, topk_method=c.topk_method)


def build_hf_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int, std: float = 0.02,
                   experts_implementation: str | None = None) -> Any:
    """transformers' model of `config` with random weights, as plugserve's dummy load draws them (N(0, std),
    norms 1). Its tensors are allocated on `device` without transformers' init (no_init_weights) and filled
    there: a 15.7B model takes seconds, not the minutes a CPU init would (the rope buffers, computed at
    construction, stay right, which a meta-device build would lose)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    extra = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(hf_config(config), dtype=dtype, **extra)
    model.to(device)  # a no-op unless some tensor was created on an explicit device
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """A streamer for `generate` that notes the host time of every hand-over: first the prompt, then each new
    token [batch] as it is copied to the host (which waits for the device: the times are the steps' ends)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode_step(model: Any, batch_size: int, input_len: int, output_len: int, *, compile_model: bool,
                   fullgraph: bool, warmup: int, reps: int, seed: int) -> dict[str, float]:
    """Median seconds of one greedy decode step of `generate` with a static cache over `reps` runs of
    output_len tokens, after `warmup` runs (which compile and record the CUDA graphs). Each run times its own
    decode steps: from the first token (the prefill's) to the last, over output_len - 1. (Not the difference of
    an output_len-token run and a 1-token run: two separately timed runs, which load on the machine can make
    negative.)

    One StaticCache, passed as past_key_values and reset in place before each call, serves every call: its
    tensors keep their addresses, so the CUDA graphs replay. (cache_implementation="static" builds a fresh
    cache in every call, since transformers#47731, and new addresses make the CUDA graphs re-record in every
    call: a per-call cost, not a per-step one.)"""
    from transformers import CompileConfig, StaticCache

    device = model.device
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, input_len), generator=generator).to(device)
    cache = StaticCache(config=model.config, max_cache_len=input_len + output_len)
    eos = model.generation_config.eos_token_id
    kwargs: dict[str, Any] = dict(attention_mask=torch.ones_like(ids), past_key_values=cache, do_sample=False,
                                  max_new_tokens=output_len, min_new_tokens=output_len,
                                  pad_token_id=eos[0] if isinstance(eos, list) else eos)
    # generate compiles the decode forward itself (not the prefill) when the cache is compileable and the
    # device is CUDA; compile_config says how.
    kwargs |= (dict(compile_config=CompileConfig(fullgraph=fullgraph, mode="reduce-overhead")) if compile_model
               else dict(disable_compile=True))

    def generate() -> tuple[float, float]:
        """(seconds per decode step, seconds of the whole call) of one run."""
        cache.reset()
        clock = StepClock()
        _sync(device)
        begin = time.perf_counter()
        out = model.generate(ids, streamer=clock, **kwargs)
        _sync(device)
        elapsed = time.perf_counter() - begin
        assert out.shape == (batch_size, input_len + output_len), out.shape
        assert len(clock.times) == output_len + 1, len(clock.times)  # the prompt, then each token
        return (clock.times[-1] - clock.times[1]) / (output_len - 1), elapsed

    for _ in range(warmup):
        generate()
    steps, calls = zip(*(generate() for _ in range(reps)), strict=True)
    return {"step_s": statistics.median(steps), "generate_s": statistics.median(calls)}


# -- plugserve ---------------------------------------------------------------------------------------


def run_plugserve(namespace: argparse.Namespace, parser: argparse.ArgumentParser, device: torch.device,
                  cases: list[tuple[int, int, int]], report: dict[str, Any]) -> None:
    """bench_one_batch's runner and run_once over `cases`; the runner is freed (with its CUDA graphs and KV
    pool) before returning, so that transformers' model fits."""
    with bench_one_batch.build_runner(namespace, parser) as runner:
        report["plugserve"] = {
            "backends": [dataclasses.asdict(c) for c in runner.backends.chosen],
            "graph_status": runner.graphs.status,
            "dtype": str(runner.dtype).removeprefix("torch."),
            "kv_dtype": str(runner.kv_dtype).removeprefix("torch."),
            "server_args": runner.args.model_dump(),  # after bench_one_batch's static-batch settings
        }
        for batch_size, input_len, output_len in cases:
            print(f"\n# plugserve: batch size {batch_size}, input {input_len}, output {output_len}")
            result = bench_one_batch.run_once(runner, batch_size, input_len, output_len, runner.args.seed,
                                              verbose=False, overlap=namespace.overlap)
            report["rows"][(batch_size, input_len, output_len)]["plugserve"] = result
    del runner
    _free(device)


def _free(device: torch.device, reset_compiled: bool = True) -> None:
    """Return what dropped tensors held to the device: Python garbage, compiled graphs (which keep
    references to what they were compiled with), the caching allocator's blocks."""
    gc.collect()
    if reset_compiled:
        torch._dynamo.reset()
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        print(f"after freeing: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB allocated", flush=True)


def run_hf(namespace: argparse.Namespace, config: ModelConfig, dtype: torch.dtype, device: torch.device,
           cases: list[tuple[int, int, int]], report: dict[str, Any]) -> None:
    """transformers over `cases`, on one model. A case that fails (out of memory at a large batch, a compile
    error) is recorded with its error and the next one runs: one failure must not cost the whole table."""
    from torch._dynamo.utils import counters

    counters.clear()  # graph breaks from here on are transformers' alone
    begin = time.perf_counter()
    model = build_hf_model(config, dtype, device, namespace.seed,
                           experts_implementation=namespace.hf_experts_implementation)
    print(f"\ntransformers model built in {time.perf_counter() - begin:.1f} s", flush=True)
    for batch_size, input_len, output_len in cases:
        row = report["rows"][(batch_size, input_len, output_len)]
        begin = time.perf_counter()
        try:
            row["hf"] = hf_decode_step(model, batch_size, input_len, output_len,
                                       compile_model=not namespace.hf_no_compile, fullgraph=namespace.hf_fullgraph,
                                       warmup=namespace.hf_warmup, reps=namespace.hf_reps, seed=namespace.seed)
        except Exception as exc:
            traceback.print_exc()
            row["hf_error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            _free(device, reset_compiled=False)  # keep the compiled graphs for the next case
        print(f"# transformers: batch size {batch_size}, input {input_len}, output {output_len}: "
              + (f"{row['hf']['step_s'] * 1e3:.3f} ms/step" if "hf" in row else row["hf_error"])
              + f" (wall {time.perf_counter() - begin:.0f} s)", flush=True)
        # Did generate compile, and where did the graph break? The table must be what it says it is.
        report["hf"] = {"compiled": getattr(model, "_compiled_call", None) is not None,
                        "graph_breaks": dict(counters["graph_break"]),
                        "experts_implementation": model.config._experts_implementation}
        write_report(report, namespace.result_filename)
    print(f"transformers: {report['hf']}", flush=True)
    if not namespace.hf_no_compile and device.type == "cuda" and not report["hf"]["compiled"]:
        print("WARNING: transformers did not compile its decode forward", flush=True)


# -- the report --------------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda or "", "python": sys.version.split()[0]}


def finish_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The table's rows: ms per step, the limit, plugserve's fraction of it, the speed-up over transformers."""
    rows = []
    for (batch_size, input_len, output_len), row in report["rows"].items():
        plug = row.get("plugserve", {}).get("median_decode_latency")
        hf = row.get("hf", {}).get("step_s")
        limit = row["limit_ms"]
        rows.append({
            "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
            "plugserve_ms": None if plug is None else plug * 1e3, "hf_ms": None if hf is None else hf * 1e3,
            "limit_ms": limit, "fraction_of_limit": None if plug is None else limit / (plug * 1e3),
            "speedup_over_hf": None if plug is None or hf is None else hf / plug,
            "bytes": row["bytes"], **{k: v for k, v in row.items() if k in ("plugserve", "hf", "hf_error")},
        })
    return rows


def format_table(rows: list[dict[str, Any]], report: dict[str, Any]) -> str:
    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [f"============ Decode step: plugserve vs transformers ({report['device']}) ============",
             f"{'Model:':<40}{report['model']}",
             f"{'Memory bandwidth (GB/s, the limit):':<40}{report['ceilings']['memory_gbps']:.1f}",
             f"{'Read bandwidth (GB/s, read only):':<40}{report['ceilings']['read_gbps']:.1f}",
             f"{'Copy bandwidth (GB/s, read + write):':<40}{report['ceilings']['copy_gbps']:.1f}",
             f"{'transformers:':<40}{report['hf_mode']}",
             f"{'plugserve decode steps:':<40}{report['plugserve_mode']}",
             f"{'batch':>6} {'input':>6} {'output':>6} {'plugserve ms':>13} {'HF ms':>10} {'limit ms':>9} "
             f"{'of limit':>9} {'speed-up':>9} {'GB/step':>8}"]
    for r in rows:
        lines.append(f"{r['batch_size']:>6} {r['input_len']:>6} {r['output_len']:>6} "
                     f"{cell(r['plugserve_ms'], '.3f'):>13} {cell(r['hf_ms'], '.3f'):>10} {r['limit_ms']:>9.3f} "
                     f"{cell(r['fraction_of_limit'], '.1%'):>9} {cell(r['speedup_over_hf'], '.2f'):>9} "
                     f"{r['bytes']['total'] / 1e9:>8.2f}")
    lines.append("=" * len(lines[0]))
    return "\n".join(lines)


def write_report(report: dict[str, Any], path: str | None) -> list[dict[str, Any]]:
    rows = finish_rows(report)
    if path:
        out = {k: v for k, v in report.items() if k != "rows"} | {"rows": rows}
        Path(path).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_one_batch.add_arguments(parser)
    parser.set_defaults(batch_size=[1, 8, 32, 64, 128], input_len=[256], output_len=[32])
    parser.add_argument("--result-filename", default=None, help="write the report as JSON")
    parser.add_argument("--skip-hf", action="store_true", help="plugserve and the limit only (e.g. block-FP8)")
    parser.add_argument("--skip-plugserve", action="store_true", help="transformers and the limit only")
    parser.add_argument("--hf-no-compile", action="store_true", help="run transformers' generate eagerly")
    parser.add_argument("--hf-fullgraph", action="store_true", help="compile transformers' forward with fullgraph")
    parser.add_argument("--hf-experts-implementation", default=None, choices=["eager", "grouped_mm", "batched_mm"],
                        help="transformers' routed-expert kernels (default: its own choice; on a GPU generate "
                             "decodes grouped_mm as batched_mm)")
    parser.add_argument("--hf-warmup", type=int, default=2, help="generate runs before timing (compile, graphs)")
    parser.add_argument("--hf-reps", type=int, default=3, help="timed generate runs per batch size (median)")
    namespace = parser.parse_args(argv)
    if min(namespace.output_len) < 2:
        parser.error("--output-len must be >= 2: a decode step is timed over the output_len - 1 after the first token")
    device = torch.device(namespace.device if namespace.device != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    model_dir = server_args_from(namespace, parser).model_dir
    config, _ = read_config(model_dir, namespace.model_preset, namespace.quantization, namespace.num_layers)
    dtype = resolve_dtype(namespace.dtype, device)
    if not namespace.skip_hf:
        try:
            hf_config(config)
        except ValueError as exc:
            parser.error(str(exc))
    cases = list(itertools.product(namespace.batch_size, namespace.input_len, namespace.output_len))
    hardware = Hardware.detect(device)

    # The ceilings first, on an empty device: the full 2 GiB on a GPU, the shootout's quick ones elsewhere.
    ceilings = measure_ceilings(device, quick=device.type != "cuda")
    _free(device)
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    kv_dtype = dtype if namespace.kv_cache_dtype == "auto" else KV_DTYPES.get(namespace.kv_cache_dtype, dtype)
    kv_bytes = torch.empty(0, dtype=kv_dtype).element_size()
    report: dict[str, Any] = {
        "device": hardware.name,
        "model": f"{namespace.model_preset or model_dir}, {config.num_hidden_layers} layers, "
                 + ("block-FP8" if config.fp8_block else str(dtype).removeprefix("torch.")),
        "config": dataclasses.asdict(config), "args": vars(namespace).copy(), "versions": _versions(),
        "ceilings": ceilings, "dtype": str(dtype).removeprefix("torch."),
        "hf_mode": "skipped" if namespace.skip_hf else "eager" if namespace.hf_no_compile or device.type != "cuda"
                   else f"torch.compile by generate (reduce-overhead, fullgraph={namespace.hf_fullgraph})",
        "plugserve_mode": ("overlap scheduler (interval between steps; the next one planned while one runs)"
                           if namespace.overlap else "each step alone (planned, run, read back, processed)"),
        "rows": {},
    }
    for batch_size, input_len, output_len in cases:
        step = decode_step_bytes(config, batch_size, input_len + output_len / 2, dtype_bytes, kv_bytes)
        report["rows"][(batch_size, input_len, output_len)] = {
            "bytes": dataclasses.asdict(step) | {"total": step.total},
            "limit_ms": step.total / (ceilings["memory_gbps"] * 1e9) * 1e3,
        }

    if not namespace.skip_plugserve:
        run_plugserve(namespace, parser, device, cases, report)
        write_report(report, namespace.result_filename)
    if not namespace.skip_hf:
        run_hf(namespace, config, dtype, device, cases, report)
    print("\n" + format_table(write_report(report, namespace.result_filename), report))


if __name__ == "__main__":
    main(sys.argv[1:])
