"""A discrete-event simulator of one Flying node, driven by Flying's own policy code.

Everything Flying has measured ran on 2 CPU engines; operators run 4-8 GPU nodes. The
simulator answers what Flying's policy (``scheduler.policy.Policy``, unchanged) does on
a given node, model and trace, against static DP and static TP, by simulating what the
node does with each decision:

- ``profile``: cost profiles (step costs as ``scheduler.costs.Costs``, switch costs,
  KV per engine), measured from a node's decision log or status, or first principles
  (``gpu_profile``);
- ``batching``: SGLang-like continuous batching of one server (an engine in DP or a
  group): FCFS, prefill before decode, chunked prefill, KV and running-request limits;
- ``node``: engines, group sessions, binds in one total order, DP steps between group
  steps, moves to DP and joins, aborts, upgrades;
- ``control``: the controller model: the HTTP process's and the DP controller's calls
  into the real policy, the arrival estimate, the decision log;
- ``run``: the event loop and per-request records (``workloads.measure.records``);
- ``cli``: ``python -m workloads.simulate``; ``plots``: the figures (labelled simulated);
- ``validate``: simulated vs measured for a ``workloads.compare`` run directory.

Pure Python: no torch, no sockets (except ``gpu_measure``, run on a GPU host to time one
rank's kernels; ``gpu_calibrate`` reads its output). Modelling assumptions are listed in
docs/SIMULATOR.md.
"""
