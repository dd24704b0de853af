"""Time one GPU's side of a KV relayout (a move) with Flying's own relayout functions.

The GPU profiles charge a move to DP as the KV bytes of its tokens over NVLink
(``workloads.sim.gpu_profile``). On a GPU each member also gathers its rows out of the
paged pool and the destination scatters the whole rows back: ``kv_relayout.read_block``
and ``write_shards`` (TP -> DP) or ``read_block``, ``shard_of`` and ``write_block`` into
the pool's TP view (DP -> TP), on CUDA tensors. Those run on one GPU, and this module
times them for Llama 3 shapes (one GPU's share of an engine's KV heads) over slots
scattered at random through a large pool, as a long-running pool's are. The transfer
between GPUs is not in it (one GPU): it stays the NVLink term.

``python -m workloads.sim.gpu_relayout --out FILE [--baseline FILE.py]`` (needs CUDA):
JSON rows ``{impl, model, degree, direction, tokens, ms, ms_per_ktok}``; with
``--baseline`` (another copy of ``kv_relayout.py``, e.g. ``git show REV:PATH``) both are
timed on the same pools, one after the other per shape.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
import types

import torch

from flying.substrate import kv_adaptor, kv_relayout
from flying.substrate.layout import KvSplit

#: (name, layers, KV heads on one GPU of an engine, head size, pool rows): 8B engines are
#: one GPU; 70B engines two (SGLang's TP-2 inside the engine), so 4 of its 8 KV heads.
SHAPES = (("llama3-8b", 32, 8, 128, 200_000), ("llama3-70b", 80, 4, 128, 60_000))
DEGREES = (2, 4, 8)
TOKENS = (1024, 4096)


def _pool(layers: int, heads: int, dim: int, rows: int) -> types.SimpleNamespace:
    buf = [torch.empty(rows + 1, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2 * layers)]
    return types.SimpleNamespace(
        k_buffer=buf[:layers], v_buffer=buf[layers:], head_num=heads, head_dim=dim,
        v_head_dim=dim, size=rows, page_size=1, row_dim=heads * dim, v_row_dim=heads * dim,
        use_hnd=False, is_quantized_kv_cache=False)


def _time(fn, reps: int = 10) -> float:
    fn()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def _load(path: str):
    spec = importlib.util.spec_from_file_location("baseline_relayout", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _to_dp(kv_relayout, pool, tp, dp_slots, tp_slots, shards: int) -> None:
    """A member's gather of its shard out of the TP view, then the destination's write of
    whole rows from the distinct shards (here the same shard ``shards`` times)."""
    shard = kv_relayout.read_block(tp, tp_slots)
    kv_relayout.write_shards(pool, dp_slots, [shard] * shards)


def _to_tp(kv_relayout, pool, tp, dp_slots, tp_slots, shards: int) -> None:
    """The source's read of whole rows, one rank's shard cut and written to its view."""
    block = kv_relayout.read_block(pool, dp_slots)
    kv_relayout.write_block(tp, tp_slots, kv_relayout.shard_of(block, 0, shards))


def measure(impls: dict) -> list[dict]:
    rows = []
    for name, layers, heads, dim, size in SHAPES:
        pool = _pool(layers, heads, dim, size)
        for m in DEGREES:
            split = KvSplit(heads, m)
            tp = kv_adaptor.view_pool(pool, m)
            for n in TOKENS:
                dp_slots = torch.randperm(size, device="cuda")[: n] + 1
                tp_slots = torch.randperm(tp.size, device="cuda")[: n] + 1
                for (impl, module), (direction, fn) in itertools.product(
                        impls.items(), (("to_dp", _to_dp), ("to_tp", _to_tp))):
                    args = (module, pool, tp, dp_slots, tp_slots, split.shards)
                    ms = _time(lambda f=fn, a=args: f(*a))
                    rows.append({"impl": impl, "model": name, "degree": m, "direction": direction,
                                 "tokens": n, "ms": round(ms, 4),
                                 "ms_per_ktok": round(ms * 1000 / n, 4)})
                    print(rows[-1], flush=True)
        pool = tp = None
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--baseline", help="another kv_relayout.py to time beside this one")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    impls = {"current": kv_relayout}
    if args.baseline:
        impls["baseline"] = _load(args.baseline)
    rows = measure(impls)
    device = torch.cuda.get_device_name()
    with open(args.out, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
