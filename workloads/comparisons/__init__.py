"""Side-by-side comparisons: several servers or clients on one trace, one report.

Imports ``workloads.reports``, ``workloads.measure`` and ``workloads.load``.

- ``compare``: static DP vs static TP vs Flying on one trace (``python -m workloads.compare``).
- ``sidebyside``: ``workloads.client`` and ``sglang.benchmark.serving`` on one trace and
  server (``python -m workloads.sidebyside``).
- ``vs_groups_off``: SGLang's serving benchmark, Flying's defaults vs the same server with
  groups off (``--flying-tp-degrees none``), alternating rounds
  (``python -m workloads.vs_groups_off``).
"""
