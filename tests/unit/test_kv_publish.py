"""A move's rows published in the sender's outbox and adopted by the taker at its own
pace (``flying.substrate.kv_publish``, ``flying.session.handoff``): the taker's rows
equal the sender's, a block is read only once it is whole, the outbox is reused and
grows, the sender's steps while the rows were in flight reach the taker, and the taker
answers the requests exactly when the leader published."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from flying.session import handoff
from flying.substrate import kv_publish, shm_segment

pytestmark = pytest.mark.unit

LAYERS, ROWS, HEADS, DIM = 3, 64, 2, 8


def _pool(seed: int, heads: int = HEADS, dtype=torch.float32) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        k_buffer=[torch.randn(ROWS, heads, DIM, generator=g).to(dtype) for _ in range(LAYERS)],
        v_buffer=[torch.randn(ROWS, heads, DIM, generator=g).to(dtype) for _ in range(LAYERS)],
    )


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_segment, "SHM_DIR", tmp_path)
    return tmp_path


def _adopt(inbox, pool, n, address, timeout_s=5.0, failed=lambda: None):
    generation, seq = address
    return inbox.adopt(pool, n, os.getpid(), generation, seq, timeout_s, failed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adopted_rows_are_the_senders_rows_in_token_order(shm_dir, dtype):
    sender, dp = _pool(1, dtype=dtype), _pool(2, heads=2 * HEADS, dtype=dtype)
    outbox, inbox = kv_publish.Outbox(shm_dir), kv_publish.Inbox(shm_dir)
    src = torch.tensor([5, 6, 7, 2, 30])  # two runs and a stray row
    address = outbox.ready_for(kv_publish.block_bytes(sender, 5))
    assert outbox.publish(sender, src, steps=40, keep_s=30) == address[1]
    adoption = _adopt(inbox, sender, 5, address)
    dst = torch.tensor([9, 1, 12, 13, 14])
    adoption.write_into(dp, dst, slice(HEADS, 2 * HEADS))
    for layer in range(LAYERS):
        for buf, own in ((dp.k_buffer, sender.k_buffer), (dp.v_buffer, sender.v_buffer)):
            assert torch.equal(buf[layer][dst][:, HEADS:], own[layer][src])
    untouched = _pool(2, heads=2 * HEADS, dtype=dtype)
    assert torch.equal(dp.k_buffer[0][dst][:, :HEADS], untouched.k_buffer[0][dst][:, :HEADS])
    for steps in (41, 44):  # the sender's boundaries while the rows are in flight
        assert outbox.note(steps)
    adoption.take()
    assert adoption.peer_steps == 4
    assert outbox.free and not outbox.note(45)  # taken: nothing more to note
    # The next move reuses the same outbox (and the taker's mapping of it).
    again = outbox.ready_for(kv_publish.block_bytes(sender, 2))
    assert again == (address[0], address[1] + 1)
    outbox.publish(sender, torch.tensor([3, 4]), 50, 30)
    second = _adopt(inbox, sender, 2, again)
    assert torch.equal(second.block[1, 1], sender.v_buffer[1][torch.tensor([3, 4])])
    second.take()
    assert len(list(shm_dir.iterdir())) == 1
    outbox.close()
    inbox.close()
    assert not list(shm_dir.iterdir())


def test_the_taker_writes_each_layer_while_the_sender_still_writes_the_next(shm_dir, monkeypatch):
    sender, dp = _pool(3), _pool(4, heads=2 * HEADS)
    outbox, inbox = kv_publish.Outbox(shm_dir), kv_publish.Inbox(shm_dir)
    src, dst = torch.tensor([8, 9, 10, 40]), torch.tensor([1, 2, 3, 4])
    address = outbox.ready_for(kv_publish.block_bytes(sender, 4))
    get_rows, seen = kv_publish.kv_relayout.get_rows, []

    def slow_get_rows(buf, rows, out):  # the sender's copy of each layer takes a while
        time.sleep(0.02)
        get_rows(buf, rows, out)

    def slow_put_rows(buf, rows, src_rows):  # what the sender had written by then
        seen.append(int(outbox.header[kv_publish._LAYERS]))
        put_rows(buf, rows, src_rows)

    put_rows = kv_publish.kv_relayout.put_rows
    monkeypatch.setattr(kv_publish.kv_relayout, "get_rows", slow_get_rows)
    monkeypatch.setattr(kv_publish.kv_relayout, "put_rows", slow_put_rows)
    sending = threading.Thread(target=outbox.publish, args=(sender, src, 0, 30))
    sending.start()
    adoption = _adopt(inbox, sender, 4, address)
    adoption.write_into(dp, dst, slice(0, HEADS))
    adoption.take()
    sending.join()
    for layer in range(LAYERS):
        assert torch.equal(dp.k_buffer[layer][dst][:, :HEADS], sender.k_buffer[layer][src])
        assert torch.equal(dp.v_buffer[layer][dst][:, :HEADS], sender.v_buffer[layer][src])
    assert seen[0] < LAYERS  # the first layer was written before the last was published
    assert seen == sorted(seen) and all(n > i // 2 for i, n in enumerate(seen))


def test_a_block_not_yet_ready_is_waited_for_then_refused_with_the_reason(shm_dir):
    pool = _pool(1)
    outbox, inbox = kv_publish.Outbox(shm_dir), kv_publish.Inbox(shm_dir)
    address = outbox.ready_for(kv_publish.block_bytes(pool, 3))  # no publish yet
    with pytest.raises(RuntimeError, match="timed out"):
        _adopt(inbox, pool, 3, address, timeout_s=0.05)
    with pytest.raises(RuntimeError, match="poisoned"):
        _adopt(inbox, pool, 3, address, failed=lambda: "poisoned")
    with pytest.raises(RuntimeError, match="timed out"):  # no such outbox at all
        inbox.adopt(pool, 3, os.getpid(), address[0] + 5, 1, 0.05)


def test_a_block_of_another_length_is_refused(shm_dir):
    pool = _pool(1)
    outbox, inbox = kv_publish.Outbox(shm_dir), kv_publish.Inbox(shm_dir)
    address = outbox.ready_for(kv_publish.block_bytes(pool, 3))
    outbox.publish(pool, torch.tensor([1, 2, 3]), 0, 30)
    with pytest.raises(RuntimeError, match="holds 3 tokens, expected 4"):
        _adopt(inbox, pool, 4, address)


def test_an_outbox_grows_for_a_larger_move_or_while_busy_and_frees_past_its_deadline(
    shm_dir, monkeypatch
):
    monkeypatch.setattr(kv_publish, "FIRST_BYTES", 4096)
    pool, outbox = _pool(1), kv_publish.Outbox(shm_dir)
    first = outbox.ready_for(kv_publish.block_bytes(pool, 2))
    bigger = outbox.ready_for(kv_publish.block_bytes(pool, ROWS))
    assert bigger[0] == first[0] + 1
    assert [p.name for p in shm_dir.iterdir()] == [kv_publish.path_for(os.getpid(), bigger[0]).name]
    outbox.publish(pool, torch.tensor([1]), 0, keep_s=30)
    busy = outbox.ready_for(kv_publish.block_bytes(pool, 1))  # not taken: a new one
    assert busy[0] == bigger[0] + 1 and busy[1] == bigger[1] + 1
    outbox.publish(pool, torch.tensor([1]), 0, keep_s=0.0)
    assert not outbox.note(3) and outbox.free  # no taker can be waiting any more
    with pytest.raises(ValueError, match="outbox limit"):
        outbox.ready_for(kv_publish.MAX_BYTES + 1)


def test_a_dead_senders_outbox_is_swept_at_the_next_new_outbox(shm_dir):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = kv_publish.path_for(int(dead.stdout), 0, shm_dir)
    stale.write_bytes(b"x")
    kv_publish.Outbox(shm_dir).ready_for(0)
    assert not stale.exists()


class _Shm:
    def __init__(self):
        self.poison = False

    def poisoned(self) -> bool:
        return self.poison

    def peer_alive(self, peer: int) -> bool:
        return True


def _taker(rank: int, addresses, degree: int = 2) -> handoff.Taking:
    member = SimpleNamespace(tp_rank=rank, group=SimpleNamespace(degree=degree), shm=_Shm())
    return handoff.Taking(handoff.Mail(inbox=kv_publish.Inbox()), member, addresses, 5.0)


def test_the_taker_answers_once_the_leader_published_and_not_after_its_poison(shm_dir):
    pool, leader_mail = _pool(1), handoff.Mail(outbox=kv_publish.Outbox())
    generation, seq = leader_mail.outbox.ready_for(kv_publish.block_bytes(pool, 2))
    addresses = [(os.getpid(), generation, seq), (os.getpid(), -1, 0)]
    leader_mail.outbox.publish(pool, torch.tensor([3, 4]), 7, 30)
    taking = _taker(1, addresses)
    assert taking.resolve(pool, 2)  # the leader's rows came: it disowned them
    assert leader_mail.outbox.free  # and they were handed back
    poisoned = _taker(1, [(os.getpid(), generation, seq + 1), addresses[1]])
    poisoned.member.shm.poison = True  # the leader failed before publishing
    assert not poisoned.resolve(pool, 2)
    leader = _taker(0, addresses)
    leader.member.shm.poison = True  # its peer failed: the leader answers by the rule
    assert leader.resolve(pool, 2)
