"""Goodput SLOs: what a workload asks of the server, in SGLang's ``--goodput KEY:MS`` form.

Part of a workload's definition (next to its trace), so that the shared options
(``workloads.load.cli``) and the summaries (``workloads.measure.metrics``) read one
definition.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Goodput SLOs (ms) used when none are given: sized to the CPU demo model, where a lightly
#: loaded engine answers in ~30 ms and decodes a token in ~5 ms, so a request misses them
#: only when it queued or decoded in a crowded batch (override with ``--goodput``).
DEFAULT_SLOS: dict[str, float] = {"ttft": 100.0, "tpot": 20.0}


def parse_slos(pairs: Sequence[str]) -> dict[str, float]:
    """``["ttft:100", "tpot:20"]`` -> ``{"ttft": 100.0, "tpot": 20.0}`` (SGLang's --goodput form)."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"bad SLO {pair!r}: use KEY:MS with KEY ttft, tpot or e2el")
        slos[name] = float(value)
        if not slos[name] > 0:
            raise ValueError(f"bad SLO {pair!r}: the value must be > 0 ms")
    return slos
