"""A shared-memory all-reduce / all-gather for process groups whose members share a host.

Why: on the CPU platform SGLang's device collectives go through gloo, which costs ~1 ms
per call for a [1, 256] tensor on a 2-core machine (loopback TCP, several syscalls and
wake-ups). A decode step of an 8-layer model makes 16 of them, so TP loses to one engine.
SGLang's own CPU fix (``sgl_kernel.shm_allreduce``) needs a CPU build of sgl_kernel that
is not on PyPI. This is the same idea in torch + numpy: one shared segment per group.

Segment layout (one mmap of a /dev/shm file; the file is unlinked as soon as every member
has mapped it, so nothing survives in /dev/shm after setup, whatever happens later)::

    [header 64 B][rank lines W x 64 B][pad to 4 KiB][data: 2 parities x W slots x S bytes]

A rank line holds that rank's published sequence number (int64), its pid and its pid
namespace id; one cache line per rank, so publishing never shares a line with a peer.
Header words 5-7 and rank-line words 3-7 belong to the bind handshake
(``flying.substrate.bind_handshake``).

Protocol of call number ``s`` (1, 2, ...) on rank ``r``:

1. copy the input's bytes into slot ``(s % 2, r)``;
2. publish ``seq[r] = s``;
3. wait until ``seq[j] >= s`` for every peer ``j`` (spin briefly, then yield, then sleep
   with backoff, bounded by a timeout);
4. read all W slots of parity ``s % 2``: sum them in rank order (in float32 for fp16/bf16)
   or concatenate them (all-gather), into the caller's tensor.

Invariant (why parity double-buffering is enough): rank ``r`` writes slot ``(p, r)`` again
only at call ``s + 2``, after it waited at call ``s + 1`` for every peer to publish
``s + 1``, and a peer publishes ``s + 1`` only after it finished reading call ``s``. So a
slot is never overwritten while someone still reads it, and no second barrier is needed.
A peer can be at most one call ahead, hence ``>=`` in step 3.

Every rank adds the same W operands in the same order, so results are bit-identical on
every member. Memory ordering: the data copy and the sequence store are separate C calls
and x86-64 keeps stores (and loads) in program order (TSO); on other architectures the
group falls back to gloo rather than rely on ordering we cannot fence from Python.

Callers must issue collectives in the same order on every member, and decide "shm or
fallback" from things that are equal on every member (dtype and byte size): both hold
for SGLang's collectives, which all members issue with tensors of the same shape.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from flying.substrate import shm_segment, shm_setup
from flying.substrate.shm_config import WaitPolicy, enabled, slot_bytes_from_env

logger = logging.getLogger(__name__)

_HEADER = 64
_LINE = 64  # bytes per rank line (one cache line)
_ALIGN = 4096
_VIEW_CACHE_MAX = 1024
#: Header word (int64 index) that a member sets to poison the group after a fault: every
#: peer waiting in a collective raises at once instead of waiting for the timeout.
_POISON_WORD = 4

#: Dtypes the shared path sums; others (and all-gathers of any dtype) are fine for gather.
REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)



class ShmAllReduceError(RuntimeError):
    """The shared-memory group cannot complete a collective (timeout, dead peer)."""


def _data_offset(world: int) -> int:
    return -(-(_HEADER + world * _LINE) // _ALIGN) * _ALIGN


class ShmAllReduce:
    """One rank's handle on its group's shared segment. Not thread-safe (one caller).

    Build it with :meth:`create`, collectively on every member; ``None`` means "use the
    fallback" and every member gets ``None`` together.
    """

    def __init__(
        self,
        mm: mmap.mmap,
        rank: int,
        world: int,
        slot_bytes: int,
        label: str,
        policy: WaitPolicy,
        lock_fd: int = -1,
    ) -> None:
        self.rank, self.world, self.slot_bytes = rank, world, slot_bytes
        self._lock_fd = lock_fd  # the segment's file, open: the group's flock (``locked``)
        self.label, self.policy = label, policy
        self._mm = mm
        self._header = np.frombuffer(mm, dtype=np.int64, count=_HEADER // 8, offset=0)
        lines = np.frombuffer(mm, dtype=np.int64, count=world * _LINE // 8, offset=_HEADER)
        self._lines = lines.reshape(world, _LINE // 8)  # [W, 8]: seq, pid, pidns, ...
        self._seq_col = self._lines[:, 0]
        self._peers = [j for j in range(world) if j != rank]
        off = _data_offset(world)
        data = torch.frombuffer(mm, dtype=torch.uint8, offset=off, count=2 * world * slot_bytes)
        self._data = data.view(2, world, slot_bytes)  # [parity, rank, bytes]
        self._views_cache: dict[tuple, list[torch.Tensor]] = {}
        self._seq = int(self._lines[rank, 0])
        self._pidns = shm_segment.pidns()
        self.broken: str | None = None
        self.calls = 0  # collectives completed through shared memory
        self.calls_gather = 0
        self.noted: set[tuple[str, str]] = set()  # (op, path) pairs already logged
        self._finalizer = weakref.finalize(self, shm_setup.release, mm, lock_fd)

    # -- setup ---------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        pg: dist.ProcessGroup,
        rank: int,
        world: int,
        *,
        label: str = "group",
        slot_bytes: int | None = None,
        policy: WaitPolicy | None = None,
    ) -> ShmAllReduce | None:
        """Collectively set up the segment over ``pg`` (a gloo group of the members).

        Rank 0 creates and sizes the file; its name reaches the others through one
        all-reduce on ``pg``; they map it and vote; rank 0 unlinks it after the vote
        (``shm_setup.open_segment``). Returns ``None`` on every member when any member
        could not map it (not on one host, /dev/shm full) or when the path is disabled.
        Costs three small gloo all-reduces; call it at a point every member reaches in
        the same order.
        """
        slot_bytes = slot_bytes_from_env() if slot_bytes is None else int(slot_bytes)
        slot_bytes = max(64, -(-slot_bytes // 64) * 64)
        policy = policy or WaitPolicy.from_env()
        if world < 2:
            return None
        if not shm_setup.all_enabled(pg, enabled()):
            logger.info("flying: %s uses gloo for all-reduce (shared memory disabled)", label)
            return None
        size = _data_offset(world) + 2 * world * slot_bytes
        opened = shm_setup.open_segment(pg, rank, world, size, _HEADER + rank * _LINE)
        if isinstance(opened, str):
            logger.info("flying: %s uses gloo for all-reduce (%s)", label, opened)
            return None
        mm, lock_fd = opened
        comm = cls(mm, rank, world, slot_bytes, label, policy, lock_fd)
        logger.info(
            "flying: %s uses shared-memory all-reduce (%d ranks, %d KiB per slot, "
            "gloo above that)",
            label,
            world,
            slot_bytes >> 10,
        )
        return comm

    # -- collectives ---------------------------------------------------------------

    def fits(self, t: torch.Tensor) -> bool:
        """Whether ``t`` can use the shared path (decided identically on every member)."""
        return t.numel() * t.element_size() <= self.slot_bytes

    def can_reduce(self, t: torch.Tensor) -> bool:
        return t.dtype in REDUCE_DTYPES and self.fits(t)

    def _views(self, parity: int, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's slot of ``parity`` as a contiguous tensor shaped like ``t``.

        Cached per (parity, dtype, shape): torch indexing costs microseconds per call,
        which is the whole budget of a small all-reduce.
        """
        key = (parity, t.dtype, t.shape)
        views = self._views_cache.get(key)
        if views is None:
            if len(self._views_cache) >= _VIEW_CACHE_MAX:
                self._views_cache.clear()
            typed = self._data.view(t.dtype)  # [2, W, S / itemsize]
            n = t.numel()
            views = [typed[parity, j, :n].view(t.shape) for j in range(self.world)]
            self._views_cache[key] = views
        return views

    def _exchange(self, t: torch.Tensor, write: bool = True,
                  fill: Callable[[torch.Tensor], None] | None = None) -> list[torch.Tensor]:
        """Steps 1-3 of the protocol; returns the W slots to read (rank order). Without
        ``write`` this member publishes without copying ``t`` in (its slot is not read);
        with ``fill``, ``fill(slot)`` writes this member's bytes into its slot (a view
        shaped like ``t``, which may then be a ``meta`` tensor) instead of a copy of ``t``."""
        if self.broken is not None:
            raise ShmAllReduceError(f"flying: {self.label}: group is unusable: {self.broken}")
        if self._header[_POISON_WORD]:
            self._fail(-1, self._seq + 1, "the group was poisoned by a member's fault")
        seq = self._seq + 1
        views = self._views(seq & 1, t)
        if fill is not None:
            fill(views[self.rank])
        elif write:
            views[self.rank].copy_(t)
        self._seq_col[self.rank] = seq  # publish (after the copy: x86 store order)
        self._seq = seq
        col = self._seq_col
        for j in self._peers:
            if col[j] < seq:
                self._wait(j, seq)
        self.calls += 1
        return views

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (any shape, fp32/bf16/fp16) over the group, in place; returns ``t``.

        Operands are added in rank order, 16-bit ones accumulated in float32 (for two
        ranks one 16-bit add is exactly that: torch computes it in float32 and rounds
        once), so every member gets bit-identical results.
        """
        v = self._exchange(t)
        if self.world == 2 or t.dtype == torch.float32:
            torch.add(v[0], v[1], out=t)
            for j in range(2, self.world):
                t.add_(v[j])
        else:
            acc = v[0].float()
            for j in range(1, self.world):
                acc.add_(v[j])
            t.copy_(acc)
        return t

    def exchange(self, t: torch.Tensor, write: bool = True,
                 fill: Callable[[torch.Tensor], None] | None = None) -> list[torch.Tensor]:
        """Every member's ``t`` (same shape and dtype on all; at most ``slot_bytes``), in
        rank order, as views of the segment: read them before this member's next call
        (a peer overwrites a slot only after this member has published the next one).
        Without ``write`` this member copies nothing in (``t`` may be a ``meta``
        tensor; its slot holds stale bytes): a gather that no peer reads it for. With
        ``fill`` (``t`` may be ``meta``), ``fill(slot)`` writes this member's bytes
        straight into its slot: a sender that builds them from scattered rows saves
        the copy into a tensor of its own."""
        views = self._exchange(t, write, fill)
        self.calls_gather += 1
        return views

    def broadcast(self, t: torch.Tensor, src: int,
                  fill: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Rank ``src``'s ``t`` as a view of the segment (at most ``slot_bytes``; read it
        before this member's next call). Every member passes a tensor of the same shape
        and dtype; only ``src`` copies its bytes in, so the others may pass a ``meta``
        tensor (and so may ``src`` with ``fill``, which writes its bytes into its slot,
        as in ``exchange``). The same protocol as ``exchange`` (every member publishes
        and waits for every peer), one copy in instead of W."""
        mine = self.rank == src
        view = self._exchange(t, write=mine, fill=fill if mine else None)[src]
        self.calls_gather += 1
        return view

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every member's ``t`` along ``dim``, in rank order (a new tensor).

        Shapes: ``t`` is [..., n, ...] on every member -> [..., W * n, ...].
        """
        out = torch.cat(self._exchange(t), dim=dim)
        self.calls_gather += 1
        return out

    # -- waiting -------------------------------------------------------------------

    def _wait(self, peer: int, seq: int) -> None:
        col, p = self._seq_col, self.policy
        start = time.perf_counter()
        spins = 0
        header = self._header
        while col[peer] < seq:  # spin: no syscalls, a clock read every 64 polls
            spins += 1
            if spins & 63 == 0:
                if header[_POISON_WORD]:
                    self._fail(peer, seq, "a member poisoned the group after a fault")
                if time.perf_counter() - start > p.spin_s:
                    break
        else:
            return
        sleep = p.first_sleep_s
        next_liveness = start + 0.5
        while col[peer] < seq:
            if header[_POISON_WORD]:
                self._fail(peer, seq, "a member poisoned the group after a fault")
            now = time.perf_counter()
            if now - start < p.yield_s:
                os.sched_yield()
                continue
            if now - start > p.timeout_s:
                self._fail(peer, seq, f"timed out after {now - start:.2f} s")
            if now >= next_liveness:
                next_liveness = now + 0.5
                if not self._peer_alive(peer):
                    self._fail(peer, seq, f"its process (pid {int(self._lines[peer, 1])}) exited")
            time.sleep(sleep)
            sleep = min(2 * sleep, p.max_sleep_s)

    def poisoned(self) -> bool:
        """Whether a member marked the group failed (``poison``) in this epoch."""
        return self._header is not None and bool(self._header[_POISON_WORD])

    def peer_alive(self, peer: int) -> bool:
        """False only when we can tell that TP rank ``peer``'s process is gone."""
        return self._peer_alive(peer)

    def _peer_alive(self, peer: int) -> bool:
        """False only when we can tell that the peer's process is gone (same pid ns)."""
        pid, ns = int(self._lines[peer, 1]), int(self._lines[peer, 2])
        if pid <= 0 or ns != self._pidns:
            return True
        try:  # a zombie (exited, not yet reaped) still answers kill(pid, 0)
            stat = Path(f"/proc/{pid}/stat").read_text()
            return stat[stat.rindex(")") + 2] not in "ZX"
        except FileNotFoundError:
            return False
        except (OSError, ValueError, IndexError):
            return True

    def _fail(self, peer: int, seq: int, why: str) -> None:
        self.broken = (
            f"rank {peer} of {self.world} did not reach collective #{seq} ({why}); "
            "every member must issue the same collectives in the same order"
        )
        raise ShmAllReduceError(f"flying: {self.label}: {self.broken}")

    # -- faults --------------------------------------------------------------------

    def poison(self) -> None:
        """Mark the group failed: every member waiting in (or entering) a collective
        raises ``ShmAllReduceError`` within one poll, so a fault on one member ends the
        session on all of them in milliseconds, not after ``timeout_s``."""
        if self._header is not None:
            self._header[_POISON_WORD] = 1

    def control_words(self) -> tuple[np.ndarray, np.ndarray]:
        """(header [8], rank lines [W, 8]) int64 views: words 5-7 of the header and 3-7
        of each line are free for the group's control protocols (``bind_handshake``)."""
        return self._header, self._lines

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the group's lock (``flock`` on the segment's file, which every member
        keeps open): a critical section across members, with the kernel's full memory
        barriers on entry and exit, released by the kernel if the holder dies."""
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def published_max(self) -> int:
        """The highest sequence number any member has published."""
        return int(self._seq_col.max())

    def resync(self, base: int, clear_poison: bool) -> None:
        """Start a new epoch at sequence ``base`` (the same on every member).

        Only at a bind rendezvous, when no member is inside a collective: after a fault
        the members' counters may differ (one left mid-collective), so each session
        starts from a base the leader chose above every published number. The leader
        clears the poison (``clear_poison``) before it announces the base.
        """
        if clear_poison and self._header is not None:
            self._header[_POISON_WORD] = 0
        self._seq = base
        if self.broken is not None and self.broken != "closed":
            self.broken = None

    # -- teardown ------------------------------------------------------------------

    def close(self) -> None:
        """Drop the mapping (the file was unlinked at setup). Idempotent."""
        self.broken = self.broken or "closed"
        self._views_cache.clear()
        self._data = None  # type: ignore[assignment]
        self._lines = self._seq_col = None  # type: ignore[assignment]
        self._header = None  # type: ignore[assignment]
        self._finalizer()

