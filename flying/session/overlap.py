"""Group sessions under SGLang's overlap loop: a step's result is processed in the state
it ran in.

SGLang's default loop (``Scheduler.event_loop_overlap``) forms and launches step N+1
before it processes step N's result, so the scheduler's CPU work hides behind the
forward pass. A session switches the scheduler between the engine's DP state and the
session's TP state at step boundaries (``flying.session.tp_scope``); a result processed
in the other state would finish requests in the wrong queues and free KV in the wrong
allocator. So wherever the state may change next, the engine first processes the
pending result itself, in the state it was produced in:

- at the top of the loop (``FlyingEngine.before_input``) after a group step, unless the
  session's next step is a group step again (below): before leaving the TP state;
- at the step boundary (``FlyingEngine.next_batch``) while a session runs or a bind is
  pending: before entering a group, binding, moving or joining requests;
- where a session's step boundary ends it or forms nothing (``Lifecycle._tp_form``,
  ``Release._end``): before the exchange reads the session's load, and before release.

Group step after group step (``kept``): the result stays queued and SGLang's loop
processes it after launching the next group step, in the TP state again, as it does
for DP steps. So a group's steps run overlapped too, and a new request's prefill
delays a running request's next token by the prefill (its token is sent after the
prefill runs), not by the prefill plus a decode step: the tail SGLang's own
``--tp-size`` server shows. Measured on the hidden-1024 model, four streams running and
a 128-token prompt arriving: the longest gap 190 ms in a group against 157 ms in
SGLang's TP-2, before this. The result is kept only where every member keeps it, from
what the last exchange told all of them alike (``keeps``): no member with DP work, no
abort, move, park or upgrade to apply; nor where the step holds a request's last token
(``PendingResult.keep``). A member whose DP work
arrived after that exchange runs its DP step one group step later, after the exchange
has announced it, so that no member processes early while another keeps it: a result
processed before the next batch forms filters its finished requests out of it, and the
members' batches would differ.

The loop pops a pending result only while ``last_batch`` is set (that, or two prefills
in a row, ``is_disable_overlap_for_batch``, which also reads ``last_batch``); once the
engine has processed it, it clears ``last_batch`` after the step's batch is formed (the
formation has already merged a prefill from it; the loop sets it to this step's batch
at the end of the iteration). Invariant: the result queue holds at most one result,
and never across a change of state.

With no session and no pending bind nothing here runs, so DP steps stay overlapped, as
do the DP steps between group steps. Under ``--disable-overlap-schedule`` (SGLang's
normal loop) there is no result queue and nothing here runs.
"""

from __future__ import annotations

from flying.session.admission import UPGRADE_OFFER


def keeps(shared) -> bool:
    """Whether a group step's result may stay queued across the boundary, from the last
    exchange (``exchange.Shared``, the same on every member): nothing at the boundary
    needs the session's requests up to date.

    Not ``shared.done``: with a batch formed that reads "nothing waiting or running",
    the state of a session's prefill step when nothing else runs (its requests join
    the running batch at the next formation). Processed at once, its first token went
    out a step earlier than in SGLang's TP and the request's next gap was two steps
    (h1024, quiet phase: TTFT p50 0.82x SGLang's TP-2, TPOT p50 1.07x). Where the next
    boundary forms nothing, ``Lifecycle._tp_form`` processes the kept result first."""
    return not (
        shared.aborts or shared.dp_waiting or shared.dp_held
        or shared.dp_arrived or shared.parking
        or any(key >= UPGRADE_OFFER for key in shared.offers)
    )


class PendingResult:
    """The overlap loop's one pending result, processed early where the state changes."""

    def __init__(self) -> None:
        self.processed = False  # processed here this iteration: the loop must not pop
        #: a group step's result left for the loop, after the next group step
        self.kept = False

    def keep(self, scheduler) -> bool:
        """Leave the queued group step's result for the loop; False if none is queued, or
        if every request in it gets its last token now (by length: the same on every
        member). Those tokens are sent now, not after the next step (SGLang's overlap
        loop holds them behind whatever runs next, a prefill included: on the
        hidden-1024 model a 16-token request's TPOT went from 22 to 30 ms where another
        request's prefill came next).

        Not where only some do: a result processed early sends every request's token a
        step early, and their next token still waits for the step after next, so each
        running request sees two tokens together and then a gap of two steps (with a
        prefill between them, the prefill and two decode steps). Measured on the
        hidden-1024 model, 24 requests streaming and three 4-token requests arriving
        400 ms apart, each finishing in the group: the running requests' longest gap
        191-202 ms against 145-156 ms in SGLang's TP-2, whose loop holds a finishing
        request's last token like any other."""
        queue = getattr(scheduler, "result_queue", None)
        self.kept = bool(queue) and not all(
            r.next_output_finishes_by_length() for r in queue[0][0].reqs
        )
        return self.kept

    def process(self, scheduler) -> None:
        """Process the pending result now (in the scheduler's current state), if any."""
        self.kept = False
        queue = getattr(scheduler, "result_queue", None)
        if not queue:
            return
        batch, result = queue.popleft()
        self.processed = True
        scheduler.process_batch_result(batch, result)

    def formed(self, scheduler) -> None:
        """The step's batch is formed: if the pending result was processed here, the
        loop finds no last batch and pops nothing."""
        self.kept = False
        if self.processed:
            scheduler.last_batch = None
            self.processed = False
