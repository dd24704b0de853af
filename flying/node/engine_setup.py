"""Wiring an SGLang scheduler to Flying at start-up: pool, prepared degrees, status."""

from __future__ import annotations

import logging

from flying.node.config import get_config
from flying.session import layout_log, status
from flying.session.engine import FlyingEngine, set_engine
from flying.substrate.comm_pool import CommPool, store_address

logger = logging.getLogger(__name__)


def attach(scheduler) -> None:
    """Create this engine's Flying state; build its communicator pool if TP is enabled."""
    from sglang.srt.runtime_context import get_parallel

    cfg = get_config()
    layout_log.configure(cfg.decision_log)
    degrees = cfg.degree_list() or []
    address = store_address()
    if not degrees or address is None or get_parallel().tp_size != 1:
        return
    dp_rank = get_parallel().dp_rank or 0
    num_engines = get_parallel().dp_size
    prefix = address.replace(":", "_")
    pool = CommPool.create(address, dp_rank, num_engines, degrees, prefix=prefix)
    dp_limit = min(int(scheduler.max_req_len), int(scheduler.model_config.context_len))
    # A request without a bound of its own may outgrow this engine into a group only
    # where the engine's KV pool, not the model's context, is what bounds it.
    upgrades = (
        cfg.policy != "manual" and cfg.move_to_dp != "off"
        and dp_limit < int(scheduler.model_config.context_len) - 1
    )
    engine = FlyingEngine(
        dp_rank, pool, cfg.bind_timeout_s, cfg.preempt, dp_limit=dp_limit,
        move_to_dp=cfg.move_to_dp, upgrades=upgrades, hold_steps=cfg.hold_steps,
    )
    engine.prepare(scheduler)  # every degree's views, KV view and backend, now
    if not any(p.per_slot > 1 for p in engine.prepared.values()):
        # One KV head replicated on every rank: no group pools more than this engine's
        # KV (a DP slot holds one token of it: ``layout.KvSplit``), nothing to grow into.
        engine.watch.enabled = False
    set_engine(engine)
    status.publish(pool.store, dp_rank, engine, scheduler)
