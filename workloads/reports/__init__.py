"""Reports and plots of measured runs.

Imports ``workloads.measure`` and ``workloads.load`` only.

- ``timeseries``: the series the plots draw (concurrency, TTFT over time, modes).
- ``plots``: a comparison's PNG plots; ``report``: its saved runs and markdown report.
- ``pooled``: two systems' requests pooled over alternating rounds, with a paired
  bootstrap interval of each ratio (``python -m workloads.reports.pooled``).
- ``targets``: the switching targets as ratios of one comparison run
  (``python -m workloads.targets``).
- ``dashboard``: Flying's Grafana dashboard: its JSON and a rendering from scraped series
  (``python -m workloads.dashboard``).
"""
