"""``python -m workloads.dashboard``: Flying's Grafana dashboard: its JSON and a rendering
(``workloads.reports.dashboard``)."""

from workloads.reports.dashboard import main

if __name__ == "__main__":
    main()
