"""``python -m workloads.simulate``: the node simulator's command (``workloads.sim.cli``)."""

from workloads.sim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
