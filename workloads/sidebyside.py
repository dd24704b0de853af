"""``python -m workloads.sidebyside``: the project's client and SGLang's benchmark on one trace
(``workloads.comparisons.sidebyside``)."""

from workloads.comparisons.sidebyside import main

if __name__ == "__main__":
    main()
