"""Step costs read from a run's own token timings: a profile for any server.

A Flying node publishes its step costs (``/flying/status``, the decision log), but
those are each mode's *quiet* points (``scheduler.costs``: the lowest windowed
percentile), and a plain SGLang server (``--tp-size 2``, the static TP of
``workloads.compare``) publishes none. What every server leaves is what its client
saw: each request's first token and inter-token gaps (``workloads.client`` records).
From those this module reads the steps the server actually ran:

- **decode**: each gap between two tokens of a request is one step of its unit (the
  engine or group that served it: ``flying.ranks`` in the record, one group where the
  record has none) at the batch size then, the number of the unit's requests between
  their first and last token at the gap's midpoint. A gap in which one of the unit's
  requests had its first token, or has it at the end of the next gap (SGLang's overlap
  loop hands a step's tokens out when the next step ends), held a prefill step as well
  and is left out. So is a request's last gap: under the overlap loop its last token
  goes out with the one before it where no step follows (and at once from a node's
  group, ``flying.session.overlap``), else when the next step ends, so the gap is 0
  or a step, whatever the batch. Per (degree, batch) the mean of the gaps left (TPOT
  is a mean of gaps, stalls included), where there are at least ``MIN_GAPS``.
- **prefill**: a request that arrived at an idle unit (none of its requests running
  or waiting) took ``ttft - frontend - one decode step at batch 1`` under the overlap
  loop (the first token reaches the client when the step after the prefill ends;
  ``workloads.sim.batching``), without it ``ttft - frontend``. Per degree, where
  there are ``MIN_PREFILLS`` such requests, the median of what they took beyond the
  profile's prefill curve is added to every prefill step: the engine's own curve keeps
  its shape (many measured steps), the requests say what a step cost on top of it on
  this server (waking from idle, dispatch). A fitted line through the few samples
  was worse: between two close prompts one stalled sample made a slope of 60 ms per
  token, carried to every longer prefill.

The result replaces the decode points of the degrees it measured in a profile's
``Costs`` (curves and the single-request step). A degree it did not measure (a group
that never formed in the run; a prefill with too few idle-unit samples) keeps the
profile's points times the median ratio of the measured decode steps to the profile's
(DP's where it measured DP): the policy inside the
simulation compares modes, and quiet points for one beside loaded steps for the other
would make the unmeasured one look faster than it ran. What the
simulator checks with it is its batching, queueing and the policy's decisions, given
the steps the server ran; not that one server's costs carry to another (on the 2-core
CPU machine the same layout's quiet step varies by up to 2x from one server to the
next: docs/BENCHMARKS.md, #21, session 36).

Pure: records in, ``Costs`` out.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduler.costs import Costs, Curve
from workloads.measure.records import RequestRecord
from workloads.sim.node import GroupLoop

#: Gaps a (degree, batch) point needs to be kept: fewer are one stall or one burst.
MIN_GAPS = 5
#: Idle-unit prefills a degree needs for its own prefill line.
MIN_PREFILLS = 4


@dataclass(frozen=True)
class Timeline:
    """One request's tokens on its unit: ``sent`` and ``times`` (s since the replay
    began: when it was sent; its first token, then one per gap), ``unit`` (the ranks
    that served it) and ``degree``; ``sglang_tp``: served by SGLang's own TP (the
    record says nothing of Flying), whose steps run under the overlap loop as DP's do
    (Flying's groups too, but for a node before session 50: ``SimNode``'s
    ``group_loop``)."""

    record: RequestRecord
    sent: float
    unit: tuple[int, ...]
    degree: int
    times: tuple[float, ...]
    sglang_tp: bool = False

    def overlapped(self, overlap: bool, group_loop: GroupLoop = "flying") -> bool:
        """Whether its steps ran under the overlap loop on a server that runs it."""
        return overlap and (self.degree == 1 or self.sglang_tp or group_loop != "normal")

    @property
    def first(self) -> float:
        return self.times[0]

    @property
    def last(self) -> float:
        return self.times[-1]


def timelines(records: Sequence[RequestRecord], engines: int) -> list[Timeline]:
    """The successful requests' token times and units (no ``flying`` field: SGLang's
    own TP over all ``engines``)."""
    out = []
    for r in records:
        if not r.success or r.ttft_s is None:
            continue
        info = r.flying or {}
        ranks = tuple(info.get("ranks") or range(engines))
        degree = int(info.get("degree") or len(ranks))
        sent = r.send_s if r.send_s is not None else r.arrival_s
        t = sent + r.ttft_s
        times = [t]
        for gap in r.itl_s or ():
            t += gap
            times.append(t)
        out.append(Timeline(r, sent, ranks, degree, tuple(times), sglang_tp=not r.flying))
    return out


def _by_unit(lines: Sequence[Timeline]) -> list[list[Timeline]]:
    """The timelines of each unit (engine or group) together."""
    units: dict[tuple[int, ...], list[Timeline]] = defaultdict(list)
    for line in lines:
        units[line.unit].append(line)
    return list(units.values())


def decode_points(lines: Sequence[Timeline]) -> dict[int, list[tuple[float, float]]]:
    """Per degree: (batch, mean ms of a decode step at that batch)."""
    gaps: dict[tuple[int, int], list[float]] = defaultdict(list)
    for unit_lines in _by_unit(lines):
        firsts = sorted(line.first for line in unit_lines)
        for line in unit_lines:
            for a, b, c in zip(line.times, line.times[1:], line.times[2:] + (None,), strict=False):
                if c is None:
                    break  # the last gap: no step's length (module docstring)
                end = c
                if any(a < f <= end for f in firsts):
                    continue  # a prefill ran in this gap or its result was handed out at its end
                mid = (a + b) / 2
                batch = sum(1 for q in unit_lines if q.first <= mid <= q.last)
                gaps[(line.degree, batch)].append((b - a) * 1e3)
    out: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for (degree, batch), ms in sorted(gaps.items()):
        if len(ms) >= MIN_GAPS:
            out[degree].append((float(batch), statistics.fmean(ms)))
    return dict(out)


def prefill_samples(lines: Sequence[Timeline], decode: dict[int, list[tuple[float, float]]],
                    frontend_ms: float, overlap: bool,
                    group_loop: GroupLoop = "flying") -> dict[int, list[tuple[float, float]]]:
    """Per degree: (prompt tokens, ms of its prefill) of each request that found its
    unit idle (see the module docstring)."""
    samples: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for unit_lines in _by_unit(lines):
        for line in unit_lines:
            if any(q is not line and q.sent <= line.sent <= q.last for q in unit_lines):
                continue  # the unit was busy when it arrived
            one = dict(decode.get(line.degree, ())).get(1.0, 0.0) if line.overlapped(overlap, group_loop) else 0.0
            ms = line.record.ttft_s * 1e3 - frontend_ms - one
            if ms > 0:
                samples[line.degree].append((float(line.record.prompt_len), ms))
    return dict(samples)


def costs_from_records(records: Sequence[RequestRecord], engines: int, base: Costs,
                       frontend_ms: float, overlap: bool = True,
                       group_loop: GroupLoop = "flying") -> tuple[Costs, str]:
    """``base`` with every degree the records measured replaced by what they show, the
    others scaled (module docstring); and a line saying what was measured, for the
    report's header. ``overlap``: the server ran SGLang's overlap loop (its DP engines
    and its own ``--tp-size`` step under it, Flying's groups as ``group_loop`` says:
    ``Timeline``)."""
    lines = timelines(records, engines)
    decode = decode_points(lines)
    prefills = prefill_samples(lines, decode, frontend_ms, overlap, group_loop)
    ratios = {d: _median(ms / ref for b, ms in points if (ref := base.decode(d, b)))
              for d, points in decode.items()}
    extra = {d: _median((ms - ref for t, ms in points if (ref := base.prefill(d, t))), 0.0)
             for d, points in prefills.items() if len(points) >= MIN_PREFILLS}
    general = ratios.get(1) or _median(ratios.values())
    curves, decode_ms, said = {}, {}, []
    for degree in sorted(set(base.decode_ms) | set(base.curves) | set(decode)):
        old = base.curves.get(degree) or Curve()
        k, own = ratios.get(degree, general), decode.get(degree)
        if degree in extra:  # a fixed cost per prefill step beyond the profile's
            prefill = tuple((t, max(1.0, ms + extra[degree])) for t, ms in old.prefill)
            said_prefill = f"prefill {round(extra[degree]):+d} ms ({len(prefills[degree])} idle prefills)"
        else:
            prefill, said_prefill = _times(old.prefill, k), f"prefill x{k:.2f}"
        curves[degree] = Curve(Curve.of(own).decode if own else _times(old.decode, k), prefill)
        decode_ms[degree] = dict(own or ()).get(1.0) or (base.decode(degree, 1) or 0.0) * k
        name = "DP" if degree == 1 else f"TP-{degree}"
        said.append(f"{name}: " + (f"{len(own)} decode points" if own else f"decode x{k:.2f}")
                    + f", {said_prefill}")
    costs = Costs(decode_ms, curves, {}, dict(base.live_ms), dict(base.live_low_ms))
    return costs, "; ".join(said)


def _median(values: Iterable[float], empty: float = 1.0) -> float:
    xs = list(values)
    return statistics.median(xs) if xs else empty


def _times(points: tuple[tuple[float, float], ...], k: float) -> tuple[tuple[float, float], ...]:
    return tuple((x, ms * k) for x, ms in points)
