"""Open-loop streaming benchmark client for SGLang-compatible servers.

Open loop: every request is sent at its trace arrival time whatever the server is doing, so a
slow system builds a queue (and shows it in TTFT) instead of slowing the load down, which is
what bursts do to a real deployment. Every failure becomes a record, never an exception, so a
run always yields one record per trace request.

CLI::

    python -m workloads.client --url http://127.0.0.1:30000 --preset cpu-small \\
        [--trace file.jsonl] [--arrival gamma --rate 2 --burstiness 0.5] \\
        [--goodput ttft:100 tpot:20] [--backend generate|openai] --out results.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from tqdm import tqdm

from workloads.load.trace import DEFAULT_TOKEN_ID_RANGE, TraceRequest, token_ids_for
from workloads.measure import stream
from workloads.measure.records import RequestRecord, save_records

BACKENDS = ("generate", "openai")
ENDPOINTS = {"generate": "/generate", "openai": "/v1/completions"}
#: Seconds an idle connection is kept for reuse: under the 5 s after which SGLang's
#: HTTP server closes an idle one (``SGLANG_TIMEOUT_KEEP_ALIVE``). At aiohttp's default
#: (15 s) a request sent as the server closed its connection failed at once with
#: "Server disconnected" (static DP, hidden-768 three-peak, session 68: after a 5.3 s
#: lull), and counted against that layout as an error.
KEEPALIVE_S = 2.0


def build_payload(
    backend: str, req: TraceRequest, input_ids: list[int], model: str = "default"
) -> dict[str, Any]:
    """The JSON body for one request: greedy, EOS ignored, so exactly ``output_len`` tokens."""
    if backend == "generate":
        return {
            "input_ids": input_ids,
            "sampling_params": {
                "max_new_tokens": req.output_len,
                "temperature": 0,
                "ignore_eos": True,
            },
            "stream": True,
        }
    if backend == "openai":
        return {
            "model": model,
            "prompt": input_ids,
            "max_tokens": req.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
    raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")


def priority_headers(priority: str) -> dict[str, str]:
    """``X-Priority`` for non-default classes; normal requests look like plain SGLang traffic."""
    return {} if priority == "normal" else {"X-Priority": priority}


def new_record(req: TraceRequest) -> RequestRecord:
    """An empty record carrying the trace request's identity."""
    return RequestRecord(
        index=req.index,
        arrival_s=req.arrival_s,
        prompt_len=req.prompt_len,
        output_len=req.output_len,
        priority=req.priority,
        phase=req.phase,
    )


async def _read_stream(
    resp: aiohttp.ClientResponse, backend: str, clock: stream.TokenClock, rec: RequestRecord
) -> None:
    """Consume the SSE body, feeding token counts to ``clock`` and meta data to ``rec``."""
    count_tokens = (
        stream.generate_token_count if backend == "generate" else stream.openai_token_count
    )
    splitter = stream.LineSplitter()
    meta: dict[str, Any] = {}
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        for line in splitter.feed(data):
            chunk = stream.parse_sse_line(line)
            if not isinstance(chunk, dict):
                continue
            err = stream.chunk_error(chunk)
            if err:
                rec.error = err
            clock.observe(now, count_tokens(chunk, clock.tokens))
            rec.finish_reason = stream.finish_reason(chunk) or rec.finish_reason
            meta.update(chunk.get("meta_info") or {})
            if "flying" in chunk:  # a server may put it beside meta_info on OpenAI chunks
                meta["flying"] = chunk["flying"]
    rec.server_timing = stream.timing_fields(meta)
    queue = meta.get("queue_time")
    rec.queue_time_s = float(queue) if isinstance(queue, int | float) else None
    flying = meta.get("flying")
    rec.flying = flying if isinstance(flying, dict) else None


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    backend: str,
    req: TraceRequest,
    rec: RequestRecord,
    t0: float,
    seed: int = 0,
    request_timeout: float = 600.0,
    model: str = "default",
    token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE,
) -> None:
    """Wait for ``req``'s arrival time (clock origin ``t0``), send it, fill ``rec``."""
    delay = t0 + req.arrival_s - time.perf_counter()
    while delay > 0:  # asyncio's timer may wake a little early: never send before arrival
        await asyncio.sleep(delay)
        delay = t0 + req.arrival_s - time.perf_counter()
    ids = req.input_ids or token_ids_for(req.index, req.prompt_len, seed, token_id_range)
    payload = build_payload(backend, req, ids, model)
    start = time.perf_counter()
    rec.send_s = start - t0
    clock = stream.TokenClock(start)
    try:
        timeout = aiohttp.ClientTimeout(total=request_timeout)
        async with session.post(
            url.rstrip("/") + ENDPOINTS[backend],
            json=payload,
            headers=priority_headers(req.priority),
            timeout=timeout,
        ) as resp:
            rec.http_status = resp.status
            if resp.status != 200:
                body = await resp.text()
                try:
                    rec.error = stream.error_text(json.loads(body))
                except json.JSONDecodeError:
                    rec.error = body.strip()[:500] or f"HTTP {resp.status}"
            else:
                await _read_stream(resp, backend, clock, rec)
    except asyncio.CancelledError:
        rec.error = "cancelled: overall timeout"
        raise
    except asyncio.TimeoutError:
        rec.error = f"timeout after {request_timeout:g} s"
    except Exception as exc:  # any failure must become a record, not a crash
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        rec.e2e_s = time.perf_counter() - start
        _finish(rec, clock)


def _finish(rec: RequestRecord, clock: stream.TokenClock) -> None:
    """Derive TTFT/ITL/TPOT and the success flag once the request is over."""
    rec.output_tokens = clock.tokens
    rec.ttft_s = clock.ttft
    rec.itl_s = clock.itl
    if rec.error is None and clock.tokens == 0:
        rec.error = "stream ended without tokens"
    rec.success = rec.error is None
    if rec.ttft_s is not None and rec.e2e_s is not None and rec.output_tokens > 1:
        rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)


async def run_trace(
    trace: Sequence[TraceRequest],
    url: str,
    backend: str = "generate",
    seed: int = 0,
    request_timeout: float = 600.0,
    overall_timeout: float | None = None,
    model: str = "default",
    progress: bool = True,
    token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE,
) -> list[RequestRecord]:
    """Send ``trace`` open loop to ``url``; one record per request, in trace order.

    Requests still running when ``overall_timeout`` expires are cancelled and recorded as
    errors; requests whose arrival time had not come are recorded as not sent.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    records = [new_record(req) for req in trace]
    bar = tqdm(total=len(trace), disable=not progress, unit="req", desc=backend)
    # no client-side queueing; idle connections dropped before the server drops them
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        t0 = time.perf_counter()
        tasks = [
            asyncio.create_task(
                send_request(
                    session,
                    url,
                    backend,
                    req,
                    rec,
                    t0,
                    seed,
                    request_timeout,
                    model,
                    token_id_range,
                )
            )
            for req, rec in zip(trace, records, strict=True)
        ]
        for task in tasks:
            task.add_done_callback(lambda _t: bar.update(1))
        _done, pending = await asyncio.wait(tasks, timeout=overall_timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    bar.close()
    for rec in records:
        if rec.send_s is None:
            rec.error = rec.error or "not sent: overall timeout"
        elif not rec.success and rec.error is None:
            rec.error = "cancelled: overall timeout"
    return records


def _run(coro: Any) -> Any:
    """Run ``coro`` on uvloop when available (lower client overhead), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> None:
    """CLI: send a preset or trace file, write records, print the summary table."""
    from workloads.load.cli import add_goodput_args, add_trace_args, slos_from_args, trace_from_args
    from workloads.measure.metrics import render_markdown, summarize

    parser = argparse.ArgumentParser(description="Open-loop streaming benchmark client.")
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    add_trace_args(parser)
    add_goodput_args(parser)
    parser.add_argument("--backend", default="generate", choices=BACKENDS)
    parser.add_argument("--model", default="default", help="model name for the openai backend")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument("--timeout", type=float, default=3600.0, help="overall seconds")
    parser.add_argument("--out", default="results.jsonl", help="per-request JSONL records")
    parser.add_argument("--summary-out", help="also write the summary as JSON here")
    parser.add_argument("--label", default="", help="title of the printed table")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    trace, _source = trace_from_args(args)
    records = _run(
        run_trace(
            trace,
            args.url,
            backend=args.backend,
            seed=args.seed,
            request_timeout=args.request_timeout,
            overall_timeout=args.timeout,
            model=args.model,
            progress=not args.no_progress,
        )
    )
    save_records(records, args.out)
    summary = summarize(records, slos=slos_from_args(args))
    if args.summary_out:
        with open(args.summary_out, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    print(render_markdown(summary, title=args.label or args.trace or args.preset))


if __name__ == "__main__":
    main()
