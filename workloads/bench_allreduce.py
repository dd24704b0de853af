"""``python -m workloads.bench_allreduce``: the shared-memory all-reduce vs gloo
(``workloads.microbench.bench_allreduce``)."""

from workloads.microbench.bench_allreduce import main

if __name__ == "__main__":
    main()
