"""What integration tests read from a running node: its status and when it is idle."""

from __future__ import annotations

import json
import threading
import time

import requests


def status(server) -> dict:
    """``/flying/status`` of ``server``."""
    return requests.get(server.url + "/flying/status", timeout=30).json()


def wait_idle(server, timeout: float = 60.0) -> dict:
    """Status once every engine is in DP with no pending bind, all KV slots and request
    rows free, and every bind released (fails the test after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        doc = status(server)
        engines = doc["engines"]
        if (
            all(
                e["mode"] == "dp"
                and e["pending_binds"] == 0
                and e["free_kv_slots"] == e["total_kv_slots"]
                and e["free_req_rows"] == e["total_req_rows"]
                for e in engines
            )
            and doc["totals"]["binds"] == doc["totals"]["releases"]
        ):
            return doc
        assert time.monotonic() < deadline, f"not idle: {json.dumps(doc)[:2000]}"
        time.sleep(0.3)


def settled(server, before: dict) -> dict:
    """The idle status (``wait_idle``), asserting that every engine's KV slots and
    request rows are back to their counts in ``before``."""
    after = wait_idle(server)
    for key in ("free_kv_slots", "free_req_rows"):
        assert engine_counter(after, key) == engine_counter(before, key)
    return after


def engine_counter(doc: dict, key: str) -> list:
    """``key`` of every engine in a status document, by rank."""
    return [e.get(key) for e in sorted(doc["engines"], key=lambda e: e["rank"])]


def greedy(server, ids: list[int], n: int, headers: dict | None = None) -> dict:
    """A greedy ``/generate`` of ``n`` tokens (EOS ignored); the JSON answer (asserts 200)."""
    r = server.post("/generate", greedy_payload(ids, n), headers=headers or {}, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def greedy_on(server, ids: list[int], n: int, rank: int) -> tuple[threading.Thread, dict]:
    """Start a greedy ``/generate`` of ``n`` tokens (EOS ignored) pinned to engine
    ``rank``, in a thread; returns (the thread, the dict its JSON answer and
    ``status_code`` land in once it is joined)."""
    result: dict = {}

    def run() -> None:
        r = server.post("/generate", {**greedy_payload(ids, n), "routed_dp_rank": rank}, timeout=900)
        result.update(r.json(), status_code=r.status_code)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def unbounded_payload(ids: list[int], rank: int, stream: bool = False) -> dict:
    """A greedy /generate without a bound of its own (EOS ignored), on engine ``rank``:
    it may grow to the length limit of where it runs (long-context upgrade)."""
    return {
        "input_ids": ids, "routed_dp_rank": rank, "stream": stream,
        "sampling_params": {"max_new_tokens": None, "temperature": 0, "ignore_eos": True},
    }


def generated(server, payload: dict) -> dict:
    """POST ``/generate`` (long timeout); its JSON answer (asserts 200)."""
    r = server.post("/generate", payload, timeout=900)
    assert r.status_code == 200, r.text
    return r.json()


def engine_deltas(after: dict, before: dict, key: str) -> list[int]:
    """How much ``key`` grew on each engine (by rank) from ``before`` to ``after``."""
    return [a - b for a, b in zip(engine_counter(after, key), engine_counter(before, key), strict=True)]


def greedy_payload(ids: list[int], n: int) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }


def total(doc: dict, key: str) -> int:
    """``key`` summed over the engines of a status document."""
    return sum(engine_counter(doc, key))


def until(cond, what: str, timeout: float = 120) -> None:
    """Poll ``cond`` every 50 ms; fail the test with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def stream_ids(server, payload: dict, headers: dict | None = None,
               on_ids=None) -> tuple[list[int], dict, int]:
    """POST a streamed ``/generate`` ``payload``: (its output ids, the last chunk's
    meta_info, the number of chunks); asserts 200. ``on_ids`` is called with the count
    of output ids so far after each chunk."""
    out: list[int] = []
    meta: dict = {}
    chunks = 0
    with requests.post(server.url + "/generate", json=payload, headers=headers or {},
                       stream=True, timeout=900) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            doc = json.loads(line[5:])
            got = doc["output_ids"]
            # cumulative chunks (SGLang's default) or increments: both end as one list
            out = got if out == got[: len(out)] and len(got) >= len(out) else out + got
            meta, chunks = doc["meta_info"], chunks + 1
            if on_ids is not None:
                on_ids(len(out))
    return out, meta, chunks


def delta(after: dict, before: dict, key: str) -> int:
    """How much ``key`` (summed over the engines) grew from ``before`` to ``after``."""
    return total(after, key) - total(before, key)


def tp_then_dp(server, long_prompt: list[int], short_prompt: list[int], degree: int,
               long_n: int, short_n: int, short_rank: int | None = None) -> tuple[dict, dict, dict]:
    """A long TP-``degree`` request (``long_n`` tokens) on a node whose engines are all
    in its group, then, once that group runs, a short DP request (``short_n``; on engine
    ``short_rank`` if given, else where SGLang routes it): DP work on a member, which a
    ``--flying-move-to-dp all`` session answers by moving its request to DP. Returns
    (status before, long answer, short answer)."""
    before = wait_idle(server)
    result: dict = {}
    headers = {"X-Flying-TP": str(degree)}
    group = threading.Thread(
        target=lambda: result.update(greedy(server, long_prompt, long_n, headers)), daemon=True
    )
    group.start()

    def group_runs() -> bool:
        doc = status(server)
        return all(m == f"tp{degree}" for m in engine_counter(doc, "mode")) and (
            doc["totals"]["tp_steps"] > before["totals"]["tp_steps"] + 20
        )

    until(group_runs, f"the TP-{degree} session did not start")
    if short_rank is None:
        short = greedy(server, short_prompt, short_n)
    else:
        pinned, short = greedy_on(server, short_prompt, short_n, short_rank)
        pinned.join(timeout=600)
        assert short.pop("status_code") == 200, short
    group.join(timeout=600)
    return before, result, short


def dp_then_tp(server, long_prompt: list[int], short_prompt: list[int], degree: int,
               long_n: int, short_n: int) -> tuple[dict, dict, dict]:
    """A long DP request (``long_n`` tokens) on engine 0, then, once it decodes, a short
    TP-``degree`` request binding the group led by engine 0, which the running request
    joins under ``--flying-move-to-dp all``. Returns (status before, long answer,
    short answer)."""
    before = wait_idle(server)
    dp, result = greedy_on(server, long_prompt, long_n, 0)  # engine 0: the group's leader
    until(lambda: delta(status(server), before, "prefill_tokens") >= len(long_prompt),
          "the DP request did not start")
    time.sleep(0.5)  # some DP decode steps
    short = greedy(server, short_prompt, short_n, {"X-Flying-TP": str(degree)})
    dp.join(timeout=600)
    assert result.pop("status_code") == 200, result
    return before, result, short
