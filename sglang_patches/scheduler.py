"""Hooks on ``sglang.srt.managers.scheduler.Scheduler`` (the engine process).

- ``__init__`` (after): give the engine its Flying state and communicator pool.
- ``process_input_requests`` (around): take Flying's Bind messages out of the input
  batch (they arrive on the same socket as requests, so they are ordered with them)
  and note client aborts (a bind whose request was aborted is voted down).
- ``get_next_batch_to_run`` (around): the step boundary; run pending TP sessions first
  (under soft preemption, first drain the running DP requests); refresh the engine's
  published status when due.
"""

from __future__ import annotations

from flying.node import engine_setup
from flying.session.engine import get_engine


def init(result, scheduler, *args, **kwargs):
    engine_setup.attach(scheduler)


def process_input_requests(original, scheduler, recv_reqs):
    engine = get_engine()
    if engine is not None and recv_reqs:
        recv_reqs = [r for r in recv_reqs if not engine.on_input(r)]
    return original(scheduler, recv_reqs)


def get_next_batch_to_run(original, scheduler, *args, **kwargs):
    engine = get_engine()
    if engine is None:
        return original(scheduler, *args, **kwargs)
    if engine.pending and not engine.in_session:
        engine_setup.run_pending(scheduler, engine, original)
        if engine.draining:  # soft preemption: finish running DP work, admit none
            return engine_setup.drain_step(scheduler, original, *args, **kwargs)
    plan = original(scheduler, *args, **kwargs)
    engine.publish(scheduler, plan=plan)  # cheap unless due: /flying/status stays current
    return plan
