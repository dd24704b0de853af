"""The bounded bind handshake: the members of a bind agree on go or abort.

Each member, at its step boundary, *announces* its vote ("" = can serve, else why not),
may prepare its side of the session while the others arrive, and then *concludes*:
the leader (TP rank 0) waits up to ``timeout_s`` for every member and decides; a
non-leader that hears nothing within ``2 * timeout_s`` decides abort itself. Exactly one
decision is made and every member reads it. Afterwards each member *settles* (off the
bind's critical path: at the session's end); the store keys a bind left are deleted.

Two channels:
- the group's shared segment (``Member.shm``, members on one host): arrivals and the
  decision are words there, and the decision is made under the group's lock
  (``ShmAllReduce.locked``, an ``flock``), so whoever decides first wins and the other
  reads that decision. A bind that goes costs no store round trip at all (before: about
  ten, 30-300 us each on a loaded 2-core machine). The store only carries reasons: a
  "no" vote's and an abort's;
- without a segment, the launcher's TCPStore alone: arrivals are keys, the decision is
  its atomic ``compare_set`` on one key.

Shared words (int64; x86-64 keeps stores in program order, so the token, written last,
publishes the words before it; the lock's syscalls are full barriers):
- rank line ``r``, word 3: the token of the bind rank ``r`` arrived at; word 4: its vote
  (``_YES`` / ``_NO``);
- header word 5: the token of the last decision; 6: ``_GO`` or ``_ABORT_BY + r`` (rank
  ``r`` decided abort; its reason is the store key ``why/r``); 7: the sequence base.
A token is a 62-bit hash of the bind id; a stale token (an earlier bind) never matches.

Invariant: a member enters the session's collectives only after reading a go that was
made once, under the lock (or by ``compare_set``), so the members of a bind always agree,
even when one times out while another arrives.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import time
from dataclasses import dataclass

import torch.distributed as dist

_OK = "ok"
_ARRIVE_TOKEN, _ARRIVE_VOTE = 3, 4  # rank-line words
_DECISION_TOKEN, _DECISION, _DECISION_SEQ = 5, 6, 7  # header words
_YES, _NO = 1, 2
_GO, _ABORT_BY = 1, 2

#: Waiting for a shared word: spin this long, then yield the core (``sched_yield``: a
#: runnable process on this core, such as the controller's I/O thread still delivering
#: the leader's bind, runs first; otherwise the wait goes on at once, so a peer that
#: arrives within ``_YIELD_S`` is seen within microseconds, where a sleep of the
#: backoff saw it up to ~200 us late), then sleep from the first to the longest sleep,
#: doubling; past ``_PATIENT_S`` of waiting (a peer finishing a long step) up to
#: ``_LONG_SLEEP_S``, so the wait takes almost no core from the peer it waits for.
_SPIN_S, _YIELD_S, _FIRST_SLEEP_S, _MAX_SLEEP_S = 50e-6, 1e-3, 20e-6, 200e-6
_PATIENT_S, _LONG_SLEEP_S = 5e-3, 1e-3


@dataclass(frozen=True)
class Verdict:
    """The members' common decision on one bind (stored as ``go:<seq>`` / ``abort:<why>``)."""

    go: bool
    reason: str = ""
    seq: int = 0  # go only: the shared-memory sequence base of the session's epoch

    def encode(self) -> str:
        return f"go:{self.seq}" if self.go else f"abort:{self.reason}"

    @classmethod
    def decode(cls, text: str) -> Verdict:
        kind, _, rest = text.partition(":")
        if kind == "go":
            return cls(True, "", int(rest or 0))
        return cls(False, rest or "no decision")


@dataclass
class Ticket:
    """One member's announced arrival at one bind, and what it concluded."""

    bind_id: str
    degree: int
    member: object  # comm_pool.Member
    token: int
    verdict: Verdict | None = None
    wrote_why: bool = False  # this member stored an abort reason (``why_key``)

    @property
    def base(self) -> str:
        return f"flying/bind/{self.bind_id}"

    def arrive_key(self, rank: int) -> str:
        return f"{self.base}/arrive/{rank}"

    def why_key(self, rank: int) -> str:
        return f"{self.base}/why/{rank}"

    @property
    def decision_key(self) -> str:
        return f"{self.base}/decision"


def token(bind_id: str) -> int:
    """A bind's token in the shared words: non-zero, the same in every process."""
    digest = hashlib.blake2b(bind_id.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & ((1 << 62) - 1)) | 1


def announce(store, member, bind_id: str, vote: str) -> Ticket:
    """Publish this member's arrival and vote (returns at once)."""
    ticket = Ticket(bind_id, member.group.degree, member, token(bind_id))
    shm = member.shm
    if shm is None or vote:  # the store carries every vote without a segment, and reasons
        store.set(ticket.arrive_key(member.tp_rank), vote or _OK)
    if shm is not None:
        line = shm.control_words()[1][member.tp_rank]
        line[_ARRIVE_VOTE] = _NO if vote else _YES
        line[_ARRIVE_TOKEN] = ticket.token  # last: publishes the vote
    return ticket


def conclude(store, ticket: Ticket, timeout_s: float) -> Verdict:
    """Wait for the decision (the leader: make it) and return it; on go every member's
    shared segment starts the session's epoch at the same sequence base."""
    member = ticket.member
    if member.tp_rank == 0:
        verdict = _decide(store, ticket, _leader_wants(store, ticket, timeout_s))
    else:
        verdict = _heard(store, ticket, 2 * timeout_s)
        if verdict is None:
            verdict = _decide(store, ticket, Verdict(False, "leader did not decide in time"))
        if verdict.go and member.shm is not None:
            member.shm.resync(verdict.seq, clear_poison=False)
    ticket.verdict = verdict
    return verdict


def settle(store, ticket: Ticket) -> None:
    """This member is done with the bind's store keys (after its session or abort, never
    on the critical path). A bind that went on the shared segment left none but a
    reason this member stored in vain; otherwise the last member to settle deletes all."""
    rank = ticket.member.tp_rank
    if ticket.member.shm is not None and ticket.verdict is not None and ticket.verdict.go:
        if ticket.wrote_why:
            store.delete_key(ticket.why_key(rank))
        return
    base = ticket.base
    if store.add(f"{base}/read", 1) == ticket.degree:
        for r in range(ticket.degree):
            store.delete_key(ticket.arrive_key(r))
            store.delete_key(ticket.why_key(r))
        store.delete_key(ticket.decision_key)
        store.delete_key(f"{base}/read")


def _decide(store, ticket: Ticket, want: Verdict) -> Verdict:
    """Make ``want`` the bind's decision unless one was made; return the decision."""
    member, rank = ticket.member, ticket.member.tp_rank
    if member.shm is None:
        return Verdict.decode(store.compare_set(ticket.decision_key, "", want.encode()).decode())
    if not want.go:  # stored before it can be read: readers look it up by the decider
        store.set(ticket.why_key(rank), want.reason)
        ticket.wrote_why = True
    header = member.shm.control_words()[0]
    with member.shm.locked():  # every writer holds it: the words cannot change in here
        if int(header[_DECISION_TOKEN]) != ticket.token:
            header[_DECISION] = _GO if want.go else _ABORT_BY + rank
            header[_DECISION_SEQ] = want.seq
            header[_DECISION_TOKEN] = ticket.token  # last: publishes the decision
        code, seq = int(header[_DECISION]), int(header[_DECISION_SEQ])
    return _verdict(store, ticket, code, seq)


def _shared_decision(store, ticket: Ticket) -> Verdict | None:
    """The decision in the shared words, or None if there is none for this bind yet."""
    header = ticket.member.shm.control_words()[0]
    if int(header[_DECISION_TOKEN]) != ticket.token:
        return None
    code, seq = int(header[_DECISION]), int(header[_DECISION_SEQ])
    if int(header[_DECISION_TOKEN]) != ticket.token:  # overwritten meanwhile: a later bind
        return None
    return _verdict(store, ticket, code, seq)


def _verdict(store, ticket: Ticket, code: int, seq: int) -> Verdict:
    """The verdict that the shared words ``code`` and ``seq`` stand for."""
    if code == _GO:
        return Verdict(True, "", seq)
    return Verdict(False, store.get(ticket.why_key(code - _ABORT_BY)).decode())  # the reason


def _leader_wants(store, ticket: Ticket, timeout_s: float) -> Verdict:
    """The leader's decision from the members' votes (not yet agreed)."""
    member = ticket.member
    try:
        votes = _votes(store, ticket, timeout_s)
    except (RuntimeError, dist.DistStoreError, TimeoutError):
        return Verdict(False, f"a member did not arrive within {timeout_s:g} s")
    bad = [v for v in votes if v != _OK]
    if bad:
        return Verdict(False, bad[0])
    # every member is at its step boundary: no collective is in flight
    if member.shm is None:
        return Verdict(True, "", 0)
    seq = member.shm.published_max() + 2
    member.shm.resync(seq, clear_poison=True)
    return Verdict(True, "", seq)


def _votes(store, ticket: Ticket, timeout_s: float) -> list[str]:
    """Every member's vote, in TP-rank order; raises TimeoutError if one is missing."""
    shm = ticket.member.shm
    keys = [ticket.arrive_key(r) for r in range(ticket.degree)]
    if shm is None:
        store.wait(keys, _dt.timedelta(seconds=timeout_s))
        return [store.get(k).decode() for k in keys]
    lines = shm.control_words()[1]
    if not _wait_until(lambda: bool((lines[:, _ARRIVE_TOKEN] == ticket.token).all()), timeout_s):
        raise TimeoutError
    return [_OK if int(lines[r, _ARRIVE_VOTE]) == _YES else store.get(keys[r]).decode()
            for r in range(ticket.degree)]


def _heard(store, ticket: Ticket, timeout_s: float) -> Verdict | None:
    """The leader's decision, or None if none came within ``timeout_s``."""
    if ticket.member.shm is None:
        try:
            store.wait([ticket.decision_key], _dt.timedelta(seconds=timeout_s))
            return Verdict.decode(store.get(ticket.decision_key).decode())
        except (RuntimeError, dist.DistStoreError):
            return None
    found: list[Verdict] = []

    def ready() -> bool:
        verdict = _shared_decision(store, ticket)
        if verdict is not None:
            found.append(verdict)
        return verdict is not None

    return found[0] if _wait_until(ready, timeout_s) else None


def _wait_until(ready, timeout_s: float) -> bool:
    """Poll ``ready()``: spin briefly, yield for up to ``_YIELD_S``, then sleep with
    backoff; False after ``timeout_s``."""
    if ready():
        return True
    start = time.perf_counter()
    while time.perf_counter() - start < _SPIN_S:
        if ready():
            return True
    while time.perf_counter() - start < min(_YIELD_S, timeout_s):
        os.sched_yield()
        if ready():
            return True
    sleep = _FIRST_SLEEP_S
    while (waited := time.perf_counter() - start) < timeout_s:
        time.sleep(sleep)
        if ready():
            return True
        sleep = min(2 * sleep, _MAX_SLEEP_S if waited < _PATIENT_S else _LONG_SLEEP_S)
    return False
