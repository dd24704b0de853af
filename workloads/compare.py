"""``python -m workloads.compare``: static DP vs static TP vs Flying on one trace
(``workloads.comparisons.compare``)."""

from workloads.comparisons.compare import main

if __name__ == "__main__":
    main()
