"""Two systems' requests pooled over alternating rounds, with a paired bootstrap interval.

A round's percentile of ~100 requests moves 10-30 % between rounds of one server on the
2-core machine (``workloads.vs_groups_off``: rounds of one system spread 0.64-1.51 as
ratios), so neither one round nor a median of a few rounds' ratios resolves a 5 %
target. Pooling every request of a system's rounds gives each percentile ~R times the
requests; resampling *rounds* (the same round indices for both systems: a round pairs
two runs minutes apart) with replacement gives the interval of the pooled ratio that
the rounds' own spread allows. A ratio whose interval lies below 1.05 is within a 5 %
target at that confidence; one whose interval straddles it is not resolved by the run.
The interval takes rounds as independent; on a machine whose slow spells last minutes
they are not, and it is too narrow: check with an A/A run of the same length (two
identical servers; ``vs_groups_off --flying-args "--flying-tp-degrees none"``), whose
ratios show what the machine alone reads (docs/BENCHMARKS.md, #22 session 63: 0.87-0.92
over 8 rounds, intervals excluding 1.0).

Reads ``sglang.benchmark.serving`` result files written with ``--output-details`` (the
per-request ``ttfts``, ``itls`` and ``output_lens``); each file's last line is its run.
TPOT is SGLang's: a request's time after its first token over its tokens after the
first (the sum of its inter-token gaps).

    python -m workloads.reports.pooled RUN_DIR [--systems flying,groups-off]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

#: (label, sample, percentile): each figure is a percentile of one pooled sample
FIGURES = [
    ("TTFT p50", "ttft", 50), ("TTFT p90", "ttft", 90), ("TTFT p99", "ttft", 99),
    ("TPOT p50", "tpot", 50), ("ITL p50", "itl", 50), ("ITL p95", "itl", 95),
    ("ITL p99", "itl", 99),
]
SAMPLES = ("ttft", "tpot", "itl")


def round_samples(result: dict) -> dict[str, np.ndarray]:
    """One run's requests as samples, seconds: first tokens, TPOTs (requests of at least
    two tokens), every inter-token gap."""
    ttft = [t for t in result["ttfts"] if t]
    tpot, itl = [], []
    for gaps, n in zip(result["itls"], result["output_lens"], strict=True):
        itl.extend(gaps)
        if n > 1 and gaps:
            tpot.append(sum(gaps) / (n - 1))
    return {"ttft": np.array(ttft), "tpot": np.array(tpot), "itl": np.array(itl)}


def load_rounds(run_dir: Path, system: str) -> list[dict[str, np.ndarray]]:
    """``<system>.round<i>.jsonl`` of ``run_dir``, in round order."""
    paths = sorted(run_dir.glob(f"{system}.round*.jsonl"),
                   key=lambda p: int(p.stem.rsplit("round", 1)[1]))
    return [round_samples(json.loads(p.read_text().splitlines()[-1])) for p in paths]


def figures(rounds: Sequence[dict[str, np.ndarray]], picks: Sequence[int]) -> dict[str, float]:
    """Each figure of ``FIGURES`` over the rounds ``picks`` (indices, repeats allowed)."""
    pooled = {s: np.concatenate([rounds[i][s] for i in picks]) for s in SAMPLES}
    return {label: float(np.percentile(pooled[s], q)) for label, s, q in FIGURES}


def intervals(n: int, ratios: Callable[[list[int]], dict[str, float]], draws: int = 2000,
              seed: int = 0, level: float = 0.90) -> dict[str, tuple[float, float]]:
    """Per label: the ``level`` interval of ``ratios(picks)`` over ``draws`` resamples of
    ``n`` rounds with replacement (``picks``: round indices, repeats allowed; a draw
    whose ratio is nan is left out). Both pooled reports resample this way."""
    rng = np.random.default_rng(seed)
    drawn: dict[str, list[float]] = {}
    for _ in range(draws):
        picks = rng.integers(0, n, n).tolist()
        for label, ratio in ratios(picks).items():
            drawn.setdefault(label, []).append(ratio)
    tail = (1.0 - level) / 2 * 100
    out = {}
    for label, values in drawn.items():
        finite = [v for v in values if not np.isnan(v)]
        low, high = np.percentile(finite, [tail, 100 - tail]) if finite else (np.nan, np.nan)
        out[label] = (float(low), float(high))
    return out


def compare(a: Sequence[dict[str, np.ndarray]], b: Sequence[dict[str, np.ndarray]],
            draws: int = 2000, seed: int = 0, level: float = 0.90) -> list[tuple]:
    """Per figure: (label, pooled a (ms), pooled b (ms), a / b, low, high): the ratio's
    ``level`` interval from ``draws`` paired resamples of the rounds."""
    n = min(len(a), len(b))
    if n == 0:
        return []
    every = list(range(n))
    fa, fb = figures(a, every), figures(b, every)

    def ratios(picks: list[int]) -> dict[str, float]:
        ra, rb = figures(a, picks), figures(b, picks)
        return {label: ra[label] / rb[label] for label in ra}

    bands = intervals(n, ratios, draws, seed, level)
    return [(label, fa[label] * 1e3, fb[label] * 1e3, fa[label] / fb[label], *bands[label])
            for label, _, _ in FIGURES]


def table(rows: list[tuple], names: tuple[str, str], rounds: int, level: float = 0.90) -> str:
    a, b = names
    lines = [f"Every request of {rounds} rounds pooled per system; the interval resamples "
             f"rounds (paired), {level:.0%}:", "",
             f"| figure | {a} (ms) | {b} (ms) | {a} / {b} | interval |",
             "|---|---:|---:|---:|---:|"]
    for label, va, vb, ratio, low, high in rows:
        lines.append(f"| {label} | {va:.1f} | {vb:.1f} | {ratio:.2f} | {low:.2f}-{high:.2f} |")
    return "\n".join(lines)


def report(run_dir: Path, names: tuple[str, str] = ("flying", "groups-off")) -> str:
    """The pooled table of ``run_dir``; empty where a system has no detailed rounds."""
    a, b = (load_rounds(run_dir, name) for name in names)
    rows = compare(a, b)
    return table(rows, names, min(len(a), len(b))) if rows else ""


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--systems", default="flying,groups-off",
                   help="the two systems' file prefixes, numerator first")
    args = p.parse_args(argv)
    names = tuple(args.systems.split(","))
    if len(names) != 2:
        p.error("--systems takes two names")
    text = report(args.run_dir, names)  # type: ignore[arg-type]
    if not text:
        raise SystemExit(f"no detailed rounds of {names} in {args.run_dir}")
    print(text)


if __name__ == "__main__":
    main()
