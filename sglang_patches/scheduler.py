"""Hooks on ``sglang.srt.managers.scheduler.Scheduler`` (the engine process).

SGLang's own loop (``event_loop_normal``) drives Flying: each hook calls the engine's
runtime object (``flying.session.engine.FlyingEngine``), which calls the original.

- ``__init__`` (after): give the engine its Flying state, communicator pool and the
  per-degree objects a group needs.
- ``process_input_requests`` (around): top of every loop iteration: back to DP state
  after a TP step; take Flying's Bind messages out of the input (they arrive on the
  same socket as requests, so they are ordered with them); note client aborts.
- ``get_next_batch_to_run`` (around): the step boundary: start a pending bind, and
  choose this step's batch: the group's next TP batch or one DP step between two.
- ``run_batch`` / ``process_batch_result`` (around): contain a TP step's failure.
- ``maybe_sleep_on_idle`` (around): SGLang's idle sleep (``--sleep-on-idle``: a poll of
  its sockets up to 1 s) only when Flying holds no work for the engine either: a bind
  it took off the socket, input deferred, a session or a parked request; before it
  sleeps, the next bind's KV reservation and scope are made ready
  (``flying.session.standby``).
- ``init_req_max_new_tokens`` (around): note a request that came without a bound of
  its own (it may outgrow the engine into a group: ``flying.session.upgrade``).
"""

from __future__ import annotations

from flying.node import engine_setup
from flying.session.engine import get_engine


def init(result, scheduler, *args, **kwargs):
    engine_setup.attach(scheduler)


def process_input_requests(original, scheduler, recv_reqs):
    engine = get_engine()
    if engine is not None:
        recv_reqs = engine.before_input(scheduler, recv_reqs)
    return original(scheduler, recv_reqs)


def get_next_batch_to_run(original, scheduler, *args, **kwargs):
    engine = get_engine()
    if engine is None:
        return original(scheduler, *args, **kwargs)
    return engine.next_batch(scheduler, original)


def run_batch(original, scheduler, batch, *args, **kwargs):
    engine = get_engine()
    if engine is None or args or kwargs:
        return original(scheduler, batch, *args, **kwargs)
    return engine.run_batch(scheduler, original, batch)


def process_batch_result(original, scheduler, batch, result, *args, **kwargs):
    engine = get_engine()
    if engine is None or args or kwargs:
        return original(scheduler, batch, result, *args, **kwargs)
    return engine.process_batch_result(scheduler, original, batch, result)


def maybe_sleep_on_idle(original, scheduler, *args, **kwargs):
    engine = get_engine()
    if engine is not None:
        if engine.holds_work:
            return None
        engine.before_sleep(scheduler)
    return original(scheduler, *args, **kwargs)


def init_req_max_new_tokens(original, scheduler, req, *args, **kwargs):
    unbounded = req.sampling_params.max_new_tokens is None
    result = original(scheduler, req, *args, **kwargs)
    engine = get_engine()
    if engine is not None and unbounded and engine.in_dp_state:
        engine.watch.note(scheduler, req, unbounded)
    return result
