"""Per-engine status documents, read by /flying/status, the metrics and the DP controller.

Engines write a small JSON document at start-up, at every bind and release, on falling
idle and every ``STATUS_EVERY_S`` while busy, into their slot of the node's status
board (``flying.substrate.status_board``: shared memory, no socket, no thread); a
process outside a launcher (a unit test's engine) writes it under ``flying/status/<rank>``
in the store instead, and a reader takes the store's copy of a slot never written.
Inside a session the KV and row counts are the session's (its reserved pool), so idle
checks read them in DP mode. A read never waits on a busy engine.
"""

from __future__ import annotations

import json
import logging

from flying.substrate import status_board

logger = logging.getLogger(__name__)

#: Switch (bind -> first group step) latency histogram bounds, in milliseconds.
SWITCH_BUCKETS_MS = (1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0)


#: Group session length (bind -> release) histogram bounds, in seconds.
SESSION_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def bucket_index(value: float, bounds: tuple[float, ...] = SWITCH_BUCKETS_MS) -> int:
    """Index of the first bucket whose bound holds ``value`` (len(bounds) = +Inf)."""
    return next((i for i, b in enumerate(bounds) if value <= b), len(bounds))


def publish(store, dp_rank: int, engine, scheduler=None) -> None:
    """Write the engine's status now: to the board, or without one to ``store``. Seen by
    every reader when this returns (an event's status is published before the engine
    goes on)."""
    doc = document(dp_rank, engine, scheduler)
    board = status_board.attached()
    if board is None:
        store.set(key(dp_rank), doc)
        return
    try:
        board.write(dp_rank, doc)
    except ValueError:  # a document past its slot: stale, never fatal
        logger.exception("flying: engine %d status not published", dp_rank)


def key(dp_rank: int) -> str:
    return f"flying/status/{dp_rank}"


#: Set by the start-up probe when it is done (calibrated, or groups closed without it):
#: the engines' steps from then on are the node's serving.
CALIBRATED_KEY = "flying/calibrated"


def calibration_over(store) -> bool:
    """Whether the start-up probe is done (``CALIBRATED_KEY``); False if the store
    cannot tell now. An engine asks at each status refresh until it is."""
    if store is None:
        return False
    try:
        return bool(store.check([CALIBRATED_KEY]))
    except RuntimeError:  # the store unreachable for now: asked again next time
        return False


def document(dp_rank: int, engine, scheduler=None) -> str:
    """The engine's status as JSON, read on the engine's thread (its state is not
    safe to read from another)."""
    decode_ms, curves = engine.clock.measured()
    doc = {
        "rank": dp_rank,
        "mode": str(engine.mode),
        "degree": engine.mode.degree,
        **(_kv_slots(scheduler) if scheduler is not None else {}),
        "degrees": sorted(engine.pool.members) if engine.pool else [],
        "pending_binds": len(engine.pending),
        "draining": engine.draining,
        # SGLang's default loop (``event_loop_overlap``) or its normal one
        # (``--disable-overlap-schedule``): sessions run under both (``overlap``)
        "overlap_loop": bool(getattr(scheduler, "enable_overlap", False)),
        "decode_ms": decode_ms,  # measured single-request decode step, per degree
        "curves": curves,  # measured decode / prefill points, per degree
        "stretch": engine.clock.stretch(),  # how much slower each mode's steps run now
        "stretch_last": engine.clock.stretch_last(),  # and when it last ran
        "live_ms": engine.clock.live_ms(),  # its recent single-request decode steps, per degree
        "live_low_ms": engine.clock.live_low_ms(),  # the lowest live_ms has been
        # a shallow copy: serialized at once, on the thread that changes the counters
        # (``asdict`` deep-copies every field: 4 % of a busy engine's samples at 16
        # clients, ``workloads.bench_hooks``)
        **vars(engine.counters),
    }
    return json.dumps(doc)


def _kv_slots(scheduler) -> dict:
    """Free KV slots (free + evictable cached prefixes) and the pool size."""
    free = scheduler.token_to_kv_pool_allocator.available_size()
    free += scheduler.tree_cache.evictable_size()
    rows = scheduler.req_to_token_pool
    return {
        "free_kv_slots": int(free),
        "total_kv_slots": int(scheduler.max_total_num_tokens),
        "free_req_rows": int(rows.available_size()),
        "total_req_rows": int(rows.size),
    }


def read_all(store, num_engines: int) -> dict:
    engines = []
    board = status_board.attached()
    for r in range(num_engines):
        doc = board.read(r) if board is not None and r < board.slots else None
        if doc is not None:
            engines.append(json.loads(doc))
            continue
        try:
            if store.check([key(r)]):
                engines.append(json.loads(store.get(key(r))))
                continue
        except RuntimeError:
            pass
        engines.append({"rank": r, "mode": "unknown"})
    groups = sorted({e["mode"] for e in engines if str(e.get("mode", "")).startswith("tp")})
    totals = {
        k: sum(e.get(k, 0) for e in engines)
        for k in (
            "binds", "standby_binds", "releases", "aborted_binds", "faulted_sessions", "client_aborts",
            "rerun_in_dp", "resumed_in_dp", "preempted_dp_requests", "tp_requests", "tp_steps",
            "overlapped_tp_steps", "held_admissions",
            "dp_steps_in_session", "moved_to_dp", "handed_back", "moved_tokens", "moved_peer_steps", "moved_to_tp",
            "dp_held_for_kv",
            "upgraded", "regrouped",
        )
    }
    return {"engines": engines, "bound_modes": groups, "totals": totals}
