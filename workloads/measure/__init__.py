"""The client and its records: start a server, send it a trace, record and summarise.

Imports ``workloads.load`` only.

- ``server``: the one way tests and benchmarks start a ``flying.launch`` server.
- ``stream``: SGLang's streamed responses, parsed chunk by chunk.
- ``client``: the open-loop streaming benchmark client (``python -m workloads.client``).
- ``records``: per-request measurements and their JSONL form (no aiohttp needed).
- ``metrics``: summaries (with SGLang's goodput), markdown tables, ratios.
"""
