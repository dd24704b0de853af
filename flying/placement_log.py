"""Where the controller placed a request, for ``meta_info["flying"]``.

Requests marked in the HTTP process (explicit degree, priority, long context) carry their
degree in the routing key. The adaptive policy decides in the DP controller, from the
engines' loads, after the HTTP process has let the request go; the controller records
such a decision in the launcher's TCPStore (``record``) before it sends the binds, and the
HTTP process reads it once per request, at the request's first output (``degree_for``).
Only adaptive TP placements are recorded, so other requests cost no store access unless
the adaptive policy is on.
"""

from __future__ import annotations

_PREFIX = "flying/placed/"
_SEEN: dict[str, int] = {}  # HTTP process: rid -> degree, until the request finishes


def record(store, rid: str, degree: int) -> None:
    store.set(_PREFIX + rid, str(degree))


def degree_for(store, rid: str, finished: bool) -> int:
    """The recorded TP degree of ``rid`` (0 if it ran in DP mode). Reads the store at the
    request's first output only; forgets the request when it finishes."""
    degree = _SEEN.get(rid)
    if degree is None:
        key = _PREFIX + rid
        degree = 0
        if store.check([key]):
            degree = int(store.get(key))
            store.delete_key(key)
        _SEEN[rid] = degree
    if finished:
        _SEEN.pop(rid, None)
    return degree
