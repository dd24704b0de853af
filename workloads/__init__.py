"""Load generation and measurement for Flying.

The same request trace is replayed against static DP, static TP and Flying so that their
TTFT / TPOT / queue time / throughput can be compared side by side (design brief, section 5):

- ``trace``: seeded synthetic traces (bursty, mixed priority, long context) and JSONL I/O.
- ``replay``: production traces (Azure 2023 CSV, JSONL) scaled to the machine.
- ``presets``: named, documented trace configurations (``paper``, ``cpu-small``, ...).
- ``client``: open-loop streaming benchmark client (``python -m workloads.client``).
- ``metrics`` / ``timeseries``: summaries, markdown tables, ratios and plot series.
- ``compare``: static DP vs static TP vs Flying on one trace (``python -m workloads.compare``);
  ``report`` / ``plots`` render its markdown report and PNG plots.
"""
