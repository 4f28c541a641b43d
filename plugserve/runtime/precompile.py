"""A cold start's Triton compiles, ahead, in processes of their own.

A cold start on a GPU compiles some fifty Triton kernels, one at a time: Triton's compiler holds the GIL, so
threads do not help. As `serve` starts, on a GPU whose Triton cache has not yet seen this server's kernels,
`start` spawns up to COMPILE_PROCESSES processes. Each builds a replica of the model with the server's flags but
only its first dense and first MoE layer (no kernel's shapes depend on the depth), random weights, no self-checks
and a KV pool as wide as the server's block table, and runs its share of the warm-up's shapes and CUDA graphs
(`warmup.warm_up`'s `part`), within a share of the GPU's memory that leaves the server room for its weights
(`gpu_share`). Each launch compiles into Triton's on-disk cache, where the server's own launches then find it. The
engine's runner waits for the processes before it measures the device's memory (`wait`, its `before_sizing`). A
marker in the cache, named by the flags, the GPU, Triton's version and plugserve's sources, skips them later.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import multiprocessing
import os
import sys
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING

from plugserve.runtime.server_args import ServerArgs

if TYPE_CHECKING:
    import torch

    from plugserve.core.config import ModelConfig

logger = logging.getLogger(__name__)

COMPILE_PROCESSES = 8  # at most; each imports torch and holds a CUDA context
COMPILE_TIMEOUT_S = 300.0  # a process still compiling then is ended: the warm-up compiles what it left
# A process's share of the GPU: what the server's weights and SERVER_RESERVE of the memory leave, less
# CONTEXT_BYTES (its CUDA context and what Triton and cuBLAS hold outside torch's allocator); under MIN_SHARE_BYTES
# it compiles nothing.
SERVER_RESERVE = 0.1
CONTEXT_BYTES = 2**30
MIN_SHARE_BYTES = 4 * 2**30
NO_ROOM = 3  # a process's exit code when its share was too small, or ran out
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # the driver's GPUs, read without initializing CUDA

# What `start` began and `wait` ends: the processes, the marker they leave when all finish, when they started.
processes: list[BaseProcess] = []
pending_marker: Path | None = None
started_at = 0.0


def start(args: ServerArgs) -> None:
    """Spawn the compiling processes for a one-process server on a GPU (no --tp-size, no DP attention, a warm-up
    to speed up), unless the marker of an earlier start is in Triton's cache. Cheap where it does nothing: it reads
    no CUDA state, so a server on the CPU pays a few file reads."""
    global pending_marker, started_at
    gpu = gpu_model(args.device)
    if gpu is None or args.tp_size > 1 or args.dp_attention_size > 1 or args.skip_server_warmup or processes:
        return
    marker = compiled_marker(args, gpu)
    if marker.exists():
        return
    parts = min(COMPILE_PROCESSES, max(1, (os.cpu_count() or 2) // 2))
    spawn = multiprocessing.get_context("spawn")  # a fresh CUDA context each, nothing of this process's
    processes.extend(spawn.Process(target=compile_share, args=(args, k, parts), daemon=True, name=f"compile-{k}")
                    for k in range(parts))
    for process in processes:
        process.start()
    pending_marker, started_at = marker, time.perf_counter()
    logger.info("compiling the warm-up's kernels ahead in %d processes (a first start on this GPU)", parts)


def wait() -> None:
    """Wait for the processes `start` spawned (none: return at once); leave the marker when all finished."""
    if not processes:
        return
    for process in processes:
        process.join(max(0.0, COMPILE_TIMEOUT_S - (time.perf_counter() - started_at)))
        if process.is_alive():
            process.kill()
            process.join()
    failed = [f"{p.name} (exit code {p.exitcode})" for p in processes if p.exitcode not in (0, NO_ROOM)]
    crowded = [p.name for p in processes if p.exitcode == NO_ROOM]
    if failed:
        logger.warning("compiling ahead failed in %s; the warm-up compiles what they left", ", ".join(failed))
    elif pending_marker is not None:  # no room is no reason to try again: the GPU and the weights stay the same
        pending_marker.parent.mkdir(parents=True, exist_ok=True)
        pending_marker.touch()
    if crowded:
        logger.info("%s found no room on the GPU beside the server's weights; the warm-up compiles their share",
                    ", ".join(crowded))
    logger.info("kernels compiled ahead in %.1f s", time.perf_counter() - started_at)
    processes.clear()


def gpu_model(device: str) -> str | None:
    """The model name of the first NVIDIA GPU this process would use under --device `device`, from the driver's
    files (CUDA is not initialized); None on the CPU or where no GPU is visible."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device == "cpu" or visible in ("", "-1") or not NVIDIA_GPUS.is_dir():
        return None
    for info in sorted(NVIDIA_GPUS.glob("*/information")):
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                return line.split(":", 1)[1].strip()
    return None


def compiled_marker(args: ServerArgs, gpu: str) -> Path:
    """The file a finished compile-ahead leaves in Triton's cache directory, named by what the kernels depend on:
    the flags, the GPU, Triton's version and plugserve's sources (a change to any, or an emptied cache, compiles
    anew)."""
    digest = hashlib.sha256()
    for part in (args.model_dump_json(exclude={"host", "port", "api_key", "log_level"}), gpu,
                 importlib.metadata.version("triton")):
        digest.update(part.encode())
    package = Path(__file__).resolve().parents[1]
    for source in sorted(package.rglob("*.py")):
        digest.update(source.read_bytes())
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return root / f"plugserve-compiled-{digest.hexdigest()[:32]}"


def compile_share(args: ServerArgs, part: int, parts: int) -> None:
    """A compiling process: the replica of `args`'s model (see the module's docstring) warmed up at its share of the
    shapes, `part` of `parts`, within its share of the GPU's memory (`gpu_share`; exit code NO_ROOM where that is too
    small or runs out)."""
    logging.basicConfig(level=logging.ERROR)
    import torch

    from plugserve.core.loader import read_config, resolve_dtype
    from plugserve.runtime.backends import WARMUP_PREFILL_TOKENS
    from plugserve.runtime.model_runner import ModelRunner, context_length, rank_device
    from plugserve.runtime.warmup import warm_up

    config, _ = read_config(args.model_dir, args.model_preset, args.quantization, args.num_layers)
    device = rank_device(args, 0)
    if device.type == "cuda":
        if device.index is not None:  # --device cuda:N; plain cuda is the current device already
            torch.cuda.set_device(device)
        share = gpu_share(config, resolve_dtype(args.dtype, device), parts)
        if share is None:
            sys.exit(NO_ROOM)
        torch.cuda.set_per_process_memory_fraction(share)
    layers = config.first_k_dense_replace + 1 if config.n_routed_experts else 1
    # Pages for the block table's widest row (the graphs' tables are as wide) and the warm-up's longest prompt.
    tokens = context_length(args, config.max_position_embeddings) + 2 * WARMUP_PREFILL_TOKENS
    replica = args.model_copy(update={"num_layers": min(layers, config.num_hidden_layers), "load_format": "dummy",
                                      "max_total_tokens": tokens, "mem_fraction_static": None})
    try:
        warm_up(ModelRunner(replica, self_check=False), part=(part, parts))
    except torch.OutOfMemoryError:
        sys.exit(NO_ROOM)


def gpu_share(config: ModelConfig, dtype: torch.dtype, parts: int) -> float | None:
    """The fraction of the current GPU's memory one of `parts` compiling processes may take: the free memory less
    the server's weights (the model built on the meta device), SERVER_RESERVE of the total and each process's
    CONTEXT_BYTES, split evenly; None under MIN_SHARE_BYTES."""
    import torch

    from plugserve.core.models.deepseek import DeepseekForCausalLM

    model = DeepseekForCausalLM(config, dtype, torch.device("meta"), with_nextn=config.num_nextn_predict_layers > 0)
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    free, total = torch.cuda.mem_get_info()
    share = (free - weights - SERVER_RESERVE * total) / parts - CONTEXT_BYTES
    return share / total if share >= MIN_SHARE_BYTES else None
