"""Client aborts and disconnects of requests that run in a group session.

SGLang's DP controller sends every ``AbortReq`` to every engine, so each member of a
group receives it, but at different times: applied on arrival, members would drop the
request at different steps and leave lockstep. So the leader decides: it matches the
aborts it has received against the session's requests and announces the matched
requests (48-bit keys of their rids) in the per-step exchange; at the next step boundary
every member aborts exactly those, through SGLang's own ``abort_request``. A member
never applies an abort for a session request on its own.

Aborts also stay noted for a while (``RECENT``), so that a bind whose request was
aborted before the bind ran is voted down instead of run.
"""

from __future__ import annotations

import hashlib
from collections import deque

#: Aborts remembered for binds not yet run (by rid prefix, SGLang's matching rule).
RECENT = 1024


def rid_key(rid: str) -> int:
    """A 48-bit key of ``rid``: what the per-step exchange carries."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=6).digest(), "big")


class AbortBook:
    """Aborts received by one engine: ``note`` them, the leader announces ``due`` ones."""

    def __init__(self) -> None:
        self.recent: deque[tuple[str, bool]] = deque(maxlen=RECENT)  # (rid prefix, all)
        self.announced: set[int] = set()  # keys announced in the current session

    def note(self, abort_req) -> None:
        self.recent.append((abort_req.rid or "", bool(getattr(abort_req, "abort_all", False))))

    def hits(self, rid: str) -> bool:
        return any(abort_all or (prefix and rid.startswith(prefix))
                   for prefix, abort_all in self.recent)

    def due(self, reqs, limit: int) -> list[int]:
        """Keys of session requests hit by a noted abort and not announced yet."""
        out = []
        for req in reqs:
            key = rid_key(req.rid)
            if key not in self.announced and not req.finished() and self.hits(req.rid):
                out.append(key)
                self.announced.add(key)
                if len(out) == limit:
                    break
        return out

    def end_session(self) -> None:
        self.announced.clear()


def apply(scheduler, reqs, keys: list[int]) -> int:
    """Abort the session requests whose key was announced; returns how many."""
    from sglang.srt.managers.io_struct import AbortReq

    wanted = set(keys)
    hit = [r for r in reqs if rid_key(r.rid) in wanted and not r.finished()]
    for req in hit:
        scheduler.abort_request(AbortReq(rid=req.rid))
    return len(hit)
