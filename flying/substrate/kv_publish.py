"""A relayout without a rendezvous: a member publishes its KV rows in its outbox, and
the peer that takes them adopts them at its own pace.

When a group's requests move to DP on one member (``flying.session.move``), each other
member writes its head group of the moved tokens into its *outbox* (``Outbox.publish``)
and goes straight back to its own DP work: it does not wait for the taker to read them,
so its DP requests keep stepping while the move runs. The taker copies its own head
group from its TP view meanwhile, then reads each peer's outbox as soon as the rows are
there (``Inbox.adopt``: it waits for the rows, not for the peer's step), writes them
into its DP slots and marks them taken.

An outbox is one file per engine process, ``/dev/shm/flying_mv_<pid>_<generation>``,
kept mapped (pages populated once) by its owner and by every taker that read it: a
fresh multi-MiB file costs its page allocation and faults on every move (a 1k-token
move on the hidden-1024 model took 8-13 ms that way, against ~0.4 ms to copy the rows),
a kept one only the copy. It grows (a new generation: the old file is unlinked) when a
move needs more room, up to ``MAX_BYTES``::

    [int64 x 16: magic, 1, size, 0 (``shm_segment``'s header), tokens, steps at
     publish, steps now, seq, taken seq, layers written, 0...]
    [a shard block [layers, 2, n, h, d]]

Protocol (one writer per word): the owner writes ``tokens``, the steps and ``layers
written`` = 0, then ``seq`` = the move's sequence number (agreed in the move's
all-gather), then the block layer by layer, raising ``layers written`` after each; the
taker waits for ``seq`` to equal it and writes each layer into its pool once it is
written (the two copies overlap layer by layer, as the segment's chunks did), then
writes ``taken`` = it. The outbox is free again once ``taken == seq``; until then the owner writes its own
step counter into ``steps`` at each of its boundaries (``Outbox.note``), so the taker
reads how many steps the sender ran while the move was in flight
(``Adoption.peer_steps``), the evidence that no engine waited for a peer. Stores are
ordered on the CPUs this runs on (x86-64's total store order, as the group's
shared-memory collectives assume).

Invariants: an outbox file exists while its owner lives (an ``atexit`` unlink at exit,
and a sweep of files whose creator pid is gone at each new generation on the host);
a block is read only while ``ready`` holds the sequence number the reader waits for.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from flying.substrate import kv_relayout, shm_segment

PREFIX = "flying_mv_"
HEADER_WORDS = 16
HEADER_BYTES = 8 * HEADER_WORDS
_TOKENS, _STEPS_AT, _STEPS, _SEQ, _TAKEN, _LAYERS = 4, 5, 6, 7, 8, 9
#: The largest outbox (bytes); a move needing more streams in step with its taker
#: instead (``flying.session.handoff.applies``).
MAX_BYTES = 256 * 2**20
#: The first outbox (bytes), made at start-up: 4k tokens of the hidden-1024 model
#: (a TP-2 shard of it is 4 KiB a token), its pages populated once. Small enough for a
#: container's default 64 MiB /dev/shm beside the group's segments.
FIRST_BYTES = 16 * 2**20
#: How long ``Inbox.adopt`` spins (sched_yield) for the rows before it starts to sleep.
SPIN_S = 0.002
MAX_SLEEP_S = 0.001


def path_for(pid: int, generation: int, shm_dir: Path | None = None) -> Path:
    """The outbox of process ``pid`` at ``generation``."""
    return (shm_dir or shm_segment.SHM_DIR) / f"{PREFIX}{pid}_{generation}"


def block_shape(pool, n: int) -> tuple[int, ...]:
    """``[layers, 2, n, heads, d]`` for ``n`` tokens of ``pool`` (a TP view or DP pool)."""
    return (len(pool.k_buffer), 2, n, *pool.k_buffer[0].shape[1:])


def block_bytes(pool, n: int) -> int:
    """Bytes of an outbox holding ``n`` tokens of ``pool``'s rows, header included."""
    k0 = pool.k_buffer[0]
    return HEADER_BYTES + int(np.prod(block_shape(pool, n))) * k0.element_size()


def _block(mm: mmap.mmap, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The block ``shape`` of ``dtype`` at the start of ``mm``'s data (a view)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.frombuffer(mm, dtype=torch.uint8, offset=HEADER_BYTES,
                           count=int(np.prod(shape)) * itemsize)
    return raw.view(dtype).view(shape)


class Outbox:
    """One engine process's outbox (the sender's side)."""

    def __init__(self, shm_dir: Path | None = None):
        self.shm_dir = shm_dir or shm_segment.SHM_DIR
        self.generation = -1
        self.seq = 0  # the last sequence number published
        self.mm: mmap.mmap | None = None
        self.header: np.ndarray | None = None
        self.path: Path | None = None
        self.deadline = 0.0

    @property
    def free(self) -> bool:
        return self.header is not None and self.header[_TAKEN] == self.header[_SEQ]

    def ready_for(self, nbytes: int) -> tuple[int, int]:
        """Before a move's all-gather: make room for ``nbytes`` (``block_bytes``) and
        return (generation, the sequence number the next publish will carry). A busy
        outbox (a block not taken yet) is replaced as a full one is."""
        if nbytes > MAX_BYTES:
            raise ValueError(f"a move of {nbytes} bytes exceeds the outbox limit {MAX_BYTES}")
        if self.mm is None or not self.free or nbytes > len(self.mm):
            self._grow(max(nbytes, FIRST_BYTES, 2 * len(self.mm) if self.mm is not None else 0))
        return self.generation, self.seq + 1

    def _grow(self, size: int) -> None:
        size = min(size, MAX_BYTES)
        self.close()
        shm_segment.sweep_stale(self.shm_dir, PREFIX)
        self.generation += 1
        self.path = path_for(os.getpid(), self.generation, self.shm_dir)
        self.mm = shm_segment.create(self.path, size, 1, populate=True)
        self.header = np.frombuffer(self.mm, dtype=np.int64, count=HEADER_WORDS)

    def publish(self, pool, slots: torch.Tensor, steps: int, keep_s: float) -> int:
        """Write every head ``pool`` holds of the tokens in ``slots`` (in order) as one
        block, then mark it ready under the next sequence number (returned); ``steps``:
        this engine's step counter now; ``keep_s``: how long it waits for its taker
        (the taker's own timeout) before the outbox counts as free again."""
        shape = block_shape(pool, slots.numel())
        assert self.mm is not None and self.free and block_bytes(pool, slots.numel()) <= len(self.mm)
        block = _block(self.mm, shape, pool.k_buffer[0].dtype)
        self.seq += 1
        h = self.header
        h[_TOKENS], h[_STEPS_AT], h[_STEPS], h[_LAYERS] = slots.numel(), steps, steps, 0
        h[_SEQ] = self.seq  # after the words above: a reader of this seq sees them
        rows = kv_relayout.rows_of(slots, pool.k_buffer[0].device)
        for layer, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer, strict=True)):
            kv_relayout.get_rows(k, rows, block[layer, 0])
            kv_relayout.get_rows(v, rows, block[layer, 1])
            h[_LAYERS] = layer + 1  # after its bytes: the taker may write it now
        del block
        self.deadline = time.monotonic() + keep_s
        return self.seq

    def note(self, steps: int) -> bool:
        """At a step boundary of the owner: record its step counter while its last block
        is in flight; False once it was taken, or once its taker can no longer be
        waiting (past the deadline: then the outbox counts as free)."""
        if self.header is None or self.free:
            return False
        if time.monotonic() > self.deadline:
            self.header[_TAKEN] = self.header[_SEQ]
            return False
        self.header[_STEPS] = steps
        return True

    def close(self) -> None:
        """Unlink and unmap (a taker's mapping keeps the memory until it lets go)."""
        if self.mm is None:
            return
        self.header = None
        shm_segment.unlink(self.path)
        shm_segment.release(self.mm)
        self.mm = None


class Adoption:
    """A peer's published block as the taker reads it (``Inbox.adopt``), written by its
    owner layer by layer while the taker reads the layers already there."""

    def __init__(self, header: np.ndarray, block: torch.Tensor, seq: int, wait):
        self.header, self.block, self.seq = header, block, seq
        self._wait = wait  # wait(cond, what): until cond() or the peer's failure
        self.peer_steps = 0  # steps the sender ran between publishing and ``take``

    def layer(self, layer: int) -> torch.Tensor:
        """Layer ``layer`` of the block (``[2, n, h, d]``) once its owner wrote it."""
        header = self.header
        self._wait(lambda: header[_LAYERS] > layer, f"layer {layer}")
        return self.block[layer]

    def whole(self) -> torch.Tensor:
        """The whole block once written (``[layers, 2, n, h, d]``)."""
        self.layer(self.block.shape[0] - 1)
        return self.block

    def write_into(self, pool, slots: torch.Tensor, heads: slice) -> None:
        """Heads ``heads`` of rows ``slots`` of the DP ``pool`` = the block's tokens,
        each layer as soon as it is written."""
        rows = kv_relayout.rows_of(slots, pool.k_buffer[0].device)
        for layer, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer, strict=True)):
            kv = self.layer(layer)
            kv_relayout.put_rows(k[:, heads], rows, kv[0])
            kv_relayout.put_rows(v[:, heads], rows, kv[1])

    def take(self) -> None:
        """The block is read: note the sender's steps and hand its outbox back."""
        if self.header is None:
            return
        self.peer_steps = int(self.header[_STEPS] - self.header[_STEPS_AT])
        self.header[_TAKEN] = self.seq
        self.header = self.block = None


class Inbox:
    """The peers' outboxes one engine has read, kept mapped (the taker's side)."""

    def __init__(self, shm_dir: Path | None = None):
        self.shm_dir = shm_dir or shm_segment.SHM_DIR
        self.maps: dict[int, tuple[int, mmap.mmap]] = {}  # pid -> (generation, mapping)

    def _mapping(self, pid: int, generation: int) -> mmap.mmap | None:
        held = self.maps.get(pid)
        if held is not None and held[0] == generation:
            return held[1]
        try:
            mm = shm_segment.attach(path_for(pid, generation, self.shm_dir), None, 1, populate=True)
        except FileNotFoundError:
            return None
        if held is not None:
            shm_segment.release(held[1])  # an older generation: its owner has moved on
        self.maps[pid] = (generation, mm)
        return mm

    def adopt(self, pool, n: int, pid: int, generation: int, seq: int, timeout_s: float,
              failed: Callable[[], str | None] = lambda: None) -> Adoption:
        """Process ``pid``'s block ``seq`` in its outbox ``generation``: ``n`` tokens of a
        shard of ``pool``'s shape and dtype. Waits for it; raises RuntimeError if
        ``failed()`` gives a reason first (the peer's fault: the group's poison word,
        or its process gone) or after ``timeout_s``."""
        found: list = [None, None]  # the mapping and its header, once the outbox is there

        def announced() -> bool:
            mm = self._mapping(pid, generation)
            if mm is None:
                return False
            found[:] = mm, np.frombuffer(mm, dtype=np.int64, count=HEADER_WORDS)
            return found[1][_SEQ] == seq

        def wait(cond, what: str) -> None:
            _wait(cond, failed, timeout_s, f"{what} of move {seq} from pid {pid}")

        wait(announced, "the KV rows")
        mm, header = found
        if int(header[_TOKENS]) != n or block_bytes(pool, n) > len(mm):
            raise RuntimeError(f"flying: move {seq} from pid {pid} holds {int(header[_TOKENS])} "
                               f"tokens, expected {n}")
        return Adoption(header, _block(mm, block_shape(pool, n), pool.k_buffer[0].dtype), seq, wait)

    def close(self) -> None:
        for _, mm in self.maps.values():
            shm_segment.release(mm)
        self.maps.clear()


def _wait(cond: Callable[[], bool], failed: Callable[[], str | None], timeout_s: float,
          what: str) -> None:
    """Until ``cond()``: spins (sched_yield) for ``SPIN_S``, then sleeps, doubling up to
    ``MAX_SLEEP_S``; raises RuntimeError with ``failed()``'s reason, or after
    ``timeout_s``."""
    start, sleep = time.perf_counter(), 5e-5
    while not cond():
        why = failed()
        waited = time.perf_counter() - start
        if why is None and waited > timeout_s:
            why = f"timed out after {waited:.2f} s"
        if why is not None:
            raise RuntimeError(f"flying: {what} never came: {why}")
        if waited < SPIN_S:
            os.sched_yield()
        else:
            time.sleep(sleep)
            sleep = min(2 * sleep, MAX_SLEEP_S)
