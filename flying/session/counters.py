"""An engine's Flying counters: published in its status, summed in /flying/status and
exported as Prometheus series."""

from __future__ import annotations

from dataclasses import dataclass, field

from flying.session.status import SESSION_BUCKETS_S, SWITCH_BUCKETS_MS


@dataclass
class EngineCounters:
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
    moved_tokens: int = 0
    moved_bytes: int = 0
    move_ms_sum: float = 0.0
    move_ms_max: float = 0.0
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
