"""Soft preemption (``--flying-preempt soft``): members drain their running DP requests
before a bind's session starts, admitting no new DP work meanwhile."""

from __future__ import annotations

import datetime as _dt

import torch.distributed as dist

from flying.session.messages import Bind

#: How long a drained member waits for the others per step boundary.
DRAIN_POLL_S = 0.2


class Drain:
    """The engine's soft-preemption side (mixed into ``FlyingEngine``)."""

    def draining_blocks(self, scheduler) -> bool:
        """Soft preemption: True while this engine must drain before the head bind.

        Hard preemption: never. Soft: until every member has drained its DP work for
        the bind. Each announces it in the store, then waits at most ``DRAIN_POLL_S``
        for the others (it has nothing else to run: new DP work is held back while
        draining), so a wait never blocks an engine for long. The drain keys are deleted
        by the bind's rendezvous."""
        bind = self.pending[0]
        if self.preempt != "soft" or self.pool is None or bind.upgrade is not None:
            return False  # an upgrade's request is one of the running DP requests
        self.draining = True
        if not nothing_running(scheduler):
            return True
        keys = drain_keys(bind)
        self.pool.store.set(keys[bind.ranks.index(self.dp_rank)], "1")
        try:
            self.pool.store.wait(keys, _dt.timedelta(seconds=DRAIN_POLL_S))
        except (RuntimeError, dist.DistStoreError):
            return True
        return False

    def _drain_step(self, scheduler, original):
        """Soft preemption: SGLang's step over the running DP requests only (the waiting
        ones stay queued until after the session). Requests SGLang retracts meanwhile
        go back to the real waiting queue."""
        waiting, scheduler.waiting_queue = scheduler.waiting_queue, []
        try:
            return scheduler_form(scheduler, original)
        finally:
            waiting.extend(scheduler.waiting_queue)
            scheduler.waiting_queue = waiting


def drain_keys(bind: Bind) -> list[str]:
    """Soft preemption: the store keys by which the members announce they drained."""
    return [f"flying/drain/{bind.bind_id}/{r}" for r in bind.ranks]


def nothing_running(scheduler) -> bool:
    """No DP request is running or about to be merged into the running batch."""
    last = scheduler.last_batch
    return scheduler.running_batch.is_empty() and (
        last is None or all(r.finished() for r in last.reqs)
    )


def scheduler_form(scheduler, original):
    """SGLang's batch formation for the scheduler's current state (DP or TP): the loop
    read ``running_batch`` / ``last_batch`` before the hook switched state."""
    return original(scheduler, running_batch=scheduler.running_batch, last_batch=scheduler.last_batch)
