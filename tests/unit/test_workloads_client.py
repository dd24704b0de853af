"""The benchmark client against a tiny local SSE server with controlled delays."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from workloads.load.trace import TraceRequest, token_ids_for
from workloads.measure import stream
from workloads.measure.client import KEEPALIVE_S, build_payload, run_trace

pytestmark = pytest.mark.unit

SEEN = web.AppKey("seen", list)
RELEASE = web.AppKey("release", asyncio.Event)
FIRST_DELAY = 0.15  # server-side delay before the first token
TOKEN_DELAY = 0.05  # between later chunks
#: How much shorter than the server's sleep a measured first token may read: the server's
#: timer and the client's clock are read at different points of one event loop (CI
#: measured 0.149997 s behind a 0.15 s sleep, once in hundreds of runs).
CLOCK_SLACK = 0.001


def _sse(data: dict | str) -> bytes:
    body = data if isinstance(data, str) else json.dumps(data)
    return f"data: {body}\n\n".encode()


async def _generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[SEEN].append((body, dict(request.headers)))
    n = body["sampling_params"]["max_new_tokens"]
    if len(body["input_ids"]) > 100:
        return web.json_response(
            {"error": {"message": "Input length exceeds the maximum allowed length"}}, status=400
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await asyncio.sleep(FIRST_DELAY)
    sent = 0
    while sent < n:
        step = 2 if sent == 1 and n >= 3 else 1  # one chunk carries two tokens
        sent += step
        meta = {"completion_tokens": sent, "finish_reason": None}
        if sent == n:
            meta.update(finish_reason={"type": "length"}, queue_time=0.012, flying={"mode": "tp2"})
        chunk = _sse({"text": "x" * sent, "meta_info": meta})
        await resp.write(chunk[:7])  # split a line across writes
        await resp.write(chunk[7:])
        if sent < n:
            await asyncio.sleep(TOKEN_DELAY)
    await resp.write(_sse("[DONE]"))
    return resp


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[SEEN].append((body, dict(request.headers)))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await asyncio.sleep(FIRST_DELAY)
    for i in range(1, body["max_tokens"] + 1):
        choice = {"text": "y", "finish_reason": "length" if i == body["max_tokens"] else None}
        await resp.write(_sse({"choices": [choice], "usage": {"completion_tokens": i}}))
        await asyncio.sleep(TOKEN_DELAY)
    await resp.write(_sse("[DONE]"))
    return resp


async def _slow(request: web.Request) -> web.StreamResponse:
    await request.app[RELEASE].wait()  # held until the test ends, far past the client limits
    return web.json_response({})


async def _with_server(coro_factory):
    app = web.Application()
    app[SEEN] = []
    app.router.add_post("/generate", _generate)
    app.router.add_post("/v1/completions", _completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        return await coro_factory(f"http://127.0.0.1:{port}"), app[SEEN]
    finally:
        await runner.cleanup()


def _req(index, arrival, prompt_len, output_len, priority="normal"):
    return TraceRequest(index, arrival, prompt_len, output_len, priority, "burst")


def test_generate_backend_measures_ttft_itl_and_records_errors():
    trace = [_req(0, 0.0, 8, 4, "high"), _req(1, 0.05, 200, 4), _req(2, 0.1, 5, 1)]

    async def go(url):
        return await run_trace(trace, url, "generate", seed=3, progress=False)

    records, seen = asyncio.run(_with_server(go))
    ok, bad, single = records
    # Request 0: chunks at +0.15 (1 token), +0.20 (2 tokens), +0.25 (1 token).
    assert ok.success and ok.error is None and ok.http_status == 200
    assert ok.output_tokens == 4
    # TTFT ends at the first chunk, not a later one: the chunks after it took at least
    # 2 x TOKEN_DELAY of server sleeps (no wall-clock bound: a loaded machine only adds).
    assert ok.ttft_s >= FIRST_DELAY - CLOCK_SLACK
    assert ok.e2e_s - ok.ttft_s >= 2 * TOKEN_DELAY * 0.9
    assert len(ok.itl_s) == 3
    assert ok.itl_s[0] == pytest.approx(ok.itl_s[1])  # two-token chunk split evenly
    assert ok.itl_s[0] >= TOKEN_DELAY / 2 * 0.9 and ok.itl_s[2] >= TOKEN_DELAY * 0.9
    assert ok.e2e_s == pytest.approx(ok.ttft_s + sum(ok.itl_s), abs=0.05)
    assert ok.tpot_s == pytest.approx((ok.e2e_s - ok.ttft_s) / 3)
    assert ok.queue_time_s == pytest.approx(0.012)
    assert ok.server_timing["queue_time"] == pytest.approx(0.012)
    assert ok.flying == {"mode": "tp2"} and ok.finish_reason == "length"
    # Errors become records, not exceptions.
    assert not bad.success and bad.http_status == 400
    assert "exceeds the maximum allowed length" in bad.error
    assert bad.ttft_s is None and bad.output_tokens == 0
    assert single.success and single.tpot_s is None and single.itl_s == []
    # Open loop: sends follow the trace clock.
    assert bad.send_s >= 0.05 and single.send_s >= 0.1
    # Payload and headers.
    body0, headers0 = next((b, h) for b, h in seen if len(b["input_ids"]) == 8)
    assert body0["input_ids"] == token_ids_for(0, 8, seed=3)
    assert body0["sampling_params"] == {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert body0["stream"] is True
    assert headers0.get("X-Priority") == "high"
    assert all("X-Priority" not in h for b, h in seen if len(b["input_ids"]) != 8)


def test_openai_backend():
    trace = [_req(0, 0.0, 6, 3)]

    async def go(url):
        return await run_trace(trace, url, "openai", progress=False)

    (rec,), seen = asyncio.run(_with_server(go))
    assert rec.success and rec.output_tokens == 3 and len(rec.itl_s) == 2
    assert rec.ttft_s >= FIRST_DELAY - CLOCK_SLACK and all(gap >= TOKEN_DELAY * 0.9 for gap in rec.itl_s)
    assert rec.flying is None and rec.queue_time_s is None
    body = seen[0][0]
    assert body["prompt"] == token_ids_for(0, 6, seed=0)
    assert (body["max_tokens"], body["temperature"], body["ignore_eos"]) == (3, 0, True)


def test_timeouts_become_records():
    # 0: hits the 0.3 s request limit; 1: in flight when the 0.6 s overall limit cancels it;
    # 2: its arrival time never comes.
    trace = [_req(0, 0.0, 5, 2), _req(1, 0.45, 5, 2), _req(2, 30.0, 5, 2)]

    async def with_slow():
        app = web.Application()
        app[RELEASE] = asyncio.Event()
        app.router.add_post("/slow/generate", _slow)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/slow"
        try:
            return await run_trace(
                trace, url, request_timeout=0.3, overall_timeout=0.6, progress=False
            )
        finally:
            app[RELEASE].set()
            await runner.cleanup()

    first, cancelled, never = asyncio.run(with_slow())
    assert not first.success and "timeout after 0.3 s" in first.error
    # The handler never answers: any finite time shows the limits acted (loose for loaded CI).
    assert 0.25 <= first.e2e_s < 5.0
    assert not cancelled.success and cancelled.error == "cancelled: overall timeout"
    assert cancelled.send_s is not None and cancelled.e2e_s < 5.0
    assert not never.success and never.send_s is None and "not sent" in never.error


def test_a_connection_idle_past_the_keepalive_is_not_reused():
    # SGLang's server closes a connection idle for 5 s; a client reusing one it is
    # closing fails the request at once ("Server disconnected"). Requests 0 and 1 are
    # close (one connection may serve both); request 2 comes after a lull longer than
    # the client keeps an idle connection, so it opens a new one.
    ports: list[int] = []

    async def one_token(request: web.Request) -> web.StreamResponse:
        ports.append(request.transport.get_extra_info("peername")[1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        meta = {"completion_tokens": 1, "finish_reason": {"type": "length"}}
        await resp.write(_sse({"text": "x", "meta_info": meta}))
        await resp.write(_sse("[DONE]"))
        return resp

    async def go():
        app = web.Application()
        app.router.add_post("/generate", one_token)
        runner = web.AppRunner(app, keepalive_timeout=60.0)  # the server keeps it open
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            trace = [_req(0, 0.0, 4, 1), _req(1, 0.3, 4, 1), _req(2, KEEPALIVE_S + 0.6, 4, 1)]
            return await run_trace(trace, f"http://127.0.0.1:{runner.addresses[0][1]}",
                                   progress=False)
        finally:
            await runner.cleanup()

    records = asyncio.run(go())
    assert all(r.success for r in records), [r.error for r in records]
    assert ports[0] == ports[1]  # reused while fresh
    assert ports[2] != ports[1]  # not after the lull


def test_connection_refused_is_recorded():
    async def go():
        return await run_trace([_req(0, 0.0, 4, 2)], "http://127.0.0.1:9", progress=False)

    (rec,) = asyncio.run(go())
    assert not rec.success and rec.error and rec.http_status is None


def test_stream_helpers():
    splitter = stream.LineSplitter()
    assert splitter.feed(b'data: {"a"') == []
    assert splitter.feed(b": 1}\r\n\ndata: [DONE]") == ['data: {"a": 1}', ""]
    assert splitter.flush() == ["data: [DONE]"]
    assert stream.parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert stream.parse_sse_line("data: [DONE]") == stream.DONE
    assert stream.parse_sse_line(": keep-alive") is None
    clock = stream.TokenClock(10.0)
    clock.observe(10.5, 1)
    clock.observe(10.5, 1)  # no new token: ignored
    clock.observe(10.8, 4)
    assert clock.ttft == pytest.approx(0.5)
    assert clock.itl == pytest.approx([0.1, 0.1, 0.1])
    meta = {"queue_time": 0.1, "prefill_launch_delay": 0.2, "completion_tokens": 3, "x": "y"}
    assert stream.timing_fields(meta) == {"queue_time": 0.1, "prefill_launch_delay": 0.2}
    abort = {"meta_info": {"finish_reason": {"type": "abort", "message": "KV full"}}}
    assert stream.chunk_error(abort) == "aborted: KV full"
    assert stream.openai_token_count({"choices": [{"text": "a"}]}, 2) == 3
    assert stream.openai_token_count({"choices": [], "usage": {"completion_tokens": 7}}, 5) == 7


def test_build_payload_rejects_unknown_backend():
    with pytest.raises(ValueError):
        build_payload("grpc", _req(0, 0.0, 1, 1), [5])
