"""The status board: engines' status documents in shared memory (``status_board``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from flying.session import publishing, status
from flying.session.engine import FlyingEngine
from flying.substrate import status_board

pytestmark = pytest.mark.unit


@pytest.fixture
def board(tmp_path, monkeypatch):
    """A 2-slot board in ``tmp_path``, attached to this process as the launcher's is."""
    monkeypatch.setenv(status_board.ENV, "unset")  # restored after the test
    monkeypatch.setattr(status_board, "_ATTACHED", None)
    monkeypatch.setattr(status_board, "_ATTACHED_PATH", None)
    return status_board.create(2, shm_dir=tmp_path)


def test_a_slot_reads_back_the_last_document_and_nothing_before_the_first(board):
    assert board.read(0) is None and board.read(1) is None
    board.write(1, "first")
    board.write(1, '{"rank": 1, "mode": "dp"}')
    assert board.read(1) == '{"rank": 1, "mode": "dp"}' and board.read(0) is None
    assert int(board._words[1][0]) == 4  # two writes: seq even, 2 per write


def test_a_document_past_its_slot_is_refused_and_the_old_one_kept(board):
    board.write(0, "kept")
    with pytest.raises(ValueError):
        board.write(0, "x" * status_board.SLOT_BYTES)
    assert board.read(0) == "kept"


def test_a_torn_read_is_never_returned(board, monkeypatch):
    monkeypatch.setattr(status_board, "READ_TRIES", 3)
    board.write(0, "whole")
    words = board._words[0]
    words[0] += 1  # a write in progress (seq odd)
    assert board.read(0) is None
    words[0] += 1
    assert board.read(0) == "whole"
    start = board._data(0)
    board.mm[start:start + 1] = b"W"  # bytes changed under an unchanged seq: checksum
    assert board.read(0) is None


WRITER = """
import sys
from flying.substrate import status_board
board = status_board.attached()
assert board is not None and board.slots == 2
i = 0
while board.read(0) != "stop":  # until the reader has seen enough, however it is scheduled
    board.write(1, f"{i}:" + "x" * (i % 5000))
    i += 1
board.write(1, "done")
"""


def test_another_process_writing_while_this_one_reads_yields_only_whole_documents(board):
    """A writer process (found through the environment, as an engine finds it) rewrites
    its slot with documents of changing length; every read here is one of them."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER], env=dict(os.environ))
    seen = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and seen < 2000:
        doc = board.read(1)
        if doc is not None:
            seen += 1
            i, _, rest = doc.partition(":")
            assert rest == "x" * (int(i) % 5000), doc[:20]
    board.write(0, "stop")
    assert proc.wait(30) == 0
    assert board.read(1) == "done" and seen == 2000


def test_create_sweeps_the_board_of_a_killed_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv(status_board.ENV, "unset")
    monkeypatch.setattr(status_board, "_ATTACHED", None)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{status_board.PREFIX}{dead.pid}_0000"
    stale.write_bytes(b"")
    mine = tmp_path / f"{status_board.PREFIX}{os.getpid()}_1111"
    mine.write_bytes(b"")
    status_board.create(1, shm_dir=tmp_path)
    assert not stale.exists() and mine.exists()
    assert os.environ[status_board.ENV].startswith(str(tmp_path / status_board.PREFIX))


class Store:
    def __init__(self, docs: dict[str, str]):
        self.docs = docs

    def check(self, keys):
        return all(k in self.docs for k in keys)

    def get(self, k):
        return self.docs[k].encode()

    def set(self, k, v):
        self.docs[k] = v


def test_read_all_takes_the_board_and_the_store_for_a_slot_never_written(board):
    board.write(0, json.dumps({"rank": 0, "mode": "tp2/0", "binds": 3}))
    store = Store({status.key(1): json.dumps({"rank": 1, "mode": "dp", "binds": 1})})
    doc = status.read_all(store, 2)
    assert [e["mode"] for e in doc["engines"]] == ["tp2/0", "dp"]
    assert doc["totals"]["binds"] == 4 and doc["bound_modes"] == ["tp2/0"]


def _busy_engine(monkeypatch, store):
    engine = FlyingEngine(dp_rank=0, pool=None, bind_timeout_s=1.0)
    engine.pool = SimpleNamespace(store=store, members={})
    busy = SimpleNamespace(waiting_queue=["r"], running_batch=SimpleNamespace(is_empty=lambda: True))
    idle = SimpleNamespace(waiting_queue=[], running_batch=SimpleNamespace(is_empty=lambda: True))
    return engine, busy, idle


def test_becoming_busy_builds_no_document_falling_idle_and_events_do(board, monkeypatch):
    """The step that serves a request arriving at an idle engine is not held up by a
    status document; falling idle publishes at once (nothing steps after), and so does a
    session starting (its mode and bind count); all of it to the board, none to the
    store."""
    built = []
    monkeypatch.setattr(status, "document",
                        lambda rank, eng, sched: built.append(rank) or f"doc{len(built)}")
    store = Store({})
    engine, busy, idle = _busy_engine(monkeypatch, store)
    engine.publish(busy)
    assert built == []
    engine._status_at -= publishing.STATUS_EVERY_S  # a busy engine's timed refresh
    engine.publish(busy)
    assert built == [0] and board.read(0) == "doc1"
    engine.publish(idle)
    assert board.read(0) == "doc2"
    engine.publish(idle)  # still idle, not due: nothing
    assert len(built) == 2
    engine.session = SimpleNamespace(bind=SimpleNamespace(degree=2))  # a bind: an event
    engine.publish(busy)
    assert board.read(0) == "doc3"
    engine.publish(busy)  # in the session, not due: nothing
    assert len(built) == 3 and store.docs == {}


def test_without_a_board_the_engine_writes_to_the_store(monkeypatch):
    monkeypatch.delenv(status_board.ENV, raising=False)
    monkeypatch.setattr(status, "document", lambda rank, eng, sched: "doc")
    store = Store({})
    engine, _, idle = _busy_engine(monkeypatch, store)
    engine.publish(idle, force=True)
    assert store.docs == {status.key(0): "doc"}


def test_the_file_goes_once_every_engine_wrote_and_the_controller_mapped(board):
    path = status_board._ATTACHED_PATH
    thread = status_board.unlink_when_mapped(poll_s=0.01)
    board.write(0, "e0")
    board.write(1, "e1")
    time.sleep(0.1)
    assert os.path.exists(path)  # the DP controller has not mapped it yet
    board.mark_reader()
    thread.join(5)
    assert not thread.is_alive() and not os.path.exists(path)
    board.write(0, "after")  # the mapping lives on
    assert board.read(0) == "after"
