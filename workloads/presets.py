"""``python -m workloads.presets``: the named traces (``--list``), one written out
(``workloads.load.presets``)."""

from workloads.load.presets import main

if __name__ == "__main__":
    main()
