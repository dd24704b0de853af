"""One simulated run: a trace through the controller model and the node, to records.

``simulate`` sends each trace request at its arrival time (an open-loop client that is
never late), runs the event loop to idle and returns the same per-request records the
real client writes (``workloads.measure.records.RequestRecord``: TTFT, ITL, TPOT, E2E, the
server's queue time, ``flying`` with where the request started), so
``workloads.measure.metrics`` summarises a simulated run exactly as a measured one. It also
returns the decision log lines (the real log's format), the node's layout over time
and the switch counters.

Policies by name (``policy_settings``): ``static-dp``, ``static-tp`` (the largest
degree), ``static-tpM`` (``--flying-policy static-tp --flying-tp-degrees M``),
``adaptive``, ``manual``; any Flying flag given applies to all of them.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from flying.node.config import FlyingConfig
from flying.node.placement import DEFAULT_MAX_NEW_TOKENS
from scheduler.priority import PRIORITY_NAMES
from workloads.load.trace import TraceRequest
from workloads.measure.records import RequestRecord
from workloads.sim.batching import SimRequest
from workloads.sim.control import Controller
from workloads.sim.loop import Loop
from workloads.sim.node import GroupLoop, SimNode
from workloads.sim.profile import Profile

_STATIC_TP = re.compile(r"static-tp(\d+)")


def policy_settings(name: str, base: FlyingConfig) -> FlyingConfig:
    """Flying's settings for a policy name (module docstring)."""
    found = _STATIC_TP.fullmatch(name)
    if found:
        return replace(base, policy="static-tp", tp_degrees=found.group(1)).validate()
    return replace(base, policy=name).validate()


def degrees_of(cfg: FlyingConfig, profile: Profile, engines: int) -> tuple[int, ...]:
    """The node's TP degrees: "auto" as the launcher resolves it; a list must be
    degrees the node can form and the profile has costs for."""
    fits = profile.degrees_for(engines)
    asked = cfg.degree_list()
    if asked is None:
        return fits
    bad = [m for m in asked if m not in fits]
    if bad:
        raise ValueError(f"TP degrees {bad} not available on {engines} engines with profile "
                         f"{profile.name} (available: {list(fits) or 'none'})")
    return tuple(asked)


@dataclass
class SimResult:
    policy: str
    degrees: tuple[int, ...]
    records: list[RequestRecord]
    decisions: list[str] = field(default_factory=list)
    layout: list[tuple[float, list[int]]] = field(default_factory=list)
    counters: dict = field(default_factory=dict)
    wall_s: float = 0.0


#: (time in s, "abort" | "upgrade", trace index): what a test injects.
Event = tuple[float, str, int]


def simulate(
    trace: Sequence[TraceRequest], profile: Profile, engines: int, cfg: FlyingConfig,
    name: str = "", log: bool = True, events: Iterable[Event] = (),
    explicit: dict[int, int] | None = None,
    after_event: Callable[[SimNode], None] | None = None, group_loop: GroupLoop = "flying",
) -> SimResult:
    """Run ``trace`` on a node of ``engines`` under ``cfg``; ``explicit`` gives trace
    indices an ``X-Flying-TP`` degree; ``after_event`` is called after every event
    (the invariant checks of the tests); ``group_loop``: how group steps meet the
    overlap loop (``SimNode``: "flying", a node's groups; "normal", a node's before
    session 50; "sglang", SGLang's own TP). Every TTFT and E2E gets the profile's
    ``frontend_ms``."""
    if cfg.preempt != "hard":
        raise ValueError("only --flying-preempt hard is simulated")
    started = time.perf_counter()
    degrees = degrees_of(cfg, profile, engines)
    loop = Loop()
    lines: list[str] = []
    layout: list[tuple[float, list[int]]] = [(0.0, [1] * engines)]
    node = SimNode(engines, profile, loop, cfg.move_to_dp, cfg.bind_timeout_s,
                   on_layout=lambda t, d: layout.append((t, d)),
                   log=(lambda doc: lines.append(json.dumps(doc))) if log else None,
                   group_loop=group_loop, hold_steps=cfg.hold_steps)
    control = Controller(node, profile, cfg, degrees, lines.append if log else None)
    reqs = [_request(r, (explicit or {}).get(r.index, 0)) for r in trace]
    for req in reqs:
        loop.at(req.arrival, control.arrive, req)
    by_index = {r.index: r for r in reqs}
    for t, kind, index in events:
        req = by_index[index]
        loop.at(t, node.abort if kind == "abort" else control.upgrade, req)
    loop.run(None if after_event is None else lambda: after_event(node))
    frontend = profile.frontend_ms / 1000.0
    records = [_record(r, tr, frontend) for r, tr in zip(reqs, trace, strict=True)]
    counters = {"decisions": control.decisions, "binds": control._binds, **node.counters}
    return SimResult(name or cfg.policy, degrees, records, lines, layout, counters,
                     time.perf_counter() - started)


def _request(r: TraceRequest, explicit: int) -> SimRequest:
    return SimRequest(
        index=r.index, rid=f"sim-{r.index}", arrival=r.arrival_s, prompt=r.prompt_len,
        max_new=max(1, r.output_len if r.output_len else DEFAULT_MAX_NEW_TOKENS),
        priority=PRIORITY_NAMES.get(r.priority, 0), explicit=explicit,
    )


def _record(req: SimRequest, r: TraceRequest, frontend: float = 0.0) -> RequestRecord:
    """The record ``workloads.client`` would have written for ``req``, ``frontend``
    seconds outside the engines added to its TTFT and E2E."""
    rec = RequestRecord(index=r.index, arrival_s=r.arrival_s, prompt_len=r.prompt_len,
                        output_len=r.output_len, priority=r.priority, phase=r.phase,
                        send_s=r.arrival_s)
    times = req.times
    rec.output_tokens = len(times)
    rec.success = req.error is None and req.done and bool(times)
    rec.error = req.error if req.done else "not finished"
    rec.http_status = req.status
    if times:
        rec.ttft_s = times[0] - req.arrival + frontend
        rec.itl_s = [b - a for a, b in zip(times, times[1:], strict=False)]
    rec.e2e_s = (req.done_at if req.done_at is not None else req.arrival) - req.arrival + frontend
    if rec.ttft_s is not None and rec.output_tokens > 1:
        rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)
    rec.finish_reason = "length" if rec.success else None
    if req.admitted_at is not None and req.queued_at is not None:
        rec.queue_time_s = max(0.0, req.admitted_at - req.queued_at)
    if req.ranks:
        mode = "dp" if req.degree <= 1 else "tp"
        info: dict = {"mode": mode, "degree": req.degree, "ranks": list(req.ranks), "simulated": True}
        if req.reason and (mode == "dp" or req.moved):
            info["reason"] = req.reason
        if req.moved:
            info["moved"] = req.moved
        rec.flying = info
    return rec
