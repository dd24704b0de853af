"""Per-request measurements and their JSONL form.

Kept apart from the client so that metrics and plots can load results without aiohttp. Times
are in seconds (floats); ``send_s`` is measured from the start of the run, the same clock as
the trace's ``arrival_s``, so ``send_s - arrival_s`` is the client's own lateness.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RequestRecord:
    """What happened to one request of a trace.

    ``output_len`` is what was asked for (max_new_tokens), ``output_tokens`` what came back.
    ``itl_s`` holds one inter-token latency per token after the first chunk; when a chunk
    carries k tokens its gap is split evenly over them (as SGLang's bench_serving does).
    ``queue_time_s`` is the server's own waiting-queue time when it reports one;
    ``server_timing`` keeps every timing-like number of the final ``meta_info`` verbatim.
    ``flying`` is ``meta_info["flying"]``: where the request ran (mode, engines), if reported.
    """

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    priority: str = "normal"
    phase: str = ""
    send_s: float | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tpot_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    success: bool = False
    error: str | None = None
    http_status: int | None = None
    finish_reason: str | None = None
    queue_time_s: float | None = None
    server_timing: dict[str, float] = field(default_factory=dict)
    flying: dict[str, Any] | None = None

    @property
    def end_s(self) -> float | None:
        """When the request finished or failed, on the run clock."""
        if self.send_s is None or self.e2e_s is None:
            return None
        return self.send_s + self.e2e_s

    def token_times(self) -> list[float]:
        """Run-clock time of every output token, rebuilt from TTFT and the ITLs.

        Tokens of the first chunk beyond the first have no ITL of their own and are placed at
        the first-token time.
        """
        if self.send_s is None or self.ttft_s is None or self.output_tokens <= 0:
            return []
        first = self.send_s + self.ttft_s
        times = [first] * max(1, self.output_tokens - len(self.itl_s))
        t = first
        for gap in self.itl_s:
            t += gap
            times.append(t)
        return times


def save_records(records: Iterable[RequestRecord], path: str | Path) -> None:
    """Write one JSON object per record."""
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(dataclasses.asdict(rec), separators=(",", ":")) + "\n")


def load_records(path: str | Path) -> list[RequestRecord]:
    """Read records written by ``save_records``; unknown keys are ignored for forward compat."""
    names = {f.name for f in dataclasses.fields(RequestRecord)}
    records: list[RequestRecord] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                data = json.loads(line)
                records.append(RequestRecord(**{k: v for k, v in data.items() if k in names}))
    return records
