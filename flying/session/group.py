"""A group session on one member: an explicit state machine driven by SGLang's steps.

States (``State``)::

    BINDING --go--> RUNNING <--> YIELDED     (TP step / DP step, one at a time)
       |               |            |
       +--abort--------+--done------+--> RELEASED
                       +--fault-----+--> RELEASED (contained)

- BINDING: the bind was taken at a step boundary; the members vote and rendezvous.
- RUNNING: the engine is in the session's TP state (``Scope.entered``) for one SGLang
  step: the boundary hook formed a TP batch, SGLang runs and processes it.
- YIELDED: the engine is back in its DP state between TP steps (SGLang's next input
  poll leaves the TP state); if the member has DP work, its next step is a DP step,
  so a DP request never waits more than one TP step while a group runs, and the
  group's requests wait one DP step at most: nothing waits for a session to end.
- RELEASED: every member saw the same "done" in the per-step exchange (or the session
  failed and was contained); reservations are back with the engine.

The session never runs SGLang's loop itself: SGLang's own event loop calls
``get_next_batch_to_run`` / ``run_batch`` / ``process_batch_result`` and the engine's
hooks decide which state each step runs in (``flying.session.engine``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from flying.session import exchange
from flying.session.messages import Bind
from flying.session.tp_scope import Scope


class State(enum.Enum):
    BINDING = "binding"
    RUNNING = "running"
    YIELDED = "yielded"
    RELEASED = "released"


@dataclass(frozen=True)
class Mode:
    """An engine's mode: DP (degree 1) or a member of a TP group of ``degree``."""

    degree: int = 1

    @property
    def is_dp(self) -> bool:
        return self.degree == 1

    def __str__(self) -> str:
        return "dp" if self.degree == 1 else f"tp{self.degree}"


DP = Mode(1)


@dataclass
class GroupSession:
    """One bound session on one member (see the module docstring for the states)."""

    bind: Bind
    member: object
    scope: Scope
    is_leader: bool
    state: State = State.BINDING
    #: the last exchange's result: offers and aborts to apply at the next TP boundary
    shared: exchange.Shared = field(default_factory=lambda: exchange.Shared([], [], 0))
    joined: int = 0  # requests admitted after the first
    tp_steps: int = 0
    dp_steps: int = 0  # DP steps run between this session's TP steps
    #: TP steps run while this member had DP work waiting, since its last DP step
    dp_wait_steps: int = 0
    idle_steps: int = 0
    move_retry_at: int = 0  # the TP step from which a refused move may be tried again
    #: who answers the session's requests if it fails: None, the leader (the rule);
    #: set by a move that handed them over (``flying.session.handoff``)
    answerer: bool | None = None
    dp_work: bool = False  # this member has DP work (seen at the last boundary)
    #: DP requests arrived at this member during the session (waiting, or prefilled in
    #: a DP step between group steps) and it still has DP work: what moves a session's
    #: requests to DP. Running DP requests it had before (preempted ones, or requests
    #: an earlier session moved here) are served between group steps, not a reason to
    #: move: each new session would otherwise hand its requests to DP at once.
    dp_arrived: bool = False
    dp_turn: bool = False  # the next boundary runs a DP step if there is DP work
    #: boundaries the leader has held the arrival at its queue's head while the running
    #: requests finish (``scheduler.hold``); 0 once it is offered
    held_steps: int = 0
    #: rid -> TPOT SLO (ms) of the requests bound into this session, from their binds
    #: (``Bind.slo_tpot_ms``; the leader's, for its hold)
    slo_tpot: dict = field(default_factory=dict)
    #: this member's DP decode needs KV slots the session holds: its DP step is held
    #: and the session yields (moves its requests or, closed to new ones, drains)
    dp_held: bool = False
    #: rids of requests upgraded into this session without a bound of their own: near
    #: the group's bound they may ask for a larger group (``flying.session.regroup``)
    growable: set = field(default_factory=set)
    batch: object = None  # the TP batch of the current step (until the next input boundary)
    failure: BaseException | None = None  # raised in a TP step; contained at next input
    #: this member's arrival at the bind's handshake (settled when the session ends)
    ticket: object = None
    #: perf_counter stamps: bind taken, vote cast, scope opened, handshake done,
    #: joining requests agreed, first TP step ready
    t_bind: float = 0.0
    t_vote: float = 0.0
    t_open: float = 0.0
    t_rendezvous: float = 0.0
    t_join: float = 0.0
    t_ready: float = 0.0

    @property
    def mode(self) -> Mode:
        return Mode(self.bind.degree)

    def to(self, state: State) -> None:
        allowed = _TRANSITIONS[self.state]
        if state not in allowed:
            raise RuntimeError(f"flying: session {self.bind.bind_id}: {self.state} -> {state}")
        self.state = state


_TRANSITIONS = {
    State.BINDING: {State.RUNNING, State.RELEASED},
    State.RUNNING: {State.YIELDED, State.RELEASED},
    State.YIELDED: {State.RUNNING, State.RELEASED},
    State.RELEASED: set(),
}
