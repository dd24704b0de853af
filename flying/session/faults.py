"""Test-only fault injection for group sessions (off unless ``FLYING_TEST_FAULTS=1``).

Containment (a fault ends its session only) has to be proven at every stage of a
session, on a real server. With the environment variable set, the launcher mounts
``POST /flying/test/fault`` (body ``{"stage": ..., "rank": ..., "after": n}``), which arms one fault in
the launcher's TCPStore; the engine of that rank reads the armed fault once per bind and
raises ``InjectedFault`` when it reaches the stage, consuming it (it fires once).
Without the variable nothing is mounted, nothing is read, and ``check`` is a no-op.

Stages, in session order:
- ``bind``: before the member votes in the rendezvous (the bind is aborted everywhere);
- ``join``: running DP requests are joining the forming group (``join.gather``), after
  the members agreed on them;
- ``take_out``: a source has taken its joining requests out of its DP batch, before
  carrying them (``join._take_out``);
- ``scope``: inside the mode scope, before the request is handed to SGLang;
- ``step``: between two group steps (the peers wait at the next collective);
- ``sample``: inside the per-step token sync, i.e. mid-collective for the peers;
- ``move``: the session's requests are moving to DP (``move.to_dp``), after the members
  agreed on the move;
- ``release``: after the last step, before the scope is left.
"""

from __future__ import annotations

import json
import os

ENV = "FLYING_TEST_FAULTS"
KEY = "flying/test/fault"
_ABSENT = "-"  # what ``refresh`` reads for "no fault armed"
STAGES = ("bind", "join", "take_out", "scope", "step", "sample", "move", "release")


class InjectedFault(RuntimeError):
    """Raised by ``FaultSwitch.check`` at an armed stage (tests only)."""


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


class FaultSwitch:
    """One engine's view of the armed fault; ``refresh`` once per bind, ``check`` often."""

    def __init__(self, store, rank: int):
        self.store = store
        self.rank = rank
        self.on = enabled() and store is not None
        self.armed: str | None = None  # the stage armed for this engine, if any
        self.countdown = 0  # checks of the armed stage to let pass before firing

    def refresh(self) -> None:
        if not self.on:
            return
        self.armed = None
        try:
            # An atomic read that never waits: a peer may delete the key (it fired)
            # between a check and a get, and a get of a missing key blocks for the
            # store's timeout (an engine crashed on that in a CI run). compare_set with
            # a non-empty expected value sets nothing when the key is absent.
            value = self.store.compare_set(KEY, _ABSENT, _ABSENT)
            if value in (_ABSENT, _ABSENT.encode()):
                return
            spec = json.loads(value)
        except Exception:  # noqa: BLE001 - a test switch must never take an engine down
            return
        if int(spec.get("rank", -1)) == self.rank:
            self.armed = str(spec.get("stage"))
            self.countdown = int(spec.get("after", 0))

    def check(self, stage: str) -> None:
        if self.armed != stage:
            return
        if self.countdown > 0:
            self.countdown -= 1
            return
        self.armed = None
        self.store.delete_key(KEY)  # fire once
        raise InjectedFault(f"injected fault at stage {stage!r} on engine {self.rank}")


def arm(store, stage: str, rank: int, after: int = 0) -> None:
    """Arm one fault (the HTTP route's body): at the ``after``-th next check of
    ``stage`` on engine ``rank``. Raises ValueError on a bad stage."""
    if stage not in STAGES:
        raise ValueError(f"unknown fault stage {stage!r}; expected one of {STAGES}")
    store.set(KEY, json.dumps({"stage": stage, "rank": int(rank), "after": int(after)}))


def mount(app, store_of) -> None:
    """``POST /flying/test/fault`` on SGLang's app (only when ``enabled()``)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    async def fault(request):
        body = await request.json()
        try:
            arm(store_of(), str(body.get("stage")), int(body.get("rank", 0)),
                int(body.get("after", 0)))
        except (ValueError, TypeError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return JSONResponse({"armed": body})

    fault.__annotations__["request"] = Request  # resolved here: fastapi is imported lazily
    app.add_api_route("/flying/test/fault", fault, methods=["POST"])


#: Test-only: ``FLYING_TEST_STEP_DELAY_MS="2:15"`` adds 15 ms to every step an engine runs
#: in a TP-2 group (``"1:20"``: to every DP step; comma-separated for several modes).
#: It makes a mode measurably slower on any machine, so the policy's tests can pin
#: which layout pays (the engines measure the slower steps like any other).
DELAY_ENV = "FLYING_TEST_STEP_DELAY_MS"


def step_delays() -> dict[int, float]:
    """{degree: seconds} from ``DELAY_ENV`` ({} when unset, the normal case)."""
    text = os.environ.get(DELAY_ENV, "").strip()
    if not text:
        return {}
    delays = {}
    for part in text.split(","):
        degree, _, ms = part.partition(":")
        delays[int(degree)] = float(ms) / 1e3
    return delays


#: Test-only: ``FLYING_TEST_ADOPT_DELAY_MS="300"`` makes the member that takes a move's
#: requests pause that long before it adopts its peers' rows (``flying.session.handoff``),
#: so a test can watch the senders' DP requests step while the move is in flight.
ADOPT_DELAY_ENV = "FLYING_TEST_ADOPT_DELAY_MS"


def adopt_delay_s() -> float:
    """Seconds from ``ADOPT_DELAY_ENV`` (0 when unset, the normal case)."""
    text = os.environ.get(ADOPT_DELAY_ENV, "").strip()
    return float(text) / 1e3 if text else 0.0
