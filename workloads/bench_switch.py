"""Switch latency and TP-group request latency, measured side by side in one run.

1. Flying, ``--dp-size N``: for each of ``--requests`` sequential requests with
   ``X-Flying-TP: N``, the bind/release split each engine reports in ``/flying/status``
   (control round trip = controller issue -> engine step boundary, rendezvous = the
   bounded handshake, scope setup = entering TP mode) and the request's end-to-end
   latency; then the same prompts as plain DP requests.
2. Vanilla SGLang ``--tp-size N --dp-size 1`` (through ``flying.node.launch``, so on the same
   CPU platform) on the same prompts.

Prints a markdown table (and writes it with ``--out``). Not a test: numbers depend on the
machine; the ratios are what to compare.

    python -m workloads.bench_switch [--model-path DIR] [--engines 2] [--requests 10]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request
from pathlib import Path

from workloads.compare import log
from workloads.server import Server


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


def run(model_args: list[str], engines: int, n: int, prompt_len: int, new: int, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    prompts = _prompts(n, prompt_len)
    split: dict[str, list[float]] = {"control_ms": [], "rendezvous_ms": [], "scope_setup_ms": []}
    tp_lat, dp_lat, vanilla_lat = [], [], []
    server = _serve([*model_args, "--dp-size", str(engines), "--flying-policy", "manual"], out / "flying.log")
    try:
        url = server.url
        _post(url + "/generate", _payload(prompts[0], 2), {"X-Flying-TP": str(engines)})  # warm
        for ids in prompts:
            _, dt = _post(url + "/generate", _payload(ids, new), {"X-Flying-TP": str(engines)})
            tp_lat.append(dt)
            for eng in _get(url + "/flying/status")["engines"]:
                for key in split:
                    split[key].append(eng["last_switch_ms"][key] / 1e3)
        for ids in prompts:
            dp_lat.append(_post(url + "/generate", _payload(ids, new))[1])
    finally:
        server.stop()
    server = _serve([*model_args, "--tp-size", str(engines), "--dp-size", "1"], out / "vanilla_tp.log")
    try:
        _post(server.url + "/generate", _payload(prompts[0], 2))  # warm
        for ids in prompts:
            vanilla_lat.append(_post(server.url + "/generate", _payload(ids, new))[1])
    finally:
        server.stop()
    ratio = statistics.median(tp_lat) / statistics.median(vanilla_lat)
    lines = [
        f"Requests: {n} sequential, prompt {prompt_len} tokens, {new} new tokens, greedy; "
        f"{engines} engines. Median over requests (switch split: over requests x engines).",
        "",
        "| measure | median (ms) |",
        "|---|---|",
        f"| bind: control round trip (controller issue -> engine step boundary) | {_ms(split['control_ms'])} |",
        f"| bind: rendezvous (bounded handshake on the store) | {_ms(split['rendezvous_ms'])} |",
        f"| bind: mode-scope setup (views, KV view, backend, swaps) | {_ms(split['scope_setup_ms'])} |",
        f"| request in a Flying TP-{engines} group (e2e, incl. bind + release) | {_ms(tp_lat)} |",
        f"| same request on one engine (Flying, DP mode) | {_ms(dp_lat)} |",
        f"| same request on vanilla SGLang --tp-size {engines} | {_ms(vanilla_lat)} |",
        "",
        f"Flying TP-{engines} / vanilla TP-{engines} latency ratio: **{ratio:.2f}**",
    ]
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
    a = p.parse_args(argv)
    model_args = ["--model-path", a.model_path] if a.model_path else []
    if not model_args:
        from flying.node.demo_model import ensure_demo_model

        model_args = ["--model-path", str(ensure_demo_model())]
    print(run(model_args, a.engines, a.requests, a.prompt_len, a.new_tokens, a.out))


if __name__ == "__main__":
    main()
