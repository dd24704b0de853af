"""``python -m workloads.bench_tp_cpu``: one engine vs vanilla SGLang TP-2 on the CPU platform
(``workloads.microbench.bench_tp_cpu``)."""

from workloads.microbench.bench_tp_cpu import main

if __name__ == "__main__":
    main()
