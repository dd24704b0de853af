"""A group's collective setup of its shared segment (``flying.substrate.shm_allreduce``).

Every member calls ``open_segment`` at the same point, over a gloo group of the members.
Rank 0 creates and sizes the file; its name reaches the others through one all-reduce;
they map it, each writes its pid and pid namespace into its rank line, and all vote;
rank 0 unlinks the file after the vote (``shm_segment``'s invariant: no file outlives a
setup). Either every member gets a mapping or none does: a member that could not map
(not on one host, /dev/shm full) makes every member fall back to gloo together.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets

import numpy as np
import torch
import torch.distributed as dist

from flying.substrate import shm_segment

#: Characters of a segment name carried through the setup all-reduce.
NAME_LEN = 64


def group_allreduce(pg: dist.ProcessGroup, t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ``pg`` in place, with group-local semantics (no global ranks)."""
    pg.allreduce([t]).wait()
    return t


def release(mm: mmap.mmap, lock_fd: int) -> None:
    """Unmap a member's segment and close its file (the group's flock)."""
    shm_segment.release(mm)
    if lock_fd >= 0:
        with contextlib.suppress(OSError):
            os.close(lock_fd)


def all_enabled(pg: dist.ProcessGroup, enabled: bool) -> bool:
    """Whether the shared path is enabled on every member (one all-reduce)."""
    off = torch.tensor([0 if enabled else 1], dtype=torch.int64)
    return int(group_allreduce(pg, off)[0]) == 0


def open_segment(pg: dist.ProcessGroup, rank: int, world: int, size: int,
                 line_offset: int) -> tuple[mmap.mmap, int] | str:
    """This member's (mapping, open file descriptor) of the group's new ``size``-byte
    segment, or on every member alike the reason the group cannot have one. Two small
    all-reduces on ``pg``. ``line_offset``: where this rank's line starts (its words 1
    and 2 get the pid and the pid namespace id)."""
    name, mm, reason, lock_fd = "", None, "", -1
    if rank == 0:
        shm_segment.sweep_stale()
        name = f"{shm_segment.PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
        try:
            mm = shm_segment.create(shm_segment.SHM_DIR / name, size, world)
            lock_fd = os.open(shm_segment.SHM_DIR / name, os.O_RDWR)
        except OSError as exc:
            reason, name = f"cannot create segment: {exc}", ""
    codes = torch.zeros(NAME_LEN, dtype=torch.int64)
    if rank == 0 and name:
        codes[: len(name)] = torch.tensor([ord(c) for c in name], dtype=torch.int64)
    group_allreduce(pg, codes)
    name = "".join(chr(int(c)) for c in codes if int(c) != 0)
    if name and rank != 0:
        try:
            mm = shm_segment.attach(shm_segment.SHM_DIR / name, size, world)
            lock_fd = os.open(shm_segment.SHM_DIR / name, os.O_RDWR)
        except (OSError, ValueError) as exc:
            reason = f"cannot map {name}: {exc} (members not on one host?)"
    if mm is not None:
        line = np.frombuffer(mm, dtype=np.int64, count=3, offset=line_offset)
        line[1], line[2] = os.getpid(), shm_segment.pidns()
        del line
    ok = torch.tensor([1 if mm is not None else 0], dtype=torch.int64)
    group_allreduce(pg, ok)
    if rank == 0 and name:
        shm_segment.unlink(shm_segment.SHM_DIR / name)
    if int(ok[0]) != world:
        if mm is not None:
            release(mm, lock_fd)
        return reason or "a member could not map the segment (members not on one host?)"
    return mm, lock_fd
