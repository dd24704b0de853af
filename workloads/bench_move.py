"""``python -m workloads.bench_move``: the cost of moving a running request between layouts
(``workloads.microbench.bench_move``)."""

from workloads.microbench.bench_move import main

if __name__ == "__main__":
    main()
