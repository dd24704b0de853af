"""Load generation and measurement for Flying.

The same request trace is replayed against static DP, static TP and Flying so that their
TTFT / TPOT / queue time / throughput can be compared side by side (design brief, section 5).
The code is grouped by job into subpackages whose imports point one way, down
the picture: an arrow means "may import", and a subpackage may import whatever its arrows
reach (``tests/unit/test_workloads_layers.py`` checks it)::

    comparisons     sim      microbench
         |        /  |           |
         v       v   |           |
         reports     |           |
            |        |           |
            v        v           |
            measure  <-----------+
               |
               v
              load

- ``load``: trace generation: seeded synthetic traces, arrival processes, replays of
  recorded traces, presets, goodput SLOs, the shared trace options, export for other
  tools. Imports no other subpackage.
- ``measure``: the client and its records: the server launcher, the streaming client,
  per-request records and their summaries. Imports ``load``.
- ``reports``: reports and plots of measured runs, the switching targets, the Grafana
  dashboard. Imports ``measure`` and ``load``.
- ``comparisons``: side-by-side runs (static DP vs TP vs Flying, our client vs SGLang's
  benchmark, Flying vs groups off). Imports ``reports``, ``measure`` and ``load``.
- ``sim``: the node simulator. Imports ``reports``, ``measure`` and ``load`` (never
  ``comparisons``: it reads their run directories as files).
- ``microbench``: micro-benchmarks of single mechanisms. Imports ``measure`` (its server
  launcher; ``load`` too, were it needed).

Each command keeps its name: ``python -m workloads.X`` runs a thin alias module in this
package (``workloads/X.py``: it imports ``main`` from the subpackage and nothing else) for
``client``, ``compare``, ``sidebyside``, ``vs_groups_off``, ``export``, ``presets``,
``targets``, ``dashboard``, ``simulate`` and the ``bench_*`` micro-benchmarks. Library code
imports the subpackages (``workloads.load.trace``, ``workloads.measure.metrics``, ...), never
an alias.
"""
