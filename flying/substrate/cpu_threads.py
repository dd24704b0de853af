"""CPU core assignment for engines on the CPU platform.

Each engine process is pinned to its own share of the visible cores (one OpenMP pool
per engine). Without this, every engine's torch spins one thread per core and they
fight: measured 4x slower decode with 2 engines on 2 cores.
"""

from __future__ import annotations

import os


def visible_cores() -> list[int]:
    """The cores this process may run on, sorted."""
    return sorted(os.sched_getaffinity(0))


def split_cores(cores: list[int], ranks: int) -> list[list[int]]:
    """Split ``cores`` into ``ranks`` contiguous, near-equal, non-empty shares.

    With fewer cores than ranks, shares wrap around (engines then share cores).
    """
    if ranks <= 0:
        raise ValueError(f"ranks must be positive, got {ranks}")
    if not cores:
        raise ValueError("no cores to split")
    if len(cores) < ranks:
        return [[cores[i % len(cores)]] for i in range(ranks)]
    base, extra = divmod(len(cores), ranks)
    shares, start = [], 0
    for r in range(ranks):
        n = base + (1 if r < extra else 0)
        shares.append(cores[start : start + n])
        start += n
    return shares


def bind_spec(shares: list[list[int]]) -> str:
    """Render shares in SGLANG_CPU_OMP_THREADS_BIND syntax: "0,1|2,3"."""
    return "|".join(",".join(str(c) for c in share) for share in shares)


def parse_cpu_list(spec: str | list[int]) -> list[int]:
    """Parse "0-3,6" / "0,1" / [0, 1] into a sorted list of core ids."""
    if isinstance(spec, list):
        return sorted(int(c) for c in spec)
    cores: set[int] = set()
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cores.update(range(int(lo), int(hi) + 1))
        else:
            cores.add(int(part))
    return sorted(cores)


def pin_this_process(cores: list[int], threads: int = 0) -> int:
    """Pin the process to ``cores`` and size torch's intra-op pool; returns threads used."""
    import torch

    os.sched_setaffinity(0, cores)
    n = threads or len(cores)
    torch.set_num_threads(n)
    return n
