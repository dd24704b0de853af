"""Wiring an SGLang scheduler to Flying: pool creation at startup, status publishing."""

from __future__ import annotations

import logging

from flying.node.config import get_config
from flying.session import status
from flying.session.engine import FlyingEngine, set_engine
from flying.substrate.comm_pool import CommPool, store_address

logger = logging.getLogger(__name__)


def attach(scheduler) -> None:
    """Create this engine's Flying state; build its communicator pool if TP is enabled."""
    from sglang.srt.runtime_context import get_parallel

    cfg = get_config()
    degrees = cfg.degree_list() or []
    address = store_address()
    if not degrees or address is None or get_parallel().tp_size != 1:
        return
    dp_rank = get_parallel().dp_rank or 0
    num_engines = get_parallel().dp_size
    prefix = address.replace(":", "_")
    pool = CommPool.create(address, dp_rank, num_engines, degrees, prefix=prefix)
    dp_limit = min(int(scheduler.max_req_len), int(scheduler.model_config.context_len))
    engine = FlyingEngine(dp_rank, pool, cfg.bind_timeout_s, cfg.preempt, dp_limit=dp_limit)
    set_engine(engine)
    status.publish(pool.store, dp_rank, engine, scheduler)


def run_pending(scheduler, engine: FlyingEngine, next_batch) -> None:
    was_draining = engine.draining
    try:
        engine.run_pending(scheduler, next_batch)
    finally:
        # a draining step that started nothing changes nothing worth publishing
        if not (was_draining and engine.draining):
            engine.publish(scheduler, force=True)


def drain_step(scheduler, next_batch, *args, **kwargs):
    """Soft preemption: SGLang's step over the running DP requests only (the waiting
    ones stay queued until after the session). Requests SGLang retracts meanwhile go
    back to the real waiting queue."""
    waiting, scheduler.waiting_queue = scheduler.waiting_queue, []
    try:
        plan = next_batch(scheduler, *args, **kwargs)
    finally:
        waiting.extend(scheduler.waiting_queue)
        scheduler.waiting_queue = waiting
    return plan
