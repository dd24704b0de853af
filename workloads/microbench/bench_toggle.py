"""What entering and leaving a group's layer state costs, by model depth.

An engine enters a session's TP state before every group step and leaves it after (DP
steps run between), so the layers' toggle is paid twice a step. For SGLang's own
``LlamaForCausalLM`` (loaded in-process on CPU, demo-sized layers, ``--layers`` deep),
TP-2 rank 0's layer state two ways: the per-object entries (each layer's projections'
forwards and head counts: ``weight_views.layer_entries``) and the layers' copies swapped
as one attribute (``shadow_layers``, what engines use). Times one enter + leave: warm
(back to back) and after a 10 ms sleep (a woken engine runs cold). Each depth runs in its
own process (SGLang's config is published once per process).

    python -m workloads.microbench.bench_toggle [--layers 4 32 80] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

WARM, COLD = 300, 40


def _time(toggle, rounds: int, pause_s: float) -> float:
    """Median microseconds of one enter + leave."""
    out = []
    for _ in range(rounds):
        if pause_s:
            time.sleep(pause_s)
        t0 = time.perf_counter()
        toggle.enter()
        toggle.leave()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def measure(layers: int) -> dict:
    """This process: load a ``layers``-deep demo-sized checkpoint and time both toggles."""
    from dataclasses import replace

    from flying.node.demo_model import DEFAULT_SPEC, ensure_demo_model
    from flying.substrate.toggle import Toggle
    from flying.substrate.weight_views import build_shards, layer_entries, layer_toggle
    from workloads.microbench.sglang_model import init_engine, load

    path = str(ensure_demo_model(replace(DEFAULT_SPEC, num_hidden_layers=layers)))
    init_engine(path)
    model = load(path)
    table = build_shards(model, 2, 0)
    per_object = Toggle(layer_entries(table, lambda t: t))
    copies = layer_toggle(table, lambda t: t, root=model)
    row = {"layers": layers, "entries": len(per_object), "copies_entries": len(copies)}
    for name, toggle in (("entries", per_object), ("copies", copies)):
        row[f"{name}_warm_us"] = _time(toggle, WARM, 0.0)
        row[f"{name}_cold_us"] = _time(toggle, COLD, 0.01)
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| layers | exchanges per enter: entries / copies | enter + leave warm (us): entries / "
        "copies | after a 10 ms sleep (us): entries / copies |",
        "|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layers']} | {r['entries']} / {r['copies_entries']} | "
            f"{r['entries_warm_us']:.1f} / {r['copies_warm_us']:.1f} | "
            f"{r['entries_cold_us']:.1f} / {r['copies_cold_us']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 32, 80])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child process
    a = p.parse_args(argv)
    if a.one is not None:
        print(json.dumps(measure(a.one)), flush=True)
        return
    rows = []
    for layers in a.layers:
        print(f"[bench_toggle] {layers} layers ...", flush=True)
        done = subprocess.run(
            [sys.executable, "-m", "workloads.microbench.bench_toggle", "--one", str(layers)],
            check=True, capture_output=True, text=True,
        )
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    text = table(rows)
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
