"""``python -m workloads.bench_switch``: switch latency and a TP-group request vs vanilla SGLang TP
(``workloads.microbench.bench_switch``)."""

from workloads.microbench.bench_switch import main

if __name__ == "__main__":
    main()
