"""Trace generation: what load a benchmark sends (the lowest layer; imports no other).

- ``trace``: seeded synthetic traces (bursty, mixed priority, long context) and JSONL I/O.
- ``arrivals``: standard arrival processes (Poisson, gamma burstiness, constant, ramp).
- ``replay``: recorded traces (Azure 2023 CSV, JSONL) scaled to the machine, looked up in
  ``--traces-dir`` / ``$FLYING_TRACES_DIR`` (a synthetic sample ships in ``workloads/traces/``).
- ``presets``: named, documented trace configurations (``paper``, ``cpu-small``, ...).
- ``slos``: the goodput SLOs a workload asks for (defaults, ``--goodput KEY:MS``).
- ``cli``: the trace, arrival and SLO options every tool shares.
- ``export``: traces as SGLang's Mooncake dataset (``sglang.benchmark.serving``), JSONL, CSV.
"""
