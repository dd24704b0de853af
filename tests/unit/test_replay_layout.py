"""Every layout change in the decision log, replayed: moves to DP, joins, upgrades (the
controller's answer and the members' relayout), beside the placements; an older log of
placements only replays as before; lines of several processes stay whole."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from flying.session import layout_log
from scheduler import replay
from scheduler.policy import Decision, EngineLoad, Node, Policy, PolicyConfig, Request
from scheduler.relayout import (
    ADMISSION_SLACK,
    assign,
    joinable,
    reservable,
    running_budget,
    upgrade_total,
)

pytestmark = pytest.mark.unit

NODE = Node(2, (2,), engine_capacity=395, engine_slots=400, group_slack=ADMISSION_SLACK)
CONFIG = PolicyConfig("static-dp")
HEAD = json.dumps({"config": {"policy": "static-dp"},
                   "node": {"num_engines": 2, "degrees": [2], "engine_capacity": 395,
                            "engine_slots": 400, "group_slack": ADMISSION_SLACK}})


def _about(rank: int, bind: str = "b1") -> dict:
    return {"bind": bind, "degree": 2, "ranks": [0, 1], "rank": rank}


def _moves(lens=(100, 30, 20), rooms=(400, 300), loads=(1, 0), bind="b1") -> list[dict]:
    """A move's lines as each member writes them: the shared inputs, the assignment and
    the member's own share."""
    owners = assign(list(lens), list(rooms), list(loads))
    out = []
    for rank in (0, 1):
        mine = [i for i, o in enumerate(owners) if o == rank]
        out.append({"kind": "move", **_about(rank, bind), "lens": list(lens), "rooms": list(rooms),
                    "loads": list(loads), "owners": owners, "requests": len(mine),
                    "tokens": sum(lens[i] for i in mine), "bytes_in": 4096, "ms": 1.5})
    return out


def _joins(rooms=(500, 130), per_slot=2) -> list[dict]:
    """A join's lines: the leader's candidates (with their budgets' inputs), and each
    member's room, reservations and the MIN that joined."""
    reqs = [{"rid": "a", "kv": 60, "max_new_tokens": 200, "outputs": 21},
            {"rid": "b", "kv": 90, "max_new_tokens": 100, "outputs": 50}]
    budgets = [running_budget(r["kv"], r["max_new_tokens"], r["outputs"]) for r in reqs]
    reserved = [reservable(budgets, room, per_slot) for room in rooms]
    out = []
    for rank, room in enumerate(rooms):
        line = {"kind": "join", **_about(rank, "j1"), "lens": [r["kv"] for r in reqs],
                "budgets": budgets, "per_slot": per_slot, "room": room,
                "reserved": reserved[rank], "joined": joinable(reserved), "ms": 3.0}
        if rank == 0:
            line["requests"] = reqs
        out.append(line)
    return out


def _upgrade_joins() -> list[dict]:
    rows = [[0, 0, 0, 380], [359, 40, 359, 390]]  # engine 1 holds the request
    limits = {"per_slot": 2, "engine_slots": 400, "context_limit": 8191}
    total = upgrade_total(rows, 1, *limits.values())
    return [{"kind": "upgrade_join", **_about(rank, "u1"), "rid": "long", "holder": 1,
             "rows": rows, **limits, "total": total, "room": 390, "reserved": 1, "joined": 1}
            for rank in (0, 1)]


def _lines(*docs: dict) -> list[str]:
    return [json.dumps(d) for d in docs]


def test_the_pure_join_and_upgrade_decisions_at_their_bounds():
    assert running_budget(60, 200, 21) == 60 + 179 + ADMISSION_SLACK
    assert running_budget(60, 200, 200) == 60 + 1 + ADMISSION_SLACK  # at least one more token
    assert reservable([10, 10], 10, 2) == 2  # 5 + 5 whole slots: exactly the room
    assert reservable([11, 2], 6, 2) == 1  # 6 slots, then 1 more does not fit
    assert reservable([30, 2], 10, 2) == 0  # a member stops at the first that does not fit
    assert joinable([2, 1]) == 1 and joinable([]) == 0
    rows = [[0, 0, 0, 200], [300, 40, 355, 250]]  # pools 2 * 200 - slack = 396 tokens
    assert upgrade_total(rows, 1, 2, 400, 8191) == 396
    assert upgrade_total([rows[0], [300, 40, 356, 250]], 1, 2, 400, 8191) == 0  # 396-40 = 356
    assert upgrade_total([rows[0], [0, 40, 300, 250]], 1, 2, 400, 8191) == 0  # request gone
    assert upgrade_total(rows, 1, 2, 400, 300) == 0  # the model's context bounds it


def test_moves_replay_to_the_same_assignment_and_shares():
    lines = _moves()
    assert lines[0]["owners"] == [1, 0, 1] and [x["requests"] for x in lines] == [1, 2]
    refused = {"kind": "move", **_about(0), "lens": [500], "rooms": [400, 400],
               "loads": [0, 0], "owners": None}
    got = replay.replay_log(_lines(*lines, refused), None, None)
    assert got.counts["move"] == 3 and got.diffs == []

    wrong = _moves()
    wrong[1]["owners"] = wrong[0]["owners"] = [0, 0, 1]  # not what assign gives
    got = replay.replay_log(_lines(*wrong), None, None)
    assert got.differing("move") == 2 and "assign gives [1, 0, 1]" in got.diffs[0][2]

    short = _moves()
    short[0]["tokens"] -= 1  # a member landed other tokens than the assignment gave it
    assert "landed" in replay.replay_log(_lines(*short), None, None).diffs[0][2]

    apart = _moves()
    apart[1]["loads"] = [0, 1]  # the members did not share the same values
    texts = [d[2] for d in replay.replay_log(_lines(*apart), None, None).diffs]
    assert any("members logged loads" in t for t in texts), texts


def test_joins_replay_budgets_reservations_and_the_min():
    lines = _joins()
    assert [x["reserved"] for x in lines] == [2, 1] and lines[0]["joined"] == 1
    got = replay.replay_log(_lines(*lines), None, None)
    assert got.counts["join"] == 2 and got.diffs == []

    budget = _joins()
    budget[0]["requests"][0]["outputs"] = 20  # its budget was computed from other inputs
    assert "budgets" in replay.replay_log(_lines(*budget), None, None).diffs[0][2]

    room = _joins()
    room[1]["room"] = 1000  # this room reserves both
    assert "reserves 2" in replay.replay_log(_lines(*room), None, None).diffs[0][2]

    too_many = _joins()
    for line in too_many:
        line["joined"] = 2  # more than a member reserved
    texts = [d[2] for d in replay.replay_log(_lines(*too_many), None, None).diffs]
    assert any("reserved 1" in t for t in texts) and any("reserved for 1" in t for t in texts)

    alone = _joins()[:1]  # one member's line only: checked on its own, no MIN
    assert replay.replay_log(_lines(*alone), None, None).diffs == []

    both = _joins()  # a join from both members: engine 1 held the second candidate
    both[1]["requests"], both[0]["requests"] = both[0]["requests"][1:], both[0]["requests"][:1]
    assert replay.replay_log(_lines(*both), None, None).diffs == []
    both[1]["requests"][0]["kv"] = 60  # not a candidate of the shared list
    assert "not among" in replay.replay_log(_lines(*both), None, None).diffs[0][2]


def test_upgrade_joins_replay_the_new_total_and_reservations():
    lines = _upgrade_joins()
    assert lines[0]["total"] == 760 - ADMISSION_SLACK
    assert replay.replay_log(_lines(*lines), None, None).diffs == []
    stays = {**lines[0], "rows": [[0, 0, 0, 10], [359, 40, 359, 10]], "total": 0}
    for key in ("room", "reserved", "joined"):
        del stays[key]
    assert replay.replay_log(_lines(stays), None, None).diffs == []  # it stays in DP
    wrong = _upgrade_joins()
    wrong[0]["total"] = wrong[1]["total"] = 800
    assert replay.replay_log(_lines(*wrong), None, None).differing("upgrade_join") == 2
    small = _upgrade_joins()
    small[1]["room"] = 100  # cannot reserve the request's total
    assert "reserves 0" in replay.replay_log(_lines(*small), None, None).diffs[0][2]


def test_upgrades_replay_through_the_policy():
    policy = Policy(CONFIG, NODE)
    asks = [replay.record_upgrade(h, policy.upgrade(h), rid=f"r{h}") for h in (0, 1)]
    got = replay.replay_log([HEAD, *asks], CONFIG, NODE)
    assert got.counts["upgrade"] == 2 and got.diffs == []
    lied = replay.record_upgrade(1, Decision("dp", 1, "no"), rid="r")
    got = replay.replay_log([HEAD, lied], CONFIG, NODE)
    assert got.diffs == [(1, "upgrade", "logged dp/1 (no) -> replayed tp/2 (long context)")]
    assert replay.replay_log([lied], None, None).diffs[0][2].startswith("no head line")


def _placement(policy: Policy, prompt: int) -> str:
    req, loads = Request(prompt, 8), [EngineLoad(0, 0, 0), EngineLoad(1, 0, 0)]
    return replay.record(req, loads, policy.decide(req, loads), rid=f"p{prompt}")


def test_a_log_of_every_kind_replays_and_main_reports_each(tmp_path, capsys):
    policy = Policy(CONFIG, NODE)
    upgrade = replay.record_upgrade(1, policy.upgrade(1), rid="long")
    lines = [HEAD, _placement(policy, 10), upgrade, *_lines(*_moves(), *_joins(),
                                                              *_upgrade_joins())]
    log = tmp_path / "decisions.jsonl"
    log.write_text("\n".join(lines) + "\n")
    assert replay.main([str(log)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["place: 1 replayed, 0 differ", "upgrade: 1 replayed, 0 differ",
                   "move: 2 replayed, 0 differ", "join: 2 replayed, 0 differ",
                   "upgrade_join: 2 replayed, 0 differ", "8 decisions replayed, 0 differ"]
    bad = _moves(bind="b2")
    bad[0]["requests"] = bad[1]["requests"] = 3
    log.write_text("\n".join([*lines, *_lines(*bad)]) + "\n")
    assert replay.main([str(log)]) == 1
    out = capsys.readouterr().out
    assert "move: 4 replayed, 2 differ" in out and "line 10 (move)" in out


def test_an_old_log_of_placements_replays_as_before(tmp_path, capsys):
    """Lines without a kind, the head first: the format before layout changes."""
    policy = Policy(CONFIG, NODE)
    lines = [_placement(policy, n) for n in (10, 2000, 390)]
    assert all("kind" not in json.loads(x) for x in lines)
    assert replay.replay(lines, CONFIG, NODE) == (3, [])
    log = tmp_path / "old.jsonl"
    log.write_text("\n".join([HEAD, *lines]) + "\n")
    assert replay.main([str(log)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "place: 3 replayed, 0 differ"
    assert replay.main([str(log), "--config", '{"policy": "static-tp"}']) == 1
    assert "line 2 (place): logged dp/1" in capsys.readouterr().out


def _append(path: str, who: int, n: int) -> None:
    out = layout_log.Appender(path)
    for i in range(n):
        out.line(json.dumps({"who": who, "i": i, "pad": "x" * (20_000 + who)}))


def test_lines_of_several_processes_stay_whole(tmp_path):
    """Lines larger than any buffer, from four processes at once: each one whole."""
    path = str(tmp_path / "log.jsonl")
    layout_log.Appender(path, truncate=True).line("{}")
    procs = [multiprocessing.get_context("fork").Process(target=_append, args=(path, w, 50))
             for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    docs = [json.loads(x) for x in open(path).read().splitlines()[1:]]
    assert sorted((d["who"], d["i"]) for d in docs) == [(w, i) for w in range(4) for i in range(50)]


def test_nothing_is_written_without_a_log_and_a_failed_write_never_raises(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(layout_log, "_APPENDER", None)
    monkeypatch.setattr(layout_log, "_PATH", "")
    layout_log.configure("")
    assert not layout_log.enabled()
    layout_log.write("move", {"x": 1})
    assert layout_log._APPENDER is None  # not even opened
    layout_log.configure(str(tmp_path / "missing" / "log.jsonl"))
    layout_log.write("move", {"x": 1})  # cannot open: logged, dropped
    layout_log.write("move", {"x": object()})  # cannot encode: logged, dropped
    layout_log.configure(str(tmp_path / "l"))
    layout_log.write("join", {"x": 2})
    doc = json.loads((tmp_path / "l").read_text())
    assert doc["kind"] == "join" and doc["x"] == 2 and doc["t"] > 0


def test_a_log_that_is_not_there_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        replay.main([str(tmp_path / "missing.jsonl")])
    assert done.value.code == 2 and "cannot read the log" in capsys.readouterr().err
