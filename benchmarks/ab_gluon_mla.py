"""The Gluon MLA decode kernel (WIP, branch gluon-mla) beside the Triton backend's on DeepSeek's decode shapes
(128 heads, latent 512 + rope 64, page 64, bf16), at the backend's split count, replayed from a CUDA graph, as a
fraction of the same-run limit (max(KV bytes / copy GB/s, flops / bf16 TFLOP/s), as the shootout computes it);
each checked against the Triton backend's output first.

    python -m benchmarks.ab_gluon_mla --shapes 1x32768 32x8192 128x8192
"""

from __future__ import annotations

import argparse
import functools

import torch

from benchmarks.shootout import measure_ceilings, timed
from plugserve.core.forward_batch import ForwardMode
from plugserve.core.interfaces import AttentionSpec
from plugserve.plugins.attention import gluon_mla
from plugserve.plugins.attention.triton import TritonAttention
from plugserve.testing.batches import random_batch

GLUON_CONFIGS = [(64, 2), (32, 3), (32, 4)]  # (keys a block, stages)


def compare(batch_size: int, kv: int, heads: int, ceilings: dict[str, float]) -> None:
    """Both kernels at one decode shape, one line each."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    spec = AttentionSpec(num_heads=heads, dtype=dtype, page_size=64)
    batch = random_batch(ForwardMode.DECODE, [kv] * batch_size, [1] * batch_size, spec, device, num_layers=1)
    q_nope = torch.randn(batch_size, heads, spec.kv_lora_rank, device=device, dtype=dtype)
    q_rope = torch.randn(batch_size, heads, spec.qk_rope_head_dim, device=device, dtype=dtype)
    kv_bytes = batch_size * kv * (spec.kv_lora_rank + spec.qk_rope_head_dim) * 2
    flops = 2 * batch_size * heads * kv * (2 * spec.kv_lora_rank + spec.qk_rope_head_dim)
    limit = max(kv_bytes / (ceilings["copy_gbps"] * 1e9), flops / (ceilings["bf16_tflops"] * 1e12))
    backend = TritonAttention(spec, device)
    backend.plan(batch)
    expected = backend.forward_mla(q_nope, q_rope, 0).float()
    runs = {"triton": functools.partial(backend.forward_mla, q_nope, q_rope, 0)}
    for block_n, stages in GLUON_CONFIGS:
        runs[f"gluon n{block_n}s{stages}"] = functools.partial(
            gluon_mla.gluon_mla_attention, q_nope, q_rope, batch.kv_pool.buffer(0), batch.block_table,
            backend._token_req, backend._token_kv_len, 64, spec.softmax_scale, backend._num_splits, block_n, stages)
    for name, run in runs.items():
        try:
            diff = (run().float() - expected).abs().max().item() / expected.abs().max().item()
            seconds, how = timed(run, device, 3, 20)
        except Exception as exc:  # report and go on to the next run
            print(f"b{batch_size} kv{kv} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        print(f"b{batch_size:<4} kv{kv:<6} x{backend._num_splits:<3} {name:11} {seconds * 1e6:8.1f} us  "
              f"{limit / seconds:.2f} of limit ({how})" + ("" if diff < 2e-2 else f"  WRONG {diff:.3g}"), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1x32768", "8x8192", "32x8192", "128x8192", "64x4096"])
    parser.add_argument("--heads", type=int, default=128)
    args = parser.parse_args()
    ceilings = measure_ceilings(torch.device("cuda"), quick=False)
    for shape in args.shapes:
        batch_size, kv = (int(x) for x in shape.split("x"))
        compare(batch_size, kv, args.heads, ceilings)


if __name__ == "__main__":
    main()
