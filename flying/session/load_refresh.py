"""Keep an engine's load snapshot current while it decodes in DP.

SGLang publishes a DP engine's load snapshot (running and waiting requests, which the
DP controller and so the adaptive policy read at every arrival) after every prefill
and idle step, but after a decode step only every ``--load-snapshot-publish-interval``
steps (15 by default). On a GPU that is a fraction of a second; on a slow model it is
seconds: hidden-1024 model on this CPU, cpu-burst's drain, decode steps of 300-400 ms
at 50 requests an engine: 4.5-6 s between snapshots, and the policy read the same
running and waiting counts (18-42 running, 60-67 waiting) for 6.7 s in a drain (session
80's logs). A stale queue holds a switch that waits for it
(``SwitchCharge._waits_for_queue``) and charges every prediction a backlog that is gone.
(One long step is stale too, and nothing here helps it: no snapshot comes from inside a
prefill of 30 requests, 5-9 s on that model.)

So after a DP step that SGLang did not publish, the engine publishes if the last
publish is ``REFRESH_S`` old or more: at most one extra snapshot per ``REFRESH_S``
(the policy evaluates the layouts at most every ``EVALUATE_S``, the same 0.25 s), so
a fast engine keeps SGLang's own cadence and its cost; SGLang's flag keeps working
(what it publishes counts as a publish here).
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: The oldest a DP engine's published load may be after a step (seconds).
REFRESH_S = 0.25


class LoadRefresh:
    """When an engine last published its load snapshot, and whether to publish now."""

    def __init__(self, every_s: float = REFRESH_S,
                 clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self.clock = clock
        self.at = clock()  # when the last publish was seen or made

    def after_step(self, scheduler, publish: Callable[[object], None]) -> bool:
        """After SGLang processed a DP step's result: note SGLang's own publish (its
        writer's counter back at 0), else ``publish(scheduler)`` where the last one is
        ``every_s`` old. True if it published."""
        writer = getattr(scheduler, "load_snapshot_writer", None)
        if writer is None:  # SGLang publishes no snapshot: nothing to keep current
            return False
        now = self.clock()
        if getattr(writer, "publish_counter", 0) == 0:
            self.at = now
            return False
        if now - self.at < self.every_s:
            return False
        publish(scheduler)
        self.at = now
        return True
