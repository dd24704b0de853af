"""Summaries of benchmark records, in SGLang bench_serving's units (ms, req/s, tok/s).

Percentiles use numpy's default linear interpolation, as bench_serving does. Latency figures
(TTFT, TPOT, ITL, E2E, queue time) are over successful requests only; failures are counted.

Throughput definitions, chosen to be unambiguous:
- makespan: from the first send to the last request end (success or failure), in seconds.
- request throughput: successful requests / makespan.
- output throughput: output tokens of successful requests / makespan.
- peak output throughput: the run clock is cut into fixed 1 s buckets from 0 (the trace start);
  each output token falls in the bucket of its arrival time (rebuilt from TTFT + ITLs); the
  peak is the largest bucket count divided by the bucket length. Fixed buckets, not a sliding
  window, so the number is easy to recompute by hand.

TPOT is ``(e2e - ttft) / (output tokens - 1)`` and percentiles are numpy's, as in SGLang's
``calculate_metrics``. Goodput is SGLang's own (``sglang.benchmark.goodput``, the function
behind ``python -m sglang.benchmark.serving --goodput ttft:MS tpot:MS``): a request is good
when it succeeded and met every SLO; request goodput = good requests / makespan, SLO
attainment = good requests / requests. Our summaries add what SGLang's lacks: the same
numbers per phase, priority class and Flying mode.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from workloads.load.slos import DEFAULT_SLOS
from workloads.measure.records import RequestRecord

Summary = dict[str, Any]


def goodput_stats(
    records: Sequence[RequestRecord], slos: Mapping[str, float], dur_s: float
) -> Summary | None:
    """SGLang's goodput of ``records`` over ``dur_s`` seconds, as a dict (None when empty).

    SGLang's function reads ``success``, ``ttft``, ``latency`` (s) and ``output_len``
    (tokens received) of its request outputs; each record is handed over in that shape.
    """
    if not records or not slos or dur_s <= 0:
        return None
    import msgspec
    from sglang.benchmark.goodput import calculate_goodput

    outputs = [
        SimpleNamespace(success=r.success, ttft=r.ttft_s or 0.0, latency=r.e2e_s or 0.0,
                        output_len=r.output_tokens)
        for r in records
    ]
    result = calculate_goodput(outputs=outputs, goodput_slos=dict(slos), dur_s=dur_s)  # type: ignore[arg-type]
    return msgspec.structs.asdict(result)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation), or None for no values."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def _ms_stats(values_s: Sequence[float], quantiles: Sequence[int]) -> dict[str, float | None]:
    """Mean and percentiles of second-valued samples, in milliseconds."""
    ms = [v * 1000.0 for v in values_s]
    stats: dict[str, float | None] = {"mean": float(np.mean(ms)) if ms else None}
    for q in quantiles:
        stats[f"p{q}"] = percentile(ms, q)
    return stats


def latency_stats(records: Sequence[RequestRecord]) -> Summary:
    """Counts and latency distributions of one group of requests."""
    ok = [r for r in records if r.success]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    queue = [r.queue_time_s for r in ok if r.queue_time_s is not None]
    queue_stats = _ms_stats(queue, (50, 90))
    return {
        "count": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "ttft_ms": _ms_stats(ttft, (50, 90, 99)),
        "tpot_ms": _ms_stats(tpot, (50, 90)),
        "itl_ms": _ms_stats(itl, (50, 90, 99)),
        "e2e_ms": _ms_stats(e2e, (50, 90)),
        "queue_ms": {"count": len(queue), **queue_stats},
    }


def throughput_stats(records: Sequence[RequestRecord], bucket_s: float = 1.0) -> Summary:
    """Makespan, request and output-token throughput, and peak output throughput."""
    spans = [(r.send_s, r.end_s) for r in records if r.send_s is not None and r.end_s is not None]
    makespan = max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    buckets: Counter[int] = Counter(math.floor(t / bucket_s) for r in ok for t in r.token_times())
    lags = [r.send_s - r.arrival_s for r in records if r.send_s is not None]
    return {
        "makespan_s": makespan,
        # How late the client sent requests versus the trace; large values mean the client
        # (sharing the machine with the server) could not keep the open-loop schedule.
        "max_send_lag_ms": max(lags) * 1000.0 if lags else None,
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / makespan if makespan > 0 else None,
        "output_throughput": out_tokens / makespan if makespan > 0 else None,
        "peak_output_throughput": max(buckets.values()) / bucket_s if buckets else None,
    }


def _group(
    records: Iterable[RequestRecord], key: Callable[[RequestRecord], str | None]
) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = {}
    for rec in records:
        name = key(rec)
        if name is not None:
            groups.setdefault(name, []).append(rec)
    return dict(sorted(groups.items()))


def flying_mode(rec: RequestRecord) -> str | None:
    """The engine mode the server reported for a request (``meta_info.flying.mode``)."""
    mode = (rec.flying or {}).get("mode")
    return None if mode is None else str(mode)


def summarize(
    records: Sequence[RequestRecord],
    bucket_s: float = 1.0,
    slos: Mapping[str, float] | None = DEFAULT_SLOS,
) -> Summary:
    """Everything the reports need: overall, per phase, per priority, per Flying mode.

    With ``slos`` (ms; None or empty for none) every group also gets SGLang's goodput, over
    the whole run's makespan so that the groups' request goodputs add up.
    """
    errors = Counter(r.error for r in records if not r.success and r.error)
    throughput = throughput_stats(records, bucket_s)
    makespan = throughput["makespan_s"]

    def stats(group: Sequence[RequestRecord]) -> Summary:
        out = latency_stats(group)
        if slos:
            out["goodput"] = goodput_stats(group, slos, makespan)
        return out

    return {
        "overall": stats(records),
        "by_phase": {k: stats(v) for k, v in _group(records, lambda r: r.phase).items()},
        "by_priority": {k: stats(v) for k, v in _group(records, lambda r: r.priority).items()},
        "by_mode": {k: stats(v) for k, v in _group(records, flying_mode).items()},
        "throughput": throughput,
        "modes": dict(Counter(m for r in records if (m := flying_mode(r)) is not None)),
        "errors": dict(errors.most_common(5)),
    }


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


_COLUMNS = (
    ("TTFT p50", "ttft_ms", "p50"),
    ("TTFT p90", "ttft_ms", "p90"),
    ("TTFT p99", "ttft_ms", "p99"),
    ("TPOT p50", "tpot_ms", "p50"),
    ("TPOT p90", "tpot_ms", "p90"),
    ("E2E p50", "e2e_ms", "p50"),
    ("E2E p90", "e2e_ms", "p90"),
    ("queue mean", "queue_ms", "mean"),
    ("queue p90", "queue_ms", "p90"),
)


def render_markdown(summary: Summary, title: str | None = None) -> str:
    """Markdown tables: latencies (ms) per group, then throughput and error counts."""
    lines = [f"### {title}", ""] if title else []
    header = ["group", "n", "ok"] + [name for name, _, _ in _COLUMNS] + ["SLO att. %"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows: list[tuple[str, Summary]] = [("all", summary["overall"])]
    for section, prefix in (
        ("by_phase", "phase"),
        ("by_priority", "priority"),
        ("by_mode", "mode"),
    ):
        rows += [(f"{prefix}={k}", v) for k, v in summary.get(section, {}).items()]
    for name, stats in rows:
        cells = [name, _fmt(stats["count"]), _fmt(stats["completed"])]
        cells += [_fmt(stats[metric][field]) for _, metric, field in _COLUMNS]
        good = stats.get("goodput")
        cells.append(_fmt(good["slo_attainment"] * 100.0) if good else "-")
        lines.append("| " + " | ".join(cells) + " |")
    tp = summary["throughput"]
    lines += [
        "",
        f"makespan {_fmt(tp['makespan_s'])} s | requests {_fmt(tp['request_throughput'], 2)} req/s"
        f" | output {_fmt(tp['output_throughput'])} tok/s"
        f" | peak output {_fmt(tp['peak_output_throughput'])} tok/s (1 s buckets)"
        f" | max send lag {_fmt(tp['max_send_lag_ms'])} ms",
    ]
    good = summary["overall"].get("goodput")
    if good:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in good["goodput_slos_ms"].items())
        per = ", ".join(f"{k} {v * 100:.1f}%" for k, v in good["slo_attainment_by_metric"].items())
        lines.append(
            f"goodput ({slos}): {_fmt(good['request_goodput'], 2)} req/s, SLO attainment "
            f"{good['slo_attainment'] * 100:.1f}% ({per})"
        )
    if summary.get("modes"):
        lines.append("modes: " + ", ".join(f"{k}={v}" for k, v in summary["modes"].items()))
    if summary.get("errors"):
        lines.append("errors: " + "; ".join(f"{v}x {k}" for k, v in summary["errors"].items()))
    return "\n".join(lines)


def flatten(summary: Summary, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a summary keyed by dotted path (``overall.ttft_ms.p90``)."""
    out: dict[str, float] = {}
    for key, value in summary.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "."))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[path] = float(value)
    return out


def compare(a: Summary, b: Summary) -> dict[str, float]:
    """Ratios a/b of every metric present in both (e.g. flying/dp); b == 0 is skipped."""
    fa, fb = flatten(a), flatten(b)
    return {k: fa[k] / fb[k] for k in fa if k in fb and fb[k] != 0}


HEADLINE = (
    "overall.ttft_ms.p50",
    "overall.ttft_ms.p90",
    "overall.ttft_ms.p99",
    "overall.tpot_ms.p50",
    "overall.queue_ms.mean",
    "overall.e2e_ms.p90",
    "throughput.output_throughput",
    "throughput.peak_output_throughput",
    "overall.goodput.request_goodput",
    "overall.goodput.slo_attainment",
)


def render_comparison(
    a: Summary,
    b: Summary,
    labels: tuple[str, str] = ("flying", "dp"),
    keys: Sequence[str] = HEADLINE,
) -> str:
    """Markdown table of headline metrics for two runs and their ratio a/b."""
    fa, fb, ratios = flatten(a), flatten(b), compare(a, b)
    lines = [
        f"| metric | {labels[0]} | {labels[1]} | {labels[0]}/{labels[1]} |",
        "|---|---|---|---|",
    ]
    for key in keys:
        lines.append(
            f"| {key} | {_fmt(fa.get(key))} | {_fmt(fb.get(key))} | {_fmt(ratios.get(key), 3)} |"
        )
    return "\n".join(lines)
