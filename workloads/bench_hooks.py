"""``python -m workloads.bench_hooks``: the engines' CPU time in Flying's hooks under DP load
(``workloads.microbench.bench_hooks``)."""

from workloads.microbench.bench_hooks import main

if __name__ == "__main__":
    main()
