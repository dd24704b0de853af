"""``python -m workloads.export``: a trace as SGLang's Mooncake dataset, JSONL or CSV
(``workloads.load.export``)."""

from workloads.load.export import main

if __name__ == "__main__":
    main()
