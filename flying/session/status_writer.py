"""Writing an engine's status document off its event loop.

A status write is a TCPStore round trip to the launcher, which on a saturated node
waits for that process to be scheduled: done on the engine's loop every
``STATUS_EVERY_S`` it took a fifth of a busy engine's time (``workloads.bench_hooks``
at 16 clients). The writer thread holds only the latest document: a newer one replaces
one not yet written (a status is a snapshot; only the last one matters), and documents
reach the store in the order they were submitted.

Invariants: the thread uses a TCPStore client of its own (the engine's client carries
binds and rendezvous and is not safe to share between threads); the engine thread
never waits on the store except in ``flush``, which event publishes (bind, release,
drain) use so that a reader after the event sees it; a failed write is logged and the
next document is tried, never raised into the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: How long a failed store connection waits before the writer tries again.
RETRY_S = 1.0


class StatusWriter:
    """One engine's status document, written by a daemon thread.

    ``connect`` builds the thread's own store client (called on the thread, lazily,
    again after a failure); ``key`` is the document's store key."""

    def __init__(self, connect: Callable[[], object], key: str):
        self._connect = connect
        self.key = key
        self._cv = threading.Condition()
        self._latest: tuple[int, str] | None = None  # (seq, document) not yet written
        self._submitted = 0
        self._written = 0  # every seq <= this one was written or replaced by a newer one
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"flying-status-{key}", daemon=True)
        self._thread.start()

    def submit(self, document: str) -> int:
        """Queue ``document`` (replacing any not yet written); returns its sequence number."""
        with self._cv:
            self._submitted += 1
            self._latest = (self._submitted, document)
            self._cv.notify_all()
            return self._submitted

    def flush(self, seq: int, timeout_s: float) -> bool:
        """Wait until document ``seq`` (or a newer one) is in the store; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._written < seq:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._cv.wait(left)
            return True

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _run(self) -> None:
        store = None
        while True:
            with self._cv:
                while self._latest is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                seq, document = self._latest
                self._latest = None
            try:
                if store is None:
                    store = self._connect()
                store.set(self.key, document)
            except Exception:  # noqa: BLE001 - a stale status; the engine serves on
                logger.exception("flying: could not write %s", self.key)
                store = None
                with self._cv:  # retry with the latest document, unless a newer one came
                    if self._latest is None:
                        self._latest = (seq, document)
                time.sleep(RETRY_S)
                continue
            with self._cv:
                self._written = seq
                self._cv.notify_all()
