"""``python -m workloads.targets``: the switching targets of one comparison run
(``workloads.reports.targets``)."""

from workloads.reports.targets import main

if __name__ == "__main__":
    main()
