"""Load generation and measurement for Flying.

The same request trace is replayed against static DP, static TP and Flying so that their
TTFT / TPOT / queue time / throughput can be compared side by side (design brief, section 5):

- ``trace``: seeded synthetic traces (bursty, mixed priority, long context) and JSONL I/O.
- ``arrivals``: standard arrival processes (Poisson, gamma burstiness, constant, ramp).
- ``replay``: production traces (Azure 2023 CSV, JSONL) scaled to the machine, looked up in
  ``--traces-dir`` / ``$FLYING_TRACES_DIR``.
- ``presets``: named, documented trace configurations (``paper``, ``cpu-small``, ...).
- ``cli``: the trace, arrival and SLO options every tool shares.
- ``server``: the one way tests and benchmarks start a ``flying.launch`` server.
- ``export``: traces as SGLang's Mooncake dataset (``sglang.benchmark.serving``), JSONL, CSV.
- ``sidebyside``: ``workloads.client`` and ``sglang.benchmark.serving`` on one trace/server.
- ``vs_groups_off``: SGLang's serving benchmark, Flying's defaults vs the same server with
  groups off (``--flying-tp-degrees none``), alternating rounds.
- ``client``: open-loop streaming benchmark client (``python -m workloads.client``).
- ``metrics`` / ``timeseries``: summaries (with SGLang's goodput), tables, ratios, plot series.
- ``compare``: static DP vs static TP vs Flying on one trace (``python -m workloads.compare``);
  ``report`` / ``plots`` render its markdown report and PNG plots.
"""
