"""``meta_info["flying"]`` is on every output, including those SGLang's
``_handle_batch_output`` hands to their consumers before it returns.

The handler below is a test double of SGLang's loop over a batch's outputs (append each
to its request's ``out_list``, wake its consumer, yield to the consumers every
``notify`` outputs); the hook under test is ``sglang_patches.tokenizer_manager``'s own.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from flying.node import config
from sglang_patches import tokenizer_manager as tm

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def cfg(monkeypatch):
    monkeypatch.setattr(config, "_CONFIG", config.FlyingConfig(tp_degrees="2").validate())


def _state(rid: str) -> SimpleNamespace:
    return SimpleNamespace(
        obj=SimpleNamespace(rid=rid, routing_key=None),
        out_list=[],
        event=asyncio.Event(),
        customized_info_accumulated={"flying": [{"degree": 2}]},  # the leader's report
        time_stats=None,
    )


async def _sglang_like(manager, recv_obj) -> None:
    for i, rid in enumerate(recv_obj.rids):
        state = manager.rid_to_state[rid]
        meta = {"id": rid, "dp_rank": recv_obj.dp_ranks[i],
                "finish_reason": recv_obj.finished[i]}
        state.out_list.append({"text": "x", "meta_info": meta})
        state.event.set()
        if (i + 1) % recv_obj.notify == 0:
            await asyncio.sleep(0)


async def _consume(state, sent: list[dict]) -> None:
    """A stream's consumer: takes the pending outputs (leaving a plain list, as SGLang's
    ``_wait_one_response`` does) and sends the newest at once (a copy: what the client
    gets is what the chunk held then)."""
    await state.event.wait()
    state.event.clear()
    outs, state.out_list = state.out_list, []
    sent.append(dict(outs[-1]["meta_info"]))


def _run(finished: list) -> list[dict]:
    async def main() -> list[dict]:
        rids = [f"r{i}" for i in range(len(finished))]
        manager = SimpleNamespace(rid_to_state={rid: _state(rid) for rid in rids})
        sent: list[dict] = []
        consumers = [asyncio.create_task(_consume(manager.rid_to_state[r], sent)) for r in rids]
        await asyncio.sleep(0)  # every consumer waits on its event
        recv = SimpleNamespace(rids=rids, dp_ranks=[0, 1] * len(rids), finished=finished,
                               notify=2)
        await tm.handle_batch_output(_sglang_like, manager, recv)
        await asyncio.gather(*consumers)
        return sent

    return asyncio.run(main())


def test_every_output_a_consumer_took_early_carries_where_it_ran():
    sent = _run([None] * 6)
    assert len(sent) == 6
    assert all(m.get("flying", {}).get("mode") == "tp" for m in sent), sent
    assert all(m["flying"]["ranks"] == [0, 1] for m in sent)


def test_a_finished_request_is_counted_once(monkeypatch):
    counted: list[tuple] = []
    monkeypatch.setattr(tm, "count_finished", lambda mode, prio: counted.append((mode, prio)))
    monkeypatch.setattr(tm, "observe_finished", lambda *a: None)
    sent = _run([{"type": "length"}] * 4)
    assert [m["flying"]["mode"] for m in sent] == ["tp"] * 4
    assert len(counted) == 4
