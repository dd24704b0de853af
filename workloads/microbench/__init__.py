"""Micro-benchmarks of single mechanisms, each its own command; imports only the server
launcher of ``workloads.measure``.

- ``bench_allreduce``: the shared-memory all-reduce vs gloo (no server).
- ``bench_switch``: bind/release latency and a TP-group request vs vanilla SGLang TP.
- ``bench_move``: moving a running request between layouts, per 1k tokens of context.
- ``bench_tp_cpu``: one engine vs vanilla SGLang ``--tp-size 2`` on the CPU platform.
"""
