"""The controller's view of measured step costs, and its decision log.

``CostsReader``: the engines publish their measured single-request decode step per
degree in their status documents (``flying.session.step_costs``); the controller reads
them at most every ``REFRESH_S`` (one store read per engine) and hands the policy one
``Costs``: per degree, the mean over the engines that measured it.

``DecisionLog``: with ``--flying-decision-log PATH`` the controller appends one JSON line
per decision (request, loads, costs, decision with its reason), after a first line with
the node and policy configuration; ``python -m scheduler.replay PATH`` replays it to the
same decisions.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict

from flying.session import status
from scheduler.policy import Costs
from scheduler.replay import record

logger = logging.getLogger(__name__)

#: How often the controller re-reads the engines' measured costs.
REFRESH_S = 0.5


class CostsReader:
    def __init__(self, store, num_engines: int):
        self.store = store
        self.num_engines = num_engines
        self._costs: Costs | None = None
        self._at = float("-inf")

    def read(self) -> Costs | None:
        now = time.monotonic()
        if now - self._at >= REFRESH_S:
            self._at = now
            try:
                self._costs = merge(status.read_all(self.store, self.num_engines)["engines"])
            except Exception:  # noqa: BLE001 - costs unknown: the policy stays in DP
                logger.exception("flying: could not read the engines' step costs")
                self._costs = None
        return self._costs


def merge(engines: list[dict]) -> Costs | None:
    """Per degree, the mean of the engines' measured decode step (ms); None if none."""
    per: dict[int, list[float]] = {}
    for doc in engines:
        for degree, ms in (doc.get("decode_ms") or {}).items():
            per.setdefault(int(degree), []).append(float(ms))
    if not per:
        return None
    return Costs({d: round(sum(v) / len(v), 4) for d, v in sorted(per.items())})


class DecisionLog:
    """Appends decisions as JSON lines (no-op without a path). Never raises."""

    def __init__(self, path: str, policy):
        self._file = None
        if not path or policy is None:
            return
        try:
            self._file = open(path, "w", buffering=1)  # noqa: SIM115 - one log per launch
            head = {"config": asdict(policy.config), "node": asdict(policy.node)}
            self._file.write(json.dumps(head) + "\n")
        except OSError:
            logger.exception("flying: cannot write the decision log %s", path)
            self._file = None

    def write(self, rid: str, request, loads, costs, decision) -> None:
        if self._file is None:
            return
        try:
            self._file.write(record(request, loads, decision, costs, rid=rid, t=time.time()) + "\n")
        except OSError:
            logger.exception("flying: decision log write failed")
