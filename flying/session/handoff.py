"""The usual move without a rendezvous: the senders publish and leave, the taker adopts.

In the usual move every request of a session goes to one member, the taker
(``flying.session.move``). Instead of streaming the senders' rows through the group's
segment in lockstep with the taker (each sender then waits, its DP requests paused, for
the taker to consume every chunk), each sender writes its head group of the moved
tokens into its outbox (``kv_publish.Outbox``), disowns the requests and returns to
its own DP work at once. The taker copies its own head group from its TP view
meanwhile, then adopts each sender's rows (``kv_publish.Inbox``), waiting only for them
to be there.

Used where every member holds a distinct head group (no replicated heads), the group's
relayout streams over shared memory (``kv_stream.streams``) and the rows fit an outbox:
the same answer on every member, so all take this path or none. Each member's outbox
generation and next sequence number ride on the move's all-gather (``Mail.address``).

Who answers the moved requests if something fails after the members agreed: a sender
that has published disowns them (``GroupSession.answerer`` False), so the taker owns
them from the moment the leader's rows are published: it resumes them in DP if its own
part fails (``resolve``). A sender that fails before publishing poisons the group; the
taker, waiting for its file, sees the poison and both fall back to the leader rule
(only the leader answers a failed session's requests).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from flying.session import tp_scope
from flying.substrate import kv_publish, kv_relayout, kv_stream
from flying.substrate.kv_publish import Adoption

logger = logging.getLogger(__name__)

#: How often a waiting taker checks that a sender's process is alive.
LIVENESS_S = 0.5


@dataclass
class Mail:
    """An engine's outbox and the peers' outboxes it has read (one per process)."""

    outbox: kv_publish.Outbox = field(default_factory=kv_publish.Outbox)
    inbox: kv_publish.Inbox = field(default_factory=kv_publish.Inbox)
    sending: bool = False  # a block of this engine's is in flight (``note`` it)

    def open(self, members: dict, prepared: dict) -> None:
        """At start-up: the first outbox, where some degree's moves take this path
        (its pages populated here, not on the first move)."""
        if any(applies(members[d], p.split, p.tp_pool, 0) for d, p in prepared.items()):
            self._ready(0)

    def _ready(self, nbytes: int) -> list[int]:
        try:
            return list(self.outbox.ready_for(nbytes))
        except OSError as exc:  # /dev/shm full: this move streams in step instead
            logger.warning("flying: no outbox of %d bytes (%s): a move streams in step", nbytes, exc)
            return [-1, 0]

    def note(self, steps: int) -> None:
        """At each step boundary while a block is in flight: the step counter."""
        self.sending = self.outbox.note(steps)

    def address(self, member, split, tp_pool, n: int) -> list[int]:
        """This member's [outbox generation, next sequence number] for a move of ``n``
        tokens, room made; [-1, 0] where the move cannot take this path (``applies``:
        the same on every member) or no outbox could be made here. The move publishes
        only if no member answered -1."""
        if not applies(member, split, tp_pool, n):
            return [-1, 0]
        return self._ready(kv_publish.block_bytes(tp_pool, n))


def applies(member, split, tp_pool, n: int) -> bool:
    """Whether a move of ``n`` tokens over this group (heads held as ``split``) takes
    the published path."""
    return (split.replicas == 1 and kv_stream.streams(member, tp_pool)
            and kv_publish.block_bytes(tp_pool, n) <= kv_publish.MAX_BYTES)


def send(mail: Mail, scope, tp_slots: torch.Tensor, steps: int, timeout_s: float) -> None:
    """A sender: publish this member's head group of the moved tokens; ``steps`` is the
    engine's step counter (SGLang's ``forward_ct``); ``timeout_s`` the taker's wait."""
    mail.outbox.publish(scope.prepared.tp_pool, tp_slots, steps, 2 * timeout_s)
    mail.sending = True


class Taking:
    """The taker's side of one move: the senders' blocks, adopted in TP-rank order."""

    def __init__(self, mail: Mail, member, addresses: list[tuple[int, int, int]],
                 timeout_s: float):
        """``addresses``: per TP rank, (pid, outbox generation, sequence number)."""
        self.mail, self.member, self.addresses, self.timeout_s = mail, member, addresses, timeout_s
        me = member.tp_rank
        #: TP ranks still to adopt from, in order (the leader first when it sends)
        self.waiting = [r for r in range(member.group.degree) if r != me]
        self.peer_steps = 0  # the most steps a sender ran while its rows were in flight
        self.leader_published = me == 0  # the taker leads: it answers in any case

    def _failed(self, rank: int):
        shm, next_check = self.member.shm, [time.perf_counter() + LIVENESS_S]

        def failed() -> str | None:
            if shm.poisoned():
                return "a member poisoned the group after a fault"
            now = time.perf_counter()
            if now >= next_check[0]:
                next_check[0] = now + LIVENESS_S
                if not shm.peer_alive(rank):
                    return f"TP rank {rank}'s process exited"
            return None

        return failed

    def next(self, tp_pool, n: int) -> tuple[int, Adoption]:
        """The next sender's published block (waits for it); the caller writes it and
        calls ``taken``."""
        rank = self.waiting[0]
        pid, generation, seq = self.addresses[rank]
        adoption = self.mail.inbox.adopt(tp_pool, n, pid, generation, seq, self.timeout_s,
                                         self._failed(rank))
        return rank, adoption

    def taken(self, rank: int, adoption: Adoption) -> None:
        adoption.take()
        self.waiting.remove(rank)
        self.peer_steps = max(self.peer_steps, adoption.peer_steps)
        self.leader_published = self.leader_published or rank == 0

    def gather(self, scheduler, scope, tp_slots: torch.Tensor, delay_s: float = 0.0):
        """Every head of the moved tokens: ``(slots, None)``, written into fresh DP slots
        (this member's own heads straight from its TP view, each sender's from its
        outbox) when the engine has that room beside the session's rows; else
        ``(None, shards)``, one block per TP rank, written once those rows are back
        (``move._land``). ``delay_s``: a test-only pause before the first adoption
        (``faults.adopt_delay_s``)."""
        split, tp_pool = scope.prepared.split, scope.prepared.tp_pool
        n, h, me = tp_slots.numel(), split.heads_per_rank, self.member.tp_rank
        if tp_scope.dp_room(scheduler) < n:
            shards: list = [None] * split.degree
            shards[me] = kv_relayout.read_block(tp_pool, tp_slots).clone()
            time.sleep(delay_s)
            while self.waiting:
                rank, adoption = self.next(tp_pool, n)
                shards[rank] = adoption.whole().clone()
                self.taken(rank, adoption)
            return None, shards
        slots = tp_scope.take_dp_slots(scheduler, n)  # disjoint from the rows tp_slots are in
        try:
            kv_stream.copy_rows(tp_pool, tp_slots, scope.dp_pool, slots, slice(me * h, (me + 1) * h))
            time.sleep(delay_s)
            while self.waiting:
                rank, adoption = self.next(tp_pool, n)
                try:
                    adoption.write_into(scope.dp_pool, slots, slice(rank * h, (rank + 1) * h))
                finally:
                    self.taken(rank, adoption)
        except BaseException:  # no request points at them yet
            scheduler.token_to_kv_pool_allocator.free(slots)
            raise
        return slots, None

    def resolve(self, tp_pool, n: int) -> bool:
        """After this taker's own part failed: wait for the senders' outcome, hand their
        outboxes back, and say whether this member now answers the requests (the
        leader's rows were published, so the leader disowned them). A sender's poison
        (its own fault before publishing) ends the wait: the leader rule applies."""
        while self.waiting:
            try:
                rank, adoption = self.next(tp_pool, n)
                adoption.whole()  # published in full: the sender has let them go
            except Exception:  # noqa: BLE001 - poisoned, gone, or not the block expected
                break
            self.taken(rank, adoption)
        return self.leader_published
