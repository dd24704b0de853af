"""An engine's Flying counters: published in its status, summed in /flying/status and
exported as Prometheus series."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from flying.session.status import SESSION_BUCKETS_S, SWITCH_BUCKETS_MS, bucket_index


@dataclass
class EngineCounters:
    """The counters (the instance's fields only: ``vars`` of it is what an engine
    publishes) and how a session's events add to them (``moved``, ``joined``,
    ``released``: called by ``flying.session.lifecycle``)."""

    binds: int = 0
    releases: int = 0
    aborted_binds: int = 0
    #: binds that took a reservation and scope made ready before an idle sleep
    #: (``flying.session.standby``)
    standby_binds: int = 0
    faulted_sessions: int = 0
    client_aborts: int = 0
    rerun_in_dp: int = 0
    #: requests of a failed session that had sent output and went on in DP from their
    #: tokens so far (``containment.abandon``)
    resumed_in_dp: int = 0
    preempted_dp_requests: int = 0
    tp_requests: int = 0
    tp_steps: int = 0
    #: TP steps whose result SGLang's overlap loop processed after launching the next
    #: TP step (``flying.session.overlap``: a group's steps overlapped as DP steps are)
    overlapped_tp_steps: int = 0
    #: arrivals a group's leader held while its running requests finished
    #: (``scheduler.hold``: their prefill would have paused them near their end)
    held_admissions: int = 0
    #: DP steps an engine ran between the TP steps of its sessions
    dp_steps_in_session: int = 0
    #: the most TP steps a member ran in a row while it had DP work waiting (the
    #: longest a DP request waits for a group, in group steps; 1 by construction
    #: unless its DP step was held for KV, below)
    max_dp_wait_steps: int = 0
    #: DP steps held because the DP batch's next decode needed KV slots a session had
    #: reserved (SGLang would otherwise retract or abort a DP request for the group)
    dp_held_for_kv: int = 0
    #: switch latency (bind taken at a step boundary -> group ready) histogram, counts
    #: per ``metrics.SWITCH_BUCKETS_MS`` bucket (+Inf last), and the sum in ms
    switch_hist: list[int] = field(default_factory=lambda: [0] * (len(SWITCH_BUCKETS_MS) + 1))
    switch_ms_sum: float = 0.0
    #: group session length (bind -> release) histogram per ``SESSION_BUCKETS_S``
    session_hist: list[int] = field(default_factory=lambda: [0] * (len(SESSION_BUCKETS_S) + 1))
    session_s_sum: float = 0.0
    last_switch_ms: dict[str, float] = field(default_factory=dict)
    last_fault: str = ""
    #: requests a group handed to DP with their KV (counted where each landed), their
    #: tokens of context, the KV bytes received from peers, and the move's time
    #: prompt tokens prefilled (a group's prefill counted once, on its leader): a
    #: request moved between layouts must not add its prompt again
    prefill_tokens: int = 0
    moved_to_dp: int = 0
    #: waiting requests (nothing produced, no KV) a group handed to DP to start there
    #: when it was to end (``flying.session.hand_back``), counted where each started
    handed_back: int = 0
    moved_tokens: int = 0
    moved_bytes: int = 0
    move_ms_sum: float = 0.0
    move_ms_max: float = 0.0
    #: steps the senders of this engine's moves ran while their rows were in flight
    #: (``flying.session.handoff``: none of them waited for this engine)
    moved_peer_steps: int = 0
    #: running DP requests that joined a forming group with their KV (on the leader)
    moved_to_tp: int = 0
    moved_tokens_to_tp: int = 0
    #: of those, requests without a bound of their own that outgrew their engine
    #: (long-context upgrade, counted on the engine they left), and this engine's asks
    upgraded: int = 0
    upgrade_asks: int = 0
    #: of the upgraded, requests that left a group for a larger one (``regroup``)
    regrouped: int = 0
    join_ms_sum: float = 0.0

    def moved(self, moved) -> None:
        """A session's requests moved to DP, this member's share (``move.Moved``)."""
        self.move_ms_sum += moved.ms
        self.move_ms_max = max(self.move_ms_max, moved.ms)
        self.moved_bytes += moved.bytes_in
        self.moved_to_dp += moved.requests
        self.moved_tokens += moved.tokens
        self.moved_peer_steps += moved.peer_steps

    def joined(self, joining, ms: float) -> None:
        """Running requests joined a forming session (``join.Joining``), each counted by
        the member it came from."""
        self.join_ms_sum += ms
        own, own_lens = joining.originals()
        if own:
            self.moved_to_tp += len(own)
            self.moved_tokens_to_tp += sum(own_lens)
            self.upgraded += len(own) if joining.upgrade else 0
            self.regrouped += len(own) if joining.parked else 0

    def released(self, s, t_end: float) -> None:
        """A session (``group.GroupSession``) released at ``t_end`` (perf_counter): its
        requests, the parts of its switch (bind -> group ready) and its length."""
        self.releases += 1
        self.tp_requests += len(s.scope.tokenized)
        t0, t_rdv = s.t_bind, s.t_rendezvous
        t_scope = s.t_ready or t_rdv
        self.last_switch_ms = {
            "control_ms": max(0.0, (time.time() - s.bind.issued_at) * 1e3 - (t_end - t0) * 1e3),
            "rendezvous_ms": (t_rdv - t0) * 1e3,
            "scope_setup_ms": (t_scope - t_rdv) * 1e3,
            # the parts: vote, open the scope, handshake | agree on joiners, enter
            "vote_ms": (s.t_vote - t0) * 1e3,
            "open_ms": (s.t_open - s.t_vote) * 1e3,
            "handshake_ms": (t_rdv - s.t_open) * 1e3,
            "join_ms": (s.t_join - t_rdv) * 1e3 if s.t_join else 0.0,
            "enter_ms": (t_scope - s.t_join) * 1e3 if s.t_join and s.t_ready else 0.0,
            "session_ms": (t_end - t_scope) * 1e3,
        }
        switch_ms = (t_scope - t0) * 1e3
        self.switch_hist[bucket_index(switch_ms)] += 1
        self.switch_ms_sum += switch_ms
        self.session_hist[bucket_index(t_end - t0, SESSION_BUCKETS_S)] += 1
        self.session_s_sum += t_end - t0
