"""What Flying's hooks cost on SGLang's loop: the engines' CPU time in Flying's code.

One server at a time (``--dp-size 2``, SGLang's default overlap loop), each under the
same steady DP load (``--concurrency`` clients sending greedy requests back to back):
Flying's defaults, then the same server with groups off (``--flying-tp-degrees none``).
While the load runs, ``py-spy`` samples every engine (scheduler) process; each sample
is attributed to the innermost frame of the project or of SGLang on its stack (time in
torch, the standard library or a C extension counts for the code that called it), so
"Flying" is the CPU time of Flying's own hooks and of what they call, "SGLang" the rest
of the engine loop (scheduling, the forward pass, output processing).

Prints Flying's share of the engines' sampled time: under a steady decode load an
engine is stepping all the time, so this is Flying's share of a step (target: <= 1 %
of a decode step). Not a test: the numbers depend on the machine; the share is what to
compare.

    python -m workloads.bench_hooks [--model-path DIR] [--seconds 20] [--concurrency 4]
        [--group 2]

``--group 2``: every request in a TP-2 group (``X-Flying-TP: 2``) on Flying's server,
against SGLang's own ``--tp-size 2`` server, and the requests each server completed in
the window. Both servers' shares then include the collectives: on the CPU platform
SGLang's TP server runs Flying's shared-memory all-reduce too (``sglang_patches``), so
"Flying's code" there is mostly waiting for the peer, and in Flying's groups also the
weight views' matmuls (a linear layer's work in a group); split the samples by frame to
see the per-step hooks apart (docs/BENCHMARKS.md, session 47).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from workloads.measure.server import Server

#: Path fragments of the frames that are Flying's and SGLang's own.
FLYING = ("/flying/", "/sglang_patches/")
SGLANG = ("/sglang/",)


def _post(url: str, payload: dict, headers: dict | None = None) -> None:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()


def _load(url: str, stop: threading.Event, concurrency: int, new_tokens: int,
          headers: dict | None = None) -> list[int]:
    """Clients sending greedy requests back to back until ``stop``; returns the count
    each sent."""
    sent = [0] * concurrency

    def client(i: int) -> None:
        rng = random.Random(i)
        while not stop.is_set():
            ids = [rng.randrange(3, 500) for _ in range(64)]
            try:
                _post(url + "/generate", {"input_ids": ids, "sampling_params": {
                    "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}},
                      headers)
            except OSError:  # the server is stopping: the load is over
                return
            sent[i] += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    return sent


def engine_pids(server: Server) -> list[int]:
    """The server's SGLang scheduler (engine) processes."""
    kids = psutil.Process(server.proc.pid).children(recursive=True)
    return [p.pid for p in kids if "scheduler" in " ".join(p.cmdline() + [p.name()]).lower()]


def owner(frames: list[str]) -> str:
    """"flying", "sglang" or "other": whose code a sample's stack (outermost first)
    was running, by its innermost project or SGLang frame."""
    for frame in reversed(frames):
        if any(f in frame for f in FLYING):
            return "flying"
        if any(f in frame for f in SGLANG):
            return "sglang"
    return "other"


#: py-spy's name for the thread SGLang's event loop runs on (an engine process's main thread).
LOOP_THREAD = "MainThread"


def attribute(raw: str) -> collections.Counter:
    """Samples per (thread, owner) from py-spy's ``--threads --format raw`` output
    (collapsed stacks: ``thread (TID): NAME``, the frames separated by ';', then the
    count). The thread is "loop" (SGLang's event loop: the engine's main thread, or a
    stack without a thread prefix) or "off-loop" (any other thread: one of Flying's, or
    SGLang's own helpers): Flying's work on the loop is what delays a step; an off-loop
    thread delays one only through the CPU it takes."""
    counts: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        thread = LOOP_THREAD
        if frames[0].startswith("thread ("):
            thread = frames.pop(0).partition(": ")[2]
        where = "loop" if thread == LOOP_THREAD else "off-loop"
        counts[where, owner(frames)] += int(n)
    return counts


def _sample(pid: int, seconds: int, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid),
         "--duration", str(seconds), "--rate", "250", "--format", "raw", "--nonblocking", "--threads",
         "--full-filenames", "--output", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def measure(name: str, args: list[str], opts, out_dir: Path, headers: dict | None = None) -> dict:
    server = Server(args, out_dir / f"{name}.log")
    try:
        server.wait_ready()
        stop = threading.Event()
        sent = _load(server.url, stop, opts.concurrency, opts.new_tokens, headers)
        time.sleep(3)  # the batch fills
        pids = engine_pids(server) if opts.process == "engines" else [server.proc.pid]
        samplers = [(pid, out_dir / f"{name}-{pid}.txt") for pid in pids]
        procs = [_sample(pid, opts.seconds, path) for pid, path in samplers]
        for p in procs:
            p.wait(timeout=opts.seconds + 60)
        stop.set()
        counts: collections.Counter = collections.Counter()
        for _, path in samplers:
            if path.exists():
                counts += attribute(path.read_text())
        total = sum(counts.values()) or 1
        loop = sum(n for (where, _), n in counts.items() if where == "loop") or 1
        off_flying = sum(n for (where, who), n in counts.items()
                         if where == "off-loop" and who == "flying")
        return {"system": name, "process": opts.process, "processes": len(samplers),
                "samples": total,
                "flying_share": (counts["loop", "flying"] + off_flying) / total,
                "sglang_share": sum(n for (_, who), n in counts.items() if who == "sglang")
                / total,
                "flying_loop_share": counts["loop", "flying"] / loop,
                "flying_off_loop_share": off_flying / total,
                "requests": sum(sent)}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="checkpoint (default: the demo model)")
    ap.add_argument("--seconds", type=int, default=20, help="sampling window per server")
    ap.add_argument("--concurrency", type=int, default=4, help="clients sending back to back")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--process", choices=("engines", "http"), default="engines",
                    help="sample the engines (schedulers) or the HTTP process (tokenizer "
                    "manager: where Flying's per-output hook runs)")
    ap.add_argument("--group", type=int, default=0, metavar="DEGREE",
                    help="every request asks for a TP group of DEGREE (X-Flying-TP) on "
                    "Flying's server, against SGLang's own --tp-size DEGREE server instead "
                    "of groups off: Flying's share of a group step, and the requests each "
                    "served")
    ap.add_argument("--out", default="results/bench_hooks", help="directory for logs and samples")
    opts = ap.parse_args(argv)
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = ["--model-path", opts.model_path] if opts.model_path else []
    base = ["--dp-size", str(max(2, opts.group))] + model
    if opts.group:
        rows = [measure(f"flying-tp{opts.group}", base, opts, out_dir,
                        {"X-Flying-TP": str(opts.group)}),
                measure(f"sglang-tp{opts.group}",
                        ["--tp-size", str(opts.group), "--dp-size", "1", *model], opts, out_dir)]
    else:
        rows = [measure("flying", base, opts, out_dir),
                measure("groups-off", [*base, "--flying-tp-degrees", "none"], opts, out_dir)]
    print("| server | process sampled | samples | Flying's code | on SGLang's loop "
          "| off the loop | SGLang's code | requests |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['system']} | {r['process']} ({r['processes']}) | {r['samples']} "
              f"| {100 * r['flying_share']:.2f} % | {100 * r['flying_loop_share']:.2f} % "
              f"| {100 * r['flying_off_loop_share']:.2f} % "
              f"| {100 * r['sglang_share']:.2f} % | {r['requests']} |")
    (out_dir / "result.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
