"""Layout changes in the decision log: every engine appends its own lines.

With ``--flying-decision-log PATH`` the DP controller truncates the file at start-up and
writes the head line, its placement decisions and its upgrade decisions
(``flying.node.costs_reader.DecisionLog``); the engines, separate processes, append to
the same file one line per layout change they take part in, with ``kind``:

- "move" (TP -> DP, ``flying.session.move``): the values the members shared (each
  request's KV tokens, each member's DP room and load), the assignment, and this
  member's share (requests, tokens, bytes received, ms). Every member writes a move it
  made; a refused move (a request fit nowhere) is written by the leader only, as it
  recurs every ``RETRY_STEPS`` group steps while it stays refused;
- "join" (DP -> TP, ``flying.session.join``): the leader's candidates (lengths, KV
  budgets, and on the leader each request's inputs to its budget), this member's DP room
  and how many it reserved, how many joined; with ms, tokens and bytes if they did;
- "upgrade_join" (an upgrade's relayout, ``flying.session.upgrade``): the members'
  shared rows, the request's new total, this member's room and reservation, whether it
  joined; with ms, tokens and bytes if it did.

``python -m scheduler.replay`` re-runs the pure decisions (``scheduler.relayout``) on
these inputs. Invariants: nothing happens unless a log is configured (``enabled``), and
only when a layout changes (never per step); nothing here raises (a failed write is
logged and dropped); each line is one ``os.write`` on a file opened with ``O_APPEND``,
so lines of several processes never interleave (a regular file's append is atomic).
"""

from __future__ import annotations

import json
import logging
import os
import time

logger = logging.getLogger(__name__)


class Appender:
    """One JSON document per line, appended with one ``write`` each; never raises."""

    def __init__(self, path: str, truncate: bool = False):
        self.path = path
        self._fd: int | None = None
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        try:
            self._fd = os.open(path, flags, 0o644)
        except OSError:
            logger.exception("flying: cannot open the decision log %s", path)

    @property
    def open(self) -> bool:
        return self._fd is not None

    def line(self, text: str) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, (text + "\n").encode())
        except OSError:
            logger.exception("flying: decision log write failed")


_APPENDER: Appender | None = None
#: This process's decision log path ("" = none); set once by the node layer at engine
#: start-up (``configure``), so this module never reads the node's config itself.
_PATH = ""


def configure(path: str) -> None:
    """Set where this process appends its layout changes ("" turns logging off)."""
    global _PATH, _APPENDER
    _PATH = path or ""
    _APPENDER = None


def enabled() -> bool:
    """Whether this process writes layout changes (a decision log is configured)."""
    return bool(_PATH)


def write(kind: str, doc: dict) -> None:
    """Append one layout change (``kind`` and ``doc``, with the time). No-op without a
    log; never raises."""
    global _APPENDER
    if not enabled():
        return
    try:
        if _APPENDER is None:
            _APPENDER = Appender(_PATH)
        _APPENDER.line(json.dumps({"kind": kind, "t": time.time(), **doc}))
    except Exception:  # noqa: BLE001 - logging must never take a session down
        logger.exception("flying: could not log a %s", kind)


def about(bind, rank: int) -> dict:
    """The fields every layout change line carries: its bind, the group and the writer
    (``rank``: this engine's DP rank; its TP rank is its index in ``ranks``)."""
    return {"bind": bind.bind_id, "degree": bind.degree, "ranks": list(bind.ranks),
            "rank": int(rank)}


def kv_bytes(tensor) -> int:
    """Bytes of a KV block (0 for None)."""
    return 0 if tensor is None else int(tensor.numel()) * int(tensor.element_size())
