"""Switch latency and TP-group request latency, measured side by side in one run.

1. Flying, ``--dp-size N``: for each of ``--requests`` sequential requests with
   ``X-Flying-TP: N``, the bind/release split each engine reports in ``/flying/status``
   (control round trip = controller issue -> engine step boundary, rendezvous = vote,
   open the session's scope and the bounded handshake, scope setup = agree on joining
   DP requests and enter TP mode; each part also alone, and per engine) and the
   request's end-to-end latency; then the same prompts as plain DP requests.
2. Vanilla SGLang ``--tp-size N --dp-size 1`` (through ``flying.node.launch``, so on the same
   CPU platform) on the same prompts, up at the same time, requests interleaved.

Prints a markdown table (and writes it with ``--out``). Not a test: numbers depend on the
machine; the ratios are what to compare.

    python -m workloads.bench_switch [--model-path DIR] [--engines 2] [--requests 10]
                                     [--skip-vanilla]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request
from datetime import datetime
from pathlib import Path

from workloads.measure.server import Server


def log(message: str) -> None:
    """One timestamped progress line, flushed so a long run shows where it is."""
    print(f"[bench_switch {datetime.now():%H:%M:%S}] {message}", flush=True)


def _post(url: str, payload: dict, headers: dict | None = None) -> tuple[dict, float]:
    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        body = json.loads(resp.read())
    return body, time.perf_counter() - t0


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return json.loads(resp.read())


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def _payload(ids: list[int], new: int) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
    }


def _serve(args: list[str], log_path: Path) -> Server:
    server = Server(args, log_path)
    log(f"starting {' '.join(args)}")
    log(f"ready in {server.wait_ready():.0f} s")
    return server


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f}" if values else "-"


#: The bind's parts each engine reports (``last_switch_ms``), in the order they happen.
PARTS = {
    "vote_ms": "vote (reserve this member's KV slot)",
    "handshake_ms": "handshake (every member at its step boundary, agree on go)",
    "open_ms": "open the scope (TP allocator, toggles), and enter it when no DP request joins",
    "join_ms": "agree on joining DP requests",
    "enter_ms": "enter the TP state (scheduler, KV view, layers)",
}


def run(
    model_args: list[str], engines: int, n: int, prompt_len: int, new: int, out: Path,
    vanilla_too: bool = True,
) -> str:
    """Both servers up at once; each prompt goes to Flying's group, to vanilla SGLang's
    TP and to one Flying engine in turn (interleaved, so drifts in the machine's speed hit
    all three alike; an idle server sleeps, so only the one serving uses the cores).
    ``vanilla_too=False`` measures Flying's switch only (no vanilla server)."""
    out.mkdir(parents=True, exist_ok=True)
    prompts = _prompts(n, prompt_len)
    split: dict[str, list[float]] = {
        "control_ms": [], "rendezvous_ms": [], "scope_setup_ms": [], **{k: [] for k in PARTS},
    }
    per_engine: dict[tuple[int, str], list[float]] = {}
    tp_lat, dp_lat, vanilla_lat = [], [], []
    tp_hdr = {"X-Flying-TP": str(engines)}
    flying = _serve([*model_args, "--dp-size", str(engines), "--flying-policy", "manual"],
                    out / "flying.log")
    try:
        vanilla = _serve([*model_args, "--tp-size", str(engines), "--dp-size", "1"],
                         out / "vanilla_tp.log") if vanilla_too else None
        try:
            for _ in range(2):  # warm both
                _post(flying.url + "/generate", _payload(prompts[0], 4), tp_hdr)
                if vanilla is not None:
                    _post(vanilla.url + "/generate", _payload(prompts[0], 4))
            for ids in prompts:
                tp_lat.append(_post(flying.url + "/generate", _payload(ids, new), tp_hdr)[1])
                for i, eng in enumerate(_get(flying.url + "/flying/status")["engines"]):
                    for key, ms in eng["last_switch_ms"].items():
                        if key in split:  # a server before the parts were reported has none
                            split[key].append(ms / 1e3)
                            per_engine.setdefault((i, key), []).append(ms / 1e3)
                if vanilla is not None:
                    vanilla_lat.append(_post(vanilla.url + "/generate", _payload(ids, new))[1])
                dp_lat.append(_post(flying.url + "/generate", _payload(ids, new))[1])
            totals = _get(flying.url + "/flying/status")["totals"]
        finally:
            if vanilla is not None:
                vanilla.stop()
    finally:
        flying.stop()
    bind = [r + s for r, s in zip(split["rendezvous_ms"], split["scope_setup_ms"], strict=True)]
    split = {k: v for k, v in split.items() if v}
    lines = [
        f"Requests: {n}, prompt {prompt_len} tokens, {new} new tokens, greedy; {engines} "
        "engines; both servers up, requests interleaved (Flying TP, vanilla TP, Flying DP). "
        "Median over requests (switch split: over requests x engines; bind mean in brackets).",
        "",
        "| measure | median (ms) |",
        "|---|---|",
        f"| bind: control round trip (controller issue -> engine step boundary) | {_ms(split['control_ms'])} |",
        f"| bind: rendezvous (vote, open the scope, bounded handshake) | {_ms(split['rendezvous_ms'])} |",
        f"| bind: mode-scope setup (joining requests, enter the prepared views) | {_ms(split['scope_setup_ms'])} |",
        *(f"| - {label} | {_ms(split[key])} |" for key, label in PARTS.items() if key in split),
        f"| **bind -> first group step (rendezvous + scope)** | **{statistics.median(bind) * 1e3:.2f}** "
        f"({statistics.mean(bind) * 1e3:.2f} mean) |",
        f"| binds (members) that found their reservation and scope ready "
        f"(``flying.session.standby``) | {totals.get('standby_binds', 0)} of {totals['binds']} |",
        f"| request in a Flying TP-{engines} group (e2e, incl. bind + release) | {_ms(tp_lat)} |",
        f"| same request on vanilla SGLang --tp-size {engines} | {_ms(vanilla_lat)} |",
        f"| same request on one engine (Flying, DP mode) | {_ms(dp_lat)} |",
    ]
    lines += ["", "Per engine (median ms; engine 0 leads the group):", "",
              "| engine | " + " | ".join(split) + " |", "|---" * (len(split) + 1) + "|"]
    for i in sorted({i for i, _ in per_engine}):
        lines.append(f"| {i} | " + " | ".join(_ms(per_engine.get((i, k), [])) for k in split) + " |")
    if vanilla_lat:
        ratio = statistics.median(tp_lat) / statistics.median(vanilla_lat)
        lines += ["", f"Flying TP-{engines} / vanilla TP-{engines} latency ratio: **{ratio:.2f}**"]
    table = "\n".join(lines)
    (out / "bench_switch.md").write_text(table + "\n")
    return table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the embedded demo model")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("results/bench_switch"))
    p.add_argument("--skip-vanilla", action="store_true",
                   help="measure Flying's switch only (no vanilla --tp-size server)")
    a = p.parse_args(argv)
    model_args = ["--model-path", a.model_path] if a.model_path else []
    if not model_args:
        from flying.node.demo_model import ensure_demo_model

        model_args = ["--model-path", str(ensure_demo_model())]
    print(run(model_args, a.engines, a.requests, a.prompt_len, a.new_tokens, a.out,
              vanilla_too=not a.skip_vanilla))


if __name__ == "__main__":
    main()
