"""``python -m workloads.client``: the open-loop streaming benchmark client
(``workloads.measure.client``)."""

from workloads.measure.client import main

if __name__ == "__main__":
    main()
