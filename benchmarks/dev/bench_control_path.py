"""Host time of one step's control path: rank 0 sends a decode batch's headers to the other ranks, as before each
forward, through the shared-memory channel (int64 words, `ParallelGroup.broadcast_bytes`) or pickled over the gloo
control group (`broadcast_object`, the way before the channel).

    python -m benchmarks.dev.bench_control_path --world-size 2 4 --batch-size 1 64 256

Per case: rank 0's median time in the send (on its path to the forward) and the median time from the send to each
other rank holding the headers, over --steps steps, rank 0 pausing --gap-ms between them as a forward would.
"""

from __future__ import annotations

import argparse
import statistics
import struct
import time

import torch.multiprocessing as mp

from plugserve.core.distributed import destroy_parallel_group, init_parallel_group, pick_free_port
from plugserve.core.forward_batch import ForwardMode
from plugserve.runtime.rank_protocol import Header, decode_headers, encode_headers


def _headers(batch_size: int) -> list[Header | None]:
    return [Header(ForwardMode.DECODE, list(range(300, 300 + batch_size)), [1] * batch_size, 24, batch_size)]


def _rank(rank: int, world_size: int, address: str, batch_size: int, steps: int, gap_s: float, results) -> None:
    group = init_parallel_group(rank, world_size, address, "cpu", timeout_s=120)
    headers = _headers(batch_size)
    try:
        for path in ("shared memory", "gloo pickle"):
            sends, delays = [], []
            for _ in range(steps):
                if rank == 0:
                    time.sleep(gap_s)
                    start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
                    if path == "shared memory":
                        group.broadcast_bytes(encode_headers(headers) + struct.pack("d", start))
                    else:
                        group.broadcast_object((headers, start))
                    sends.append(time.monotonic() - start)
                elif path == "shared memory":
                    data = group.broadcast_bytes(None)
                    decode_headers(data[:-8])
                    delays.append(time.monotonic() - struct.unpack("d", data[-8:])[0])
                else:
                    _, start = group.broadcast_object(None)
                    delays.append(time.monotonic() - start)
            results.put((rank, path, statistics.median(sends or delays)))
    finally:
        destroy_parallel_group()


def run(world_size: int, batch_size: int, steps: int, gap_s: float) -> dict[str, tuple[float, float]]:
    """path -> (rank 0's median send, the slowest other rank's median delay), in seconds."""
    context = mp.get_context("spawn")
    results = context.Queue()
    address = f"tcp://127.0.0.1:{pick_free_port()}"
    processes = [context.Process(target=_rank, args=(r, world_size, address, batch_size, steps, gap_s, results))
                 for r in range(world_size)]
    for process in processes:
        process.start()
    medians = [results.get(timeout=600) for _ in range(2 * world_size)]
    for process in processes:
        process.join()
    return {path: (next(m for r, p, m in medians if r == 0 and p == path),
                   max(m for r, p, m in medians if r > 0 and p == path)) for path in ("shared memory", "gloo pickle")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--gap-ms", type=float, default=2.0, help="rank 0's pause between steps (its forward)")
    args = parser.parse_args()
    print("world  batch  path            rank 0 send (us)  received after (us)")
    for world_size in args.world_size:
        for batch_size in args.batch_size:
            for path, (send, delay) in run(world_size, batch_size, args.steps, args.gap_ms / 1e3).items():
                print(f"{world_size:5d}  {batch_size:5d}  {path:14s}  {send * 1e6:16.1f}  {delay * 1e6:19.1f}")


if __name__ == "__main__":
    main()
