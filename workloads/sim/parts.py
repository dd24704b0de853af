"""The simulated node's parts: a bind, an engine, a group session (``workloads.sim.node``
moves them; these hold the state and the KV arithmetic).

KV counts are in one engine's DP slots: a session reserves ``ceil(tokens / per_slot)``
slots on every member (``per_slot``: the degree, or the model's KV heads where they are
replicated), keeps the rows it ever reserved until it is released, and never takes
slots a member does not have free (``Engine.free``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workloads.sim.batching import Batcher, SimRequest
from workloads.sim.profile import Profile


@dataclass(eq=False)
class Bind:
    id: str
    degree: int
    ranks: tuple[int, ...]
    req: SimRequest | None
    reason: str  # "explicit" | "long" | "priority" | "policy"
    upgrade: SimRequest | None = None  # a running DP request that outgrew its engine
    holder: int = -1
    first_wait: float | None = None
    formed: bool = False
    slo_tpot_ms: float = 0.0  # the node's TPOT SLO when bound (``Bind.slo_tpot_ms``)


class Engine:
    def __init__(self, rank: int, profile: Profile):
        self.rank = rank
        self.kv_total = profile.kv_tokens
        self.dp = Batcher(1, profile.costs, profile.chunk_tokens, profile.max_running)
        self.dp_used = 0  # KV tokens of its DP requests
        self.reserved = 0  # KV slots sessions reserved here
        self.session: Session | None = None
        self.pending: deque[Bind] = deque()
        #: "free" (at a boundary, nothing to run), "dp" (a DP step), "group" (a group
        #: step), "wait" (in a session, waiting for its peers), "rdv" (waiting in a
        #: bind's rendezvous), "move" (a relayout in progress)
        self.state = "free"
        self.dp_turn = False
        #: DP requests arrived here during its session (``GroupSession.dp_arrived``)
        self.dp_arrived = False

    def free(self) -> int:
        return self.kv_total - self.dp_used - self.reserved


@dataclass(eq=False)
class Session:
    bind: Bind
    members: list[Engine]
    server: Batcher
    per_slot: int  # tokens one DP slot holds in the group (degree, or KV heads)
    started: float
    reasons: set[str] = field(default_factory=set)
    reserved: int = 0  # slots held on every member (rows ever reserved: kept till release)
    used: int = 0  # of which requests hold now
    admitting: bool = True
    tp_steps: int = 0
    retry_at: int = 0
    #: a member's DP arrivals as the last group step's exchange shared them
    arrived: bool = False
    extra_ms: float = 0.0  # switch and join costs paid by the next group step
    held_steps: int = 0  # boundaries the head arrival has been held (``scheduler.hold``)

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.bind.ranks

    def slots(self, tokens: int) -> int:
        return -(-tokens // self.per_slot)

    def grow(self, need: int) -> bool:
        """Reserve room for ``need`` more slots on every member (what the session's own
        rows do not hold yet); False, reserving nothing, if a member lacks it."""
        more = max(0, self.used + need - self.reserved)
        if any(m.free() < more for m in self.members):
            return False
        for m in self.members:
            m.reserved += more
        self.reserved += more
        self.used += need
        return True
