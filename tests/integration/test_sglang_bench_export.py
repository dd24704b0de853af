"""SGLang's own serving benchmark replays an exported trace against the shared Flying server.

``python -m workloads.export`` writes the Mooncake file; ``python -m sglang.benchmark.serving
--dataset-name mooncake --use-trace-timestamps --header X-Priority=high`` sends it (a
subprocess, as a user runs it). Every request must complete, and Flying must have seen
them as high-priority requests (its ``flying_requests`` counter, by priority).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import requests

from scheduler.priority import PRIORITY_NAMES

pytestmark = pytest.mark.integration

NUM_REQUESTS = 20


def _high_priority_finished(url: str) -> float:
    """Finished requests of priority "high" (the label is its integer), any mode."""
    text = requests.get(url + "/metrics", timeout=30).text
    label = f'priority="{PRIORITY_NAMES["high"]}"'
    pattern = r"^flying_requests_total\{[^}]*" + re.escape(label) + r"[^}]*\} (\S+)$"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.MULTILINE))


def test_sglang_benchmark_replays_exported_trace(dp2_server, demo_model_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    subprocess.run(
        [sys.executable, "-m", "workloads.export", "--preset", "cpu-gamma",
         "--limit", str(NUM_REQUESTS), "--tokenizer", str(demo_model_dir), "--out", str(trace)],
        check=True, timeout=300,
    )
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == NUM_REQUESTS
    before = _high_priority_finished(dp2_server.url)
    result_file = tmp_path / "result.jsonl"
    host, port = dp2_server.url.removeprefix("http://").rsplit(":", 1)
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang",
         "--host", host, "--port", port, "--dataset-name", "mooncake",
         "--dataset-path", str(trace), "--num-prompts", str(NUM_REQUESTS),
         "--use-trace-timestamps", "--header", "X-Priority=high",
         "--goodput", "ttft:1000", "tpot:100", "--output-file", str(result_file),
         "--disable-tqdm"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(result_file.read_text().strip().splitlines()[-1])
    assert result["completed"] == NUM_REQUESTS, proc.stdout[-3000:]
    assert result["request_rate"] == "trace"
    assert result["total_output_tokens"] == sum(rec["output_length"] for rec in lines)
    # The trace spans its timestamps: SGLang waited for them rather than sending at once.
    span_s = (lines[-1]["timestamp"] - lines[0]["timestamp"]) / 1000
    assert result["duration"] >= span_s
    assert 0.0 <= result["slo_attainment"] <= 1.0
    # 20 requests and SGLang's warm-up request, all sent with X-Priority: high.
    assert _high_priority_finished(dp2_server.url) - before >= NUM_REQUESTS + 1
