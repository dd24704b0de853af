"""A shared-memory board of the engines' status documents: one slot per engine.

An engine refreshes its status every ``STATUS_EVERY_S`` while busy and at every event.
Through the launcher's TCPStore that was a socket round trip, on the engine's loop
(0.14-0.62 % of a busy engine's samples) or on a writer thread (whose wake-up and GIL
hand-over cost the loop about 0.4 %: ``workloads.bench_hooks``). A slot on this board
is written by the engine's loop thread with two memory copies and a checksum: no
system call, no thread switch, and a reader sees the document as soon as the write
returns (an event's status needs no flush).

Layout (one file in /dev/shm, mapped by every process of the node)::

    [shm_segment header: int64 magic, slots, size, 0]  then, per engine rank r,
    at HEADER_BYTES + r * SLOT_BYTES:
    [uint64 seq, uint64 length, uint64 crc32, uint64 0][length bytes of UTF-8 JSON]

Invariants: one writer per slot (the engine of that rank, on its loop thread); ``seq``
is odd while a write is in progress and even otherwise, 0 when nothing was written. A
reader keeps a copy only if ``seq`` was even and unchanged around it and the checksum
matches the bytes, so a torn read is retried, whatever the CPU's memory ordering.

The file lives in /dev/shm only until every process that uses it has mapped it: each
engine writes its slot at start-up, the DP controller marks the header's reader word
when it starts, and then the creator (the launcher, SGLang's HTTP process) unlinks it
(``unlink_when_mapped``); the mappings live on until the processes exit. Until then an
``atexit`` unlink in the creator and the next node's ``create`` (files whose creator pid
is gone) cover a launcher that is stopped or killed early.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import zlib
from pathlib import Path

import numpy as np

from flying.substrate import shm_segment

logger = logging.getLogger(__name__)

#: Environment variable naming the board's file, set by the launcher before SGLang
#: starts any process (each one inherits it).
ENV = "FLYING_STATUS_BOARD"
PREFIX = "flying_status_"
HEADER_BYTES = 64
SLOT_HEADER_WORDS = 4  # seq, length, crc32, 0
#: The shm_segment header's free int64 word: 1 once the DP controller has mapped the board.
READER_WORD = 3
#: Room per engine; a status document is a few KiB (its cost curves are bounded).
SLOT_BYTES = 256 * 1024
#: Bytes of a slot a document may take (the rest is its header).
ROOM = SLOT_BYTES - 8 * SLOT_HEADER_WORDS
#: Tries of a read that meets a write in progress (a write takes microseconds).
READ_TRIES = 200

_ATTACHED: StatusBoard | None = None
_ATTACHED_PATH: str | None = None
_FAILED: set[str] = set()  # paths that could not be mapped (logged once)


class StatusBoard:
    """The mapped board; ``write`` from an engine's loop, ``read`` from anywhere."""

    def __init__(self, mm, slots: int):
        self.mm = mm
        self.slots = slots
        self._header = np.frombuffer(mm, dtype=np.int64, count=shm_segment.HEADER_WORDS)
        self._words = [
            np.frombuffer(mm, dtype=np.uint64, count=SLOT_HEADER_WORDS,
                          offset=HEADER_BYTES + r * SLOT_BYTES)
            for r in range(slots)
        ]

    def _data(self, rank: int) -> int:
        return HEADER_BYTES + rank * SLOT_BYTES + 8 * SLOT_HEADER_WORDS

    def write(self, rank: int, document: str) -> None:
        """Replace slot ``rank``'s document; ValueError if it does not fit."""
        data = document.encode()
        if len(data) > ROOM:
            raise ValueError(f"status document of {len(data)} bytes > slot room {ROOM}")
        words = self._words[rank]
        seq = int(words[0])
        words[0] = seq + 1  # odd: a write in progress
        start = self._data(rank)
        self.mm[start:start + len(data)] = data
        words[1] = len(data)
        words[2] = zlib.crc32(data)
        words[0] = seq + 2

    def mark_reader(self) -> None:
        """Say that the DP controller has mapped the board (its one reader outside the
        launcher)."""
        self._header[READER_WORD] = 1

    def mapped_by_all(self) -> bool:
        """Every engine has written its slot and the DP controller has mapped the board."""
        return int(self._header[READER_WORD]) == 1 and all(int(w[0]) > 0 for w in self._words)

    def read(self, rank: int) -> str | None:
        """Slot ``rank``'s document, or None if none was written yet (or every try met
        a write in progress)."""
        words = self._words[rank]
        start = self._data(rank)
        for _ in range(READ_TRIES):
            seq = int(words[0])
            if seq == 0:
                return None
            if seq % 2 == 0:
                length, crc = int(words[1]), int(words[2])
                if length <= ROOM:  # a torn length never reads past the slot
                    data = bytes(self.mm[start:start + length])
                    if int(words[0]) == seq and zlib.crc32(data) == crc:
                        return data.decode()
            time.sleep(0)
        return None


def size_of(slots: int) -> int:
    return HEADER_BYTES + slots * SLOT_BYTES


def create(slots: int, shm_dir: Path | None = None) -> StatusBoard:
    """Create the node's board (the launcher, before SGLang starts its processes), name
    it in ``ENV`` for every process started after, and attach this process to it."""
    global _ATTACHED, _ATTACHED_PATH
    shm_dir = shm_dir or shm_segment.SHM_DIR
    shm_segment.sweep_stale(shm_dir, PREFIX)
    path = shm_dir / f"{PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
    mm = shm_segment.create(path, size_of(slots), slots)  # unlinked at this process's exit
    _ATTACHED, _ATTACHED_PATH = StatusBoard(mm, slots), str(path)
    os.environ[ENV] = str(path)
    return _ATTACHED


def attached() -> StatusBoard | None:
    """This process's board: the one ``ENV`` names, mapped on first use; None when the
    process runs outside a launcher (or the file is gone: readers fall back to the
    store)."""
    global _ATTACHED, _ATTACHED_PATH
    path = os.environ.get(ENV)
    if not path:
        return None
    if _ATTACHED is not None and _ATTACHED_PATH == path:
        return _ATTACHED
    if path in _FAILED:
        return None
    try:
        size = os.stat(path).st_size
        slots = (size - HEADER_BYTES) // SLOT_BYTES
        mm = shm_segment.attach(Path(path), size, slots)
    except (OSError, ValueError):
        logger.exception("flying: could not map the status board %s", path)
        _FAILED.add(path)
        return None
    _ATTACHED, _ATTACHED_PATH = StatusBoard(mm, slots), path
    return _ATTACHED


def unlink_when_mapped(poll_s: float = 0.2) -> threading.Thread | None:
    """In the creator: remove the board's file once every process has mapped it (a
    daemon thread; at the latest the ``atexit`` unlink at the creator's exit)."""
    board, path = _ATTACHED, _ATTACHED_PATH
    if board is None or path is None:
        return None

    def wait() -> None:
        while not board.mapped_by_all():
            time.sleep(poll_s)
        shm_segment.unlink(Path(path))

    thread = threading.Thread(target=wait, name="flying-status-board", daemon=True)
    thread.start()
    return thread
