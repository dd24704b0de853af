"""``python -m workloads.rate_sweep``: goodput against rate over several comparison runs
(``workloads.reports.rate_sweep``)."""

from workloads.reports.rate_sweep import main

if __name__ == "__main__":
    main()
