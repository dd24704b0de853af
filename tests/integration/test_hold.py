"""A group holds an arrival while its running request finishes (``scheduler.hold``), on
real SGLang: the arrival's prefill does not pause a request near its end whose TPOT SLO
the pause would leave missed; one whose SLO holds through the pause, or further from its
end, is paused as before (the hold pays, is bounded and never partial)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from tests.conftest import MAX_TOTAL_TOKENS, serve
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration

#: group steps an arrival may wait (``--flying-hold-steps``' default)
HOLD = 8


@pytest.fixture(scope="module")
def group_server(demo_model_dir, tmp_path_factory):
    """An adaptive node whose TP-2 step is faster than one engine's (each DP step 60 ms
    slower, each group step 30 ms): light traffic runs in the group, and a request's
    steps are long enough that the next one arrives while it decodes."""
    yield from serve(
        tmp_path_factory.mktemp("hold") / "server.log", "--model-path", str(demo_model_dir),
        "--dp-size", "2", "--max-total-tokens", str(MAX_TOTAL_TOKENS),
        env={"FLYING_TEST_STEP_DELAY_MS": "1:60,2:30"},
    )


def _stream(url: str, ids: list[int], new_tokens: int, out: dict, started: threading.Event,
            slo_tpot_ms: float = 0.0):
    """Stream one greedy request (with its own TPOT SLO where ``slo_tpot_ms``);
    ``out``: each chunk's arrival time, the last body."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    if slo_tpot_ms:
        params["custom_params"] = {"flying_slo_tpot_ms": slo_tpot_ms}
    payload = {"input_ids": ids, "stream": True, "sampling_params": params}
    times, body = [], {}
    with requests.post(url + "/generate", json=payload, stream=True, timeout=120) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            times.append(time.monotonic())
            body = json.loads(line[5:])
            started.set()
    out.update(times=times, body=body)


def _pair(server, model_dir, first_tokens: int, seed: int, slo_tpot_ms: float
          ) -> tuple[dict, dict, int]:
    """Request A (its TPOT SLO ``slo_tpot_ms``), then B once A's first token is out;
    (A, B, arrivals held meanwhile)."""
    before = requests.get(server.url + "/flying/status", timeout=30).json()["totals"]
    a_ids, b_ids = prompts(2, 24, seed=seed)
    a, b = {}, {}
    a_started, b_started = threading.Event(), threading.Event()
    first = threading.Thread(target=_stream, args=(server.url, a_ids, first_tokens, a, a_started,
                                                      slo_tpot_ms))
    first.start()
    assert a_started.wait(60), "request A sent nothing"
    second = threading.Thread(target=_stream, args=(server.url, b_ids, HOLD, b, b_started))
    second.start()
    first.join(120)
    second.join(120)
    after = requests.get(server.url + "/flying/status", timeout=30).json()["totals"]
    for ids, got, n in ((a_ids, a, first_tokens), (b_ids, b, HOLD)):
        assert got["body"]["output_ids"] == greedy_tokens(model_dir, ids, n)
        assert got["body"]["meta_info"]["flying"]["mode"] == "tp", got["body"]["meta_info"]
    return a, b, after["held_admissions"] - before["held_admissions"]


def test_an_arrival_waits_for_a_group_request_near_its_end(group_server, demo_model_dir):
    """A has at most ``HOLD`` tokens left when B arrives and a TPOT SLO no pause keeps
    (1 ms): B's prefill waits until A's last token is out (without the hold, B's first
    token would come between A's)."""
    a, b, held = _pair(group_server, demo_model_dir, HOLD, seed=31, slo_tpot_ms=1.0)
    assert b["times"][0] >= a["times"][-1], (a["times"], b["times"])
    assert held == 1


def test_an_arrival_is_admitted_where_the_pause_keeps_the_slo(group_server, demo_model_dir):
    """The same pair, A's TPOT SLO a minute: B's prefill (tens of ms over A's 7 token
    intervals) cannot break it, so B is admitted at once and nothing is held."""
    a, b, held = _pair(group_server, demo_model_dir, HOLD, seed=31, slo_tpot_ms=60_000.0)
    assert b["times"][0] < a["times"][-1], (a["times"], b["times"])
    assert held == 0


def test_an_arrival_pauses_a_request_with_more_left_than_the_hold(group_server, demo_model_dir):
    """A has far more than ``HOLD`` tokens left: B is admitted at once (its prefill
    pauses A, as a group always did), nothing is held."""
    a, b, held = _pair(group_server, demo_model_dir, 6 * HOLD, seed=32, slo_tpot_ms=1.0)
    assert b["times"][0] < a["times"][-1], (a["times"], b["times"])
    assert held == 0
