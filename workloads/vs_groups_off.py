"""``python -m workloads.vs_groups_off``: SGLang's benchmark, Flying's defaults vs groups off
(``workloads.comparisons.vs_groups_off``)."""

from workloads.comparisons.vs_groups_off import main

if __name__ == "__main__":
    main()
