"""Hooks on ``sglang.srt.managers.scheduler_components.load_inquirer.SchedulerLoadInquirer``.

- ``get_loads`` (after): the engine's load snapshot (what SGLang's DP dispatch and
  Flying's policy read) counts a group session's requests once, on the leader, whichever
  of its two states the engine is in (SGLang's inquirer sees only the current one), and
  the binds it leads that wait; its ``timestamp`` is when the loop last took input
  (the controller counts what it sent since as in flight: ``flying.node.in_flight``).
"""

from __future__ import annotations

from flying.session.engine import get_engine


def get_loads(result, inquirer, *args, **kwargs):
    engine = get_engine()
    if engine is None or result is None:
        return result
    return engine.count_load(result)
