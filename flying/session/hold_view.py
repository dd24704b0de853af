"""What the group leader's hold reads (``scheduler.hold``): its running requests as
``hold.Running`` and the pause admitting the arrivals now would cost them.

SGLang 0.5.23's per-request timestamps give a request's pace so far:
``time_stats.prefill_finished_time`` (its first token) and ``last_decode_finish_time``
(its last), both ``time.perf_counter``, set as SGLang processes each step's result
whether or not metrics are on. A step's and a prefill's cost come from the leader's
own step clock at its degree (``StepClock.predict``: the measured curve times the
mode's stretch now).
"""

from __future__ import annotations

from scheduler import hold


def running(scheduler) -> list:
    """The group's running requests at this boundary: the running batch's, and those of
    a prefill in flight (they join the running batch when the next batch is formed)."""
    reqs = list(scheduler.running_batch.reqs)
    last = scheduler.last_batch
    if last is not None and last.forward_mode.is_extend():
        reqs += [r for r in last.reqs if r not in reqs]
    return reqs


def pace_ms(req) -> float:
    """ms per token between ``req``'s first and last tokens (0: fewer than two yet, or
    no timestamps)."""
    stats = getattr(req, "time_stats", None)
    first = getattr(stats, "prefill_finished_time", 0.0) or 0.0
    last = getattr(stats, "last_decode_finish_time", 0.0) or 0.0
    n = len(req.output_ids)
    if n < 2 or first <= 0 or last <= first:
        return 0.0
    return 1000.0 * (last - first) / (n - 1)


def note_slos(slos: dict[str, float], binds, scheduler, running_reqs) -> None:
    """Record the TPOT SLOs of ``binds`` (the session's own and the arrivals offered
    now) in ``slos`` (rid -> ms) and forget those of requests no longer running
    (``running_reqs``), waiting, chunk-prefilled nor arriving, so a long session's map
    stays its live set."""
    chunked = [scheduler.chunked_req] if scheduler.chunked_req is not None else []
    keep = {r.rid for r in (*running_reqs, *scheduler.waiting_queue, *chunked)}
    for b in binds:
        if b.req is not None:
            keep.add(b.req.rid)
            if b.slo_tpot_ms:
                slos[b.req.rid] = b.slo_tpot_ms
    for rid in [rid for rid in slos if rid not in keep]:
        del slos[rid]


def views(reqs, bounds: list[int], slos: dict[str, float]) -> list[hold.Running]:
    """``hold.Running`` of each request (``bounds``: their ``max_new_tokens``; ``slos``:
    rid -> TPOT SLO from their binds, absent: none known)."""
    return [
        hold.Running(b - len(r.output_ids), len(r.output_ids), pace_ms(r), slos.get(r.rid, 0.0))
        for b, r in zip(bounds, reqs, strict=True)
    ]


def pause_ms(clock, degree: int, binds) -> float | None:
    """The extend step that would prefill ``binds``' prompts now (None: not measured)."""
    tokens = sum(len(getattr(b.req, "input_ids", None) or ()) for b in binds if b.req)
    return clock.predict(degree, "prefill", max(tokens, 1))
