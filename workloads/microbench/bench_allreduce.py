"""Microbenchmark: Flying's shared-memory all-reduce vs gloo, on one host.

Spawns N processes that form a gloo group over TCP on 127.0.0.1 (as SGLang's CPU ranks
do), builds the shared-memory group on it, and times back-to-back all-reduces (sum,
float32) of each size with both paths. Each process is pinned to core ``rank % cores``
with one torch thread, like the CPU platform pins its ranks. Every result is checked.

CLI::

    python -m workloads.bench_allreduce [--procs 2,4] [--sizes 1K,4K,...,4M] [--budget 0.4]

Prints a markdown table: per-call latency (median of 5 timed batches, microseconds) of
gloo and of the shared-memory path, and the speedup.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workloads.measure.server import free_port

DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M"
REPEATS = 5


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _time_batch(fn, t: torch.Tensor, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn(t)
    return (time.perf_counter() - start) / iters


def _agree_iters(est_s: float, budget_s: float) -> int:
    """Rank 0's iteration count for one batch, broadcast so every rank runs the same."""
    n = torch.tensor([max(5, min(5000, int(budget_s / REPEATS / max(est_s, 1e-7))))])
    dist.broadcast(n, src=0)
    return int(n[0])


def _worker(rank: int, world: int, port: int, sizes: list[int], budget_s: float, q) -> None:
    from flying.substrate.shm_allreduce import ShmAllReduce

    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, [cores[rank % len(cores)]])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    pg = dist.group.WORLD
    comm = ShmAllReduce.create(pg, rank, world, label="bench", slot_bytes=max(sizes))
    assert comm is not None, "shared-memory group could not be created"
    expect = world * (world + 1) / 2
    rows = []
    for size in sizes:
        t = torch.empty(size // 4, dtype=torch.float32)
        result = {}
        for name, fn in (
            ("gloo", lambda x: dist.all_reduce(x, group=pg)),
            ("shm", comm.all_reduce_),
        ):
            t.fill_(rank + 1)
            fn(t)
            assert torch.all(t == expect), f"{name} wrong sum at {size} B"
            est = _time_batch(fn, t, 3)
            iters = _agree_iters(est, budget_s)
            dist.barrier()
            result[name] = statistics.median(_time_batch(fn, t, iters) for _ in range(REPEATS))
        rows.append((size, result["gloo"], result["shm"]))
    comm.close()
    dist.destroy_process_group()
    if rank == 0:
        q.put(rows)


def run(world: int, sizes: list[int], budget_s: float) -> list[tuple[int, float, float]]:
    """(bytes, gloo seconds per call, shm seconds per call) for each size."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, sizes, budget_s, q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    rows = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"worker exited with {p.exitcode}")
    return rows


def table(results: dict[int, list[tuple[int, float, float]]]) -> str:
    lines = [
        "| processes | size | gloo (us) | shm (us) | speedup |",
        "|---:|---:|---:|---:|---:|",
    ]
    for world, rows in results.items():
        for size, gloo, shm in rows:
            lines.append(
                f"| {world} | {fmt_size(size)} | {gloo * 1e6:.1f} | {shm * 1e6:.1f} "
                f"| {gloo / shm:.1f}x |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", default="2,4", help="comma-separated process counts")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated sizes")
    parser.add_argument("--budget", type=float, default=0.4, help="seconds per size and path")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    results = {int(w): run(int(w), sizes, args.budget) for w in args.procs.split(",")}
    print(f"\nAll-reduce (sum, float32), {os.cpu_count()} cores, {torch.__version__}\n")
    print(table(results))


if __name__ == "__main__":
    main()
