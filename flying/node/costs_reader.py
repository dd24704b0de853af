"""The controller's view of measured step costs, and its decision log.

``CostsReader``: the engines publish their measured step costs per degree (the
single-request decode step and the decode / prefill curve points) and their measured
switch and move times in their status documents (``flying.session.step_costs``,
``flying.session.counters``); a thread of the controller re-reads them every
``REFRESH_S`` (one store read per engine), off the controller's loop, and hands the
policy one ``Costs`` (per degree and curve point, the mean over the engines that
measured it) and one ``SwitchCosts``.

``DecisionLog``: with ``--flying-decision-log PATH`` the controller appends one JSON line
per decision (request, loads, costs, decision with its reason) and per upgrade decision
(``"kind": "upgrade"``), after a first line with the node and policy configuration;
the engines append their moves, joins and upgrades' joins (``flying.session.layout_log``);
``python -m scheduler.replay PATH`` replays it to the same decisions.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict

from flying.session import status
from flying.session.layout_log import Appender
from flying.session.step_costs import bucket
from scheduler.costs import Costs, Curve
from scheduler.layout_choice import SwitchCosts
from scheduler.replay import record, record_upgrade

logger = logging.getLogger(__name__)

#: How often the controller re-reads the engines' measured costs.
REFRESH_S = 0.5
#: How long the first decision waits for the first read of the costs.
FIRST_READ_S = 2.0


class CostsReader:
    """The engines' measured costs, refreshed every ``REFRESH_S`` by a daemon thread.

    The reads are store round trips to the launcher process; done on the controller's
    loop they held up the request that happened to arrive then, and every request
    behind it, while the launcher waited for a core. ``connect`` builds the thread's
    own store client (a TCPStore client is not shared between threads). ``read``
    waits for the first refresh (at most ``FIRST_READ_S``), never after: a decision
    uses costs at most one refresh old, as it did when it read them itself."""

    def __init__(self, connect: Callable[[], object], num_engines: int):
        self._connect = connect
        self.num_engines = num_engines
        #: (costs, switch costs), replaced whole: a reader sees one refresh's pair
        self._state: tuple[Costs | None, SwitchCosts] = (None, SwitchCosts())
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flying-costs", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        store, failing = None, False
        while True:
            try:
                if store is None:
                    store = self._connect()
                engines = status.read_all(store, self.num_engines)["engines"]
                self._state = (merge(engines), switch_costs(engines))
                failing = False
            except Exception:  # noqa: BLE001 - costs unknown: the policy stays in DP
                if not failing:
                    logger.exception("flying: could not read the engines' step costs")
                store, failing = None, True
                self._state = (None, self._state[1])
            self._first.set()
            time.sleep(REFRESH_S)

    def _now(self) -> tuple[Costs | None, SwitchCosts]:
        if not self._first.is_set():
            self._first.wait(FIRST_READ_S)
        return self._state

    def read(self) -> Costs | None:
        return self._now()[0]

    def switch(self) -> SwitchCosts:
        return self._now()[1]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def merge(engines: list[dict]) -> Costs | None:
    """Per degree, the mean of the engines' measured decode step (ms), of their
    stretch (over the engines that ran the mode lately; the last one, over those that
    ever did) and of their live decode steps (now and lowest), and per curve point
    (degree, kind, bucket) the mean of the engines' points; None if none."""
    points: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    # per field: per degree, the engines' values (their mean is the node's)
    per: dict[str, dict[int, list[float]]] = {
        key: {} for key in ("decode_ms", "stretch", "live_ms", "live_low_ms", "stretch_last")}
    for doc in engines:
        for name, values in per.items():
            for degree, x in (doc.get(name) or {}).items():
                values.setdefault(int(degree), []).append(float(x))
        for degree, curve in (doc.get("curves") or {}).items():
            for kind in ("decode", "prefill"):
                for work, ms in curve.get(kind, ()):
                    key = (int(degree), kind, bucket(kind, round(work)))
                    points.setdefault(key, []).append((float(work), float(ms)))
    if not per["decode_ms"]:
        return None
    curves: dict[int, dict[str, list]] = {}
    for (degree, kind, _), pts in sorted(points.items()):
        work, ms = _mean([w for w, _ in pts]), _mean([m for _, m in pts])
        curves.setdefault(degree, {"decode": [], "prefill": []})[kind].append(
            (round(work, 2), round(ms, 4)))
    means = {name: {d: round(_mean(v), 3 if name.startswith("stretch") else 4)
                    for d, v in sorted(values.items())} for name, values in per.items()}
    return Costs(
        means["decode_ms"],
        {d: Curve.of(c["decode"], c["prefill"]) for d, c in curves.items()},
        means["stretch"], means["live_ms"], means["live_low_ms"], means["stretch_last"],
    )


def switch_costs(engines: list[dict]) -> SwitchCosts:
    """The node's measured bind (bind -> first group step) and move (per 1k tokens of
    context, both ways) times; the defaults until one has been measured."""
    binds = sum(e.get("binds", 0) for e in engines)
    tokens = sum(e.get("moved_tokens", 0) + e.get("moved_tokens_to_tp", 0) for e in engines)
    default = SwitchCosts()
    return SwitchCosts(
        sum(e.get("switch_ms_sum", 0.0) for e in engines) / binds if binds
        else default.bind_ms,
        1000.0 * sum(e.get("move_ms_sum", 0.0) + e.get("join_ms_sum", 0.0) for e in engines)
        / tokens if tokens else default.move_ms_per_ktok,
    )


class DecisionLog:
    """Appends decisions as JSON lines (no-op without a path). Never raises.

    Created once per launch, before the controller issues any bind: it truncates the
    file and writes the head line (node and policy configuration). The engines append
    their layout changes to the same file (``flying.session.layout_log``), so every line
    is one ``write`` on an ``O_APPEND`` file (``Appender``): whole lines, in the order
    they were written."""

    def __init__(self, path: str, policy):
        self._out: Appender | None = None
        if not path or policy is None:
            return
        self._out = Appender(path, truncate=True)
        head = {"config": asdict(policy.config), "node": asdict(policy.node)}
        self._out.line(json.dumps(head))

    def write(self, rid: str, request, loads, costs, decision, **inputs) -> None:
        """One decision; ``inputs``: the goodput rule's (traffic, switch, slo,
        predictions), as ``scheduler.replay.record`` takes them."""
        if self._out is None:
            return
        try:
            self._out.line(record(request, loads, decision, costs, rid=rid, t=time.time(),
                                  **inputs))
        except (TypeError, ValueError):
            logger.exception("flying: decision log write failed")

    def upgrade(self, rid: str, holder: int, decision, from_degree: int = 1,
                busy: dict[int, int] | None = None) -> None:
        """The policy's answer to engine ``holder``'s ask to take request ``rid`` into a
        (larger) group (``Policy.upgrade``), with the engines that served groups."""
        if self._out is None:
            return
        try:
            self._out.line(record_upgrade(holder, decision, from_degree, busy, rid=rid,
                                          t=time.time()))
        except (TypeError, ValueError):
            logger.exception("flying: decision log write failed")
