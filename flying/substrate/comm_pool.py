"""Communicator Pool: the process groups of every allowed TP group, created at startup.

Why not SGLang's WORLD (the design brief's first plan): each engine keeps SGLang's own
one-engine world untouched (tp_size=1, so every SGLang collective stays a no-op), and
Flying builds its groups beside it from a TCPStore that the launcher hosts. This avoids
replacing ``_init_parallel_groups``, keeps the stock seed broadcast, memory baseline and
rank-0 behaviours local to each engine, and means no WORLD-wide collective exists that a
busy engine could hang. The price: Flying's TP layers reduce explicitly (see
``weight_views``) instead of relying on SGLang's stage boundaries.

Invariants:
- Every engine creates the groups that contain it, for every degree in ascending order,
  at startup; group creation is a rendezvous among the group's members only.
- After startup, a collective on a group is entered only by a bound group's members,
  after the bind handshake (``bind_handshake``: announce, conclude) agreed on "go" for
  that bind (bounded by a timeout).
- A bind's decision is made exactly once (under the group's lock on its shared segment,
  or by the store's atomic ``compare_set`` without one), so the members of a bind always
  agree, even when one times out while another arrives.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import resource
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from flying.substrate import bind_handshake
from flying.substrate.bind_handshake import Ticket, Verdict
from flying.substrate.layout import Group, group_containing
from flying.substrate.shm_allreduce import ShmAllReduce

logger = logging.getLogger(__name__)

STORE_ENV = "FLYING_STORE"  # "host:port" of the launcher's TCPStore
COLLECTIVE_TIMEOUT = _dt.timedelta(seconds=120)


def host_store() -> tuple[object, str]:
    """Create the master TCPStore (in the launcher) and return (store, "host:port")."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, f"127.0.0.1:{store.port}"


def connect_store(address: str, timeout_s: float = 60.0):
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(
        host, int(port), is_master=False, timeout=_dt.timedelta(seconds=timeout_s)
    )


@dataclass
class Member:
    """One engine's handle on one group: its process group and its rank inside it.

    ``shm`` is the group's shared-memory all-reduce (CPU members on one host; None
    elsewhere): the per-layer reductions of a TP step and the per-step control
    exchange go through it, gloo (``pg``) carries the rest.
    """

    group: Group
    tp_rank: int
    pg: dist.ProcessGroup
    shm: ShmAllReduce | None = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over the group. Result is bit-identical on every member."""
        if self.shm is not None and t.is_cpu and self.shm.can_reduce(t):
            return self.shm.all_reduce_(t)
        self.pg.allreduce([t]).wait()
        return t

    def broadcast(self, t: torch.Tensor, src_tp_rank: int = 0) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = src_tp_rank
        self.pg.broadcast([t], opts).wait()
        return t

    def share_ints(self, values: list[int], n: int, own: int = 0) -> tuple[list[int], int]:
        """The leader's ``values`` (n non-negative ints < 2**63) on every member, and the
        sum over members of ``own`` (a non-negative int < 2**48 each member contributes).

        Members other than the leader pass anything of length n; it is ignored. Over
        shared memory this is one sum in float32 of 16-bit chunks (exact: every chunk is
        < 2**16 and all but the leader's are zero); otherwise gloo (two collectives).
        """
        mine = values if self.tp_rank == 0 else [0] * n
        if self.shm is None:
            shared = self.broadcast(torch.tensor(mine, dtype=torch.int64)).tolist()
            return shared, int(self.all_reduce(torch.tensor([own], dtype=torch.int64))[0])
        # ``own`` too goes in 16-bit chunks: float32 is exact only below 2**24, and an
        # own of several packed counts is larger (a whole own once lost its low bits).
        chunks = [(v >> s) & 0xFFFF for v in [*mine, own] for s in (0, 16, 32, 48)]
        out = self.shm.all_reduce_(torch.tensor(chunks, dtype=torch.float32))
        out = out.long().tolist()
        ints = [sum(c << s for c, s in zip(out[i : i + 4], (0, 16, 32, 48), strict=True))
                for i in range(0, 4 * (n + 1), 4)]
        return ints[:n], ints[n]

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every member's ``values`` (same length on all), in TP-rank order."""
        t = torch.tensor(values, dtype=torch.int64)
        if self.shm is not None:
            return self.shm.all_gather(t.unsqueeze(0), dim=0).tolist()
        outs = [torch.empty_like(t) for _ in range(self.group.degree)]
        self.pg.allgather([outs], [t]).wait()
        return [o.tolist() for o in outs]

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the group (admission steps only)."""
        t = torch.tensor([value], dtype=torch.int64)
        if self.shm is not None:
            return int(self.shm.all_gather(t).min())
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return int(t[0])

    def share_tokens_(self, ids: torch.Tensor) -> torch.Tensor:
        """Overwrite ``ids`` ([bs] sampled token ids) with the leader's, in place.

        A group decides each step's tokens once: without this every member samples
        with its own generator (whose state DP traffic has advanced differently), and
        members would write different tokens into their KV shards. SGLang's own TP
        does the same with an all-reduce MIN (``Sampler._sync_token_ids_across_tp``).
        """
        if ids.numel() == 0:
            return ids
        if self.shm is not None and ids.is_cpu:
            flat = ids.reshape(-1)
            gathered = self.shm.all_gather(flat.to(torch.int64))
            flat.copy_(gathered[: flat.numel()])
            return ids
        return self.broadcast(ids)

    # -- faults ---------------------------------------------------------------------

    def poison(self) -> None:
        """After a fault: wake every peer waiting in a group collective with an error."""
        if self.shm is not None:
            self.shm.poison()


@dataclass
class CommPool:
    """All groups this engine belongs to, keyed by degree (O(1) lookup)."""

    dp_rank: int
    num_engines: int
    store: object
    members: dict[int, Member] = field(default_factory=dict)
    setup_s: float = 0.0
    rss_delta_kb: int = 0

    @classmethod
    def create(
        cls, address: str, dp_rank: int, num_engines: int, degrees: list[int], prefix: str
    ) -> CommPool:
        t0 = time.perf_counter()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        store = connect_store(address)
        pool = cls(dp_rank=dp_rank, num_engines=num_engines, store=store)
        for m in sorted(degrees):
            group = group_containing(m, dp_rank)
            sub = dist.PrefixStore(f"{prefix}/{group.name}", store)
            pg = dist.ProcessGroupGloo(sub, group.tp_rank(dp_rank), m, COLLECTIVE_TIMEOUT)
            member = Member(group, group.tp_rank(dp_rank), pg)
            member.all_reduce(torch.ones(1))  # prewarm: connections are made here
            member.shm = ShmAllReduce.create(pg, member.tp_rank, m, label=group.name)
            pool.members[m] = member
        pool.setup_s = time.perf_counter() - t0
        pool.rss_delta_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
        logger.info(
            "flying: engine %d communicator pool ready: degrees %s, %.1f ms, +%d KiB RSS",
            dp_rank,
            sorted(degrees),
            pool.setup_s * 1e3,
            pool.rss_delta_kb,
        )
        return pool

    def member(self, degree: int) -> Member:
        try:
            return self.members[degree]
        except KeyError:
            raise ValueError(
                f"TP degree {degree} is not in this node's pool {sorted(self.members)}"
            ) from None

    # -- bounded bind handshake (``bind_handshake``) -------------------------------

    def announce(self, bind_id: str, degree: int, vote: str) -> Ticket:
        """Publish this engine's arrival at ``bind_id`` with its vote ("" = can serve)."""
        return bind_handshake.announce(self.store, self.member(degree), bind_id, vote)

    def conclude(self, ticket: Ticket, timeout_s: float) -> Verdict:
        """The members' common go / abort for the announced bind."""
        return bind_handshake.conclude(self.store, ticket, timeout_s)

    def settle(self, ticket: Ticket) -> None:
        """Done with the bind's keys (after its session or abort, off the critical path).
        Never raises: a key left behind costs a few bytes, an exception here an engine."""
        try:
            bind_handshake.settle(self.store, ticket)
        except Exception:  # noqa: BLE001
            logger.exception("flying: engine %d: settling bind %s failed", self.dp_rank, ticket.bind_id)

    def rendezvous(self, bind_id: str, degree: int, vote: str, timeout_s: float) -> Verdict:
        """Announce, conclude and settle in one call (nothing prepared meanwhile)."""
        ticket = self.announce(bind_id, degree, vote)
        try:
            return self.conclude(ticket, timeout_s)
        finally:
            self.settle(ticket)


_POOL: CommPool | None = None


def set_pool(pool: CommPool) -> None:
    global _POOL
    if _POOL is not None:
        raise RuntimeError("communicator pool already set in this process")
    _POOL = pool


def get_pool() -> CommPool | None:
    return _POOL


_HOSTED: object | None = None


def set_hosted_store(store) -> None:
    """Record the TCPStore this process hosts (the launcher, which is also SGLang's HTTP
    process); set once. Kept here, not in ``flying.node.launch``: run as ``python -m``, the
    launcher is ``__main__`` and ``import flying.node.launch`` would see a second copy."""
    global _HOSTED
    if _HOSTED is not None:
        raise RuntimeError("hosted store already set in this process")
    _HOSTED = store


def hosted_store():
    """The TCPStore this process hosts, or None (engines, controller, tests)."""
    return _HOSTED


def store_address() -> str | None:
    return os.environ.get(STORE_ENV)
