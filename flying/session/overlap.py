"""Group sessions under SGLang's overlap loop: a step's result is processed in the state
it ran in.

SGLang's default loop (``Scheduler.event_loop_overlap``) forms and launches step N+1
before it processes step N's result, so the scheduler's CPU work hides behind the
forward pass. A session switches the scheduler between the engine's DP state and the
session's TP state at step boundaries (``flying.session.tp_scope``); a result processed
in the other state would finish requests in the wrong queues and free KV in the wrong
allocator. So wherever the state may change next, the engine first processes the
pending result itself, in the state it was produced in:

- at the top of the loop (``FlyingEngine.before_input``) after a group step: before
  leaving the session's TP state;
- at the step boundary (``FlyingEngine.next_batch``) while a session runs or a bind is
  pending: before entering a group, binding, moving or joining requests.

The loop pops a pending result only while ``last_batch`` is set (that, or two prefills
in a row, ``is_disable_overlap_for_batch``, which also reads ``last_batch``); once the
engine has processed it, it clears ``last_batch`` after the step's batch is formed (the
formation has already merged a prefill from it; the loop sets it to this step's batch
at the end of the iteration). Invariant: the result queue holds at most one result,
and never across a change of state.

Everything else is SGLang's overlap untouched: with no session and no pending bind
nothing here runs, so DP steps stay overlapped; a group's steps run as in SGLang's
normal loop (each result processed before the next step is formed), as do the DP steps
between them. Under ``--disable-overlap-schedule`` (SGLang's normal loop) there is no
result queue and nothing here runs.
"""

from __future__ import annotations


class PendingResult:
    """The overlap loop's one pending result, processed early where the state changes."""

    def __init__(self) -> None:
        self.processed = False  # processed here this iteration: the loop must not pop

    def process(self, scheduler) -> None:
        """Process the pending result now (in the scheduler's current state), if any."""
        queue = getattr(scheduler, "result_queue", None)  # the overlap loop's only
        if not queue:
            return
        batch, result = queue.popleft()
        self.processed = True
        scheduler.process_batch_result(batch, result)

    def formed(self, scheduler) -> None:
        """The step's batch is formed: if the pending result was processed here, the
        loop finds no last batch and pops nothing."""
        if self.processed:
            scheduler.last_batch = None
            self.processed = False
