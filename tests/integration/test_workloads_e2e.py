"""The benchmark client end to end against a real SGLang server (the shared dp2 server)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from workloads.load.presets import build_preset
from workloads.measure.client import run_trace
from workloads.measure.metrics import render_markdown, summarize

pytestmark = pytest.mark.integration

NUM_REQUESTS = 6
MAX_OUTPUT = 12


def _short_trace():
    """The first cpu-small requests, outputs capped and arrivals compressed to ~1 s.

    The preset's low phase sends one request every 2-3 s; compressing keeps the test quick
    while still overlapping requests on the two engines.
    """
    trace = build_preset("cpu-small", seed=0)[:NUM_REQUESTS]
    return [
        dataclasses.replace(req, arrival_s=0.2 * i, output_len=min(req.output_len, MAX_OUTPUT))
        for i, req in enumerate(trace)
    ]


def test_client_replays_cpu_small_against_server(dp2_server):
    trace = _short_trace()
    records = asyncio.run(
        run_trace(trace, dp2_server.url, request_timeout=120, overall_timeout=300, progress=False)
    )
    assert len(records) == NUM_REQUESTS
    for req, rec in zip(trace, records, strict=True):
        assert rec.success, rec.error
        assert rec.http_status == 200
        assert rec.output_tokens == req.output_len  # ignore_eos: exactly what was asked
        assert rec.ttft_s is not None and rec.ttft_s > 0
        assert rec.e2e_s is not None and rec.e2e_s >= rec.ttft_s
        if req.output_len > 1:
            assert rec.tpot_s is not None and rec.tpot_s > 0
            assert len(rec.itl_s) >= 1
    summary = summarize(records)
    assert summary["overall"]["completed"] == NUM_REQUESTS
    assert summary["throughput"]["output_throughput"] > 0
    text = render_markdown(summary, title="e2e")
    assert "### e2e" in text and "| all | 6 | 6 |" in text and "tok/s" in text
