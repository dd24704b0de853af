"""Lifecycle of the /dev/shm files behind ``flying.substrate.shm_allreduce``: create, attach, unlink.

Invariant: a segment file exists in /dev/shm only during a group's setup, between its
creation by the group's rank 0 and the members' vote that everyone mapped it; then rank 0
unlinks it and the mappings live on until the processes exit. So no teardown path, crash
or SIGKILL after setup can leak one. The setup window itself is covered by an ``atexit``
unlink in the creator and by :func:`sweep_stale`, which removes files whose creator pid
(part of the name) is gone, each time a new segment is created.
"""

from __future__ import annotations

import atexit
import mmap
import os
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
#: Every segment is named ``<PREFIX><creator pid>_<random hex>``.
PREFIX = "flying_shm_ar_"
MAGIC = 0x464C59494E475348  # "FLYINGSH"
#: Header: int64 [magic, world, size, 0], checked by every member that attaches.
HEADER_WORDS = 4

# Segments this process created and has not unlinked yet (setup window only).
_PENDING_UNLINK: set[Path] = set()


@atexit.register
def _unlink_pending() -> None:
    for path in list(_PENDING_UNLINK):
        unlink(path)


def pidns() -> int:
    """This process's pid namespace id: pids are comparable only within one namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def sweep_stale(shm_dir: Path | None = None, prefix: str = PREFIX) -> list[str]:
    """Remove files named ``<prefix><pid>_...`` whose creator process is gone (a segment
    killed inside its setup window; the status board of a killed launcher)."""
    removed = []
    for path in (shm_dir or SHM_DIR).glob(prefix + "*"):
        try:
            pid = int(path.name[len(prefix) :].split("_", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed.append(path.name)
        except (ValueError, OSError):
            continue
    return removed


def _flags(populate: bool) -> int:
    """``mmap`` flags: shared, and with ``populate`` every page mapped at once (one
    system call instead of a page fault per 4 KiB page at first touch: a fresh 32 MiB
    block written through its mapping took ~15 ms, a populated one ~1.5)."""
    return mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)


def create(path: Path, size: int, world: int, populate: bool = False) -> mmap.mmap:
    """Create ``path`` (exclusively), reserve ``size`` bytes, map it, write the header.

    ``posix_fallocate`` makes a full /dev/shm fail here with ENOSPC instead of killing
    the process with SIGBUS on its first write to an unbacked page.
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    _PENDING_UNLINK.add(path)
    try:
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, flags=_flags(populate))
    except OSError:
        unlink(path)
        raise
    finally:
        os.close(fd)
    header = np.frombuffer(mm, dtype=np.int64, count=HEADER_WORDS)
    header[:] = (MAGIC, world, size, 0)
    del header  # no buffer export may outlive this function (mmap.close needs none)
    return mm


def attach(path: Path, size: int | None, world: int, populate: bool = False) -> mmap.mmap:
    """Map a segment another member created (``size`` None: whatever its size is);
    raise ValueError if it is not the one."""
    fd = os.open(path, os.O_RDWR)
    try:
        actual = os.fstat(fd).st_size
        size = actual if size is None else size
        if actual != size:
            raise ValueError(f"size {actual} != {size}")
        mm = mmap.mmap(fd, size, flags=_flags(populate))
    finally:
        os.close(fd)
    header = np.frombuffer(mm, dtype=np.int64, count=HEADER_WORDS)
    good = tuple(int(x) for x in header[:3]) == (MAGIC, world, size)
    del header
    if not good:
        release(mm)
        raise ValueError("header mismatch")
    return mm


def unlink(path: Path) -> None:
    path.unlink(missing_ok=True)
    _PENDING_UNLINK.discard(path)


def release(mm: mmap.mmap) -> None:
    """Unmap ``mm``; if a tensor still views it, leave it to process exit."""
    try:
        mm.close()
    except BufferError:
        pass
