"""Where the controller placed a request, for ``meta_info["flying"]``.

Requests marked in the HTTP process (explicit degree, priority, long context) carry their
degree in the routing key. One decision is the DP controller's alone, made after the
HTTP process has let the request go: a priority request kept in DP (a group does not pay
by the measured step costs, or its members hold more DP work than
``--flying-priority-max-paused``). The controller records that decision in the launcher's TCPStore (``record``) before it dispatches, and the HTTP
process reads it once per request, at the request's first output (``lookup``), which
deletes the key. Other requests cost no store access.

Every key is deleted when its request ends, also without any output (HTTP 4xx, client
gone before the first token, an abort): the HTTP process drops what it has not read
when the request's handler ends (``forget``), and the controller deletes what it
recorded for a request it sees aborted (``Recorded.aborted``), which also covers a
request whose handler ended before the controller recorded it.

Only the controller's "kept in DP" decisions for priority requests go through the
store now: where a request ran in a group (or in DP after a group failed or did not
form) travels with its output (``flying.session.report``), and a priority request's
"kept in DP" reason is decided in the controller, which never reaches an engine's
Flying code.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

logger = logging.getLogger(__name__)

_PREFIX = "flying/placed/"
#: HTTP process: rid -> (degree, reason) read from the store, until the request ends.
_SEEN: dict[str, tuple[int, str]] = {}
#: HTTP process: rids the controller may have recorded that were not read yet.
_PENDING: set[str] = set()

def _key(rid: str) -> str:
    return _PREFIX + rid


# -- controller ----------------------------------------------------------------------


def record(store, rid: str, degree: int, reason: str = "") -> None:
    store.set(_key(rid), f"{int(degree)}|{reason}")


class Recorded:
    """The controller's memory of the keys it wrote, to delete them on an abort.

    Bounded: the oldest entries are forgotten (not deleted: their requests normally
    had their key read and deleted by the HTTP process long before)."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self._rids: OrderedDict[str, None] = OrderedDict()

    def add(self, rid: str) -> None:
        self._rids[rid] = None
        while len(self._rids) > self.limit:
            self._rids.popitem(last=False)

    def __len__(self) -> int:
        return len(self._rids)

    def aborted(self, store, rid: str, abort_all: bool = False) -> int:
        """Delete the keys of the requests an ``AbortReq`` names (SGLang aborts every
        request whose rid starts with ``rid``); the number deleted."""
        if abort_all:
            hits = list(self._rids)
        elif rid:
            hits = [r for r in self._rids if r.startswith(rid)]
        else:
            hits = []
        deleted = 0
        for r in hits:
            self._rids.pop(r, None)
            deleted += bool(store.delete_key(_key(r)))
        return deleted


# -- HTTP process --------------------------------------------------------------------


def expect(rid: str) -> None:
    """The controller may record ``rid``: remember to read or drop its key."""
    _PENDING.add(rid)


def lookup(store, rid: str, finished: bool) -> tuple[int, str] | None:
    """The controller's recorded (degree, reason) for ``rid`` (None: it recorded
    nothing). Reads the store at the request's first output only, deleting the key;
    forgets the request when it finishes."""
    found = _SEEN.get(rid)
    if found is None:
        _PENDING.discard(rid)
        key = _key(rid)
        found = (-1, "")
        if store.check([key]):
            found = _parse(store.get(key))
            store.delete_key(key)
        _SEEN[rid] = found
    if finished:
        _SEEN.pop(rid, None)
    return None if found[0] < 0 else found


def forget(store, rid: str) -> None:
    """The request ``rid`` ended (its handler returned, failed or was closed): drop what
    was kept for it, and delete its key if the controller may have written one that was
    never read."""
    _SEEN.pop(rid, None)
    if rid in _PENDING:
        _PENDING.discard(rid)
        if store is not None:
            store.delete_key(_key(rid))


def _parse(raw) -> tuple[int, str]:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    degree, _, reason = text.partition("|")
    try:
        return int(degree), reason
    except ValueError:
        logger.warning("flying: unreadable placement record %r", text)
        return 0, ""
