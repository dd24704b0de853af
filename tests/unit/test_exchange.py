"""The per-step exchange: layout, lockstep check and the agreed end of a session."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flying.session import exchange

pytestmark = pytest.mark.unit


class _Leader:
    """A one-member stand-in for ``Member.share_ints``: the leader's values, summed own."""

    tp_rank = 0

    def __init__(self, others_own: int = 0, leader_values: list[int] | None = None):
        self.others_own = others_own
        self.leader_values = leader_values

    def share_ints(self, values, n, own=0):
        assert len(values) == n == exchange.WIDTH
        return list(self.leader_values or values), own + self.others_own


def _batch(lens, mode=2, last=(7,)):
    reqs = [SimpleNamespace(origin_input_ids=[1] * n, output_ids=list(last)) for n in lens]
    return SimpleNamespace(reqs=reqs, forward_mode=SimpleNamespace(value=mode))


def test_offers_aborts_and_counts_round_trip():
    got = exchange.exchange(_Leader(others_own=256 + 1), _batch([3, 4]), [11, 12], [99], True, False)
    assert got.offers == [11, 12] and got.aborts == [99]
    assert got.dp_waiting == 2 and got.busy == 1 and not got.done


def test_a_boundary_offer_is_the_leaders_and_capped():
    """``offer`` (before the batch is formed): every member gets the leader's binds,
    at most ``MAX_ADMITS`` of them; a member's own list is ignored."""

    class _Wire:
        tp_rank = 1

        def share_ints(self, values, n, own=0):
            assert len(values) == n == 1 + exchange.MAX_ADMITS
            return [2, 21, 22, *[0] * (n - 3)], own

    assert exchange.offer(_Wire(), [5, 6, 7]) == [21, 22]
    many = list(range(1, exchange.MAX_ADMITS + 20))

    class _Echo(_Wire):
        tp_rank = 0

        def share_ints(self, values, n, own=0):
            return list(values), own

    assert exchange.offer(_Echo(), many) == many[: exchange.MAX_ADMITS]
    assert exchange.offer(_Echo(), []) == []


def test_each_count_is_its_own_across_members():
    """DP work, busy, held and arrived are four counts summed over the members: a
    member with DP work that arrived during the session is told apart from one whose
    DP requests were there before (moved in by an earlier session)."""
    other = 1 + (1 << 24)  # the peer: DP work, arrived during the session
    got = exchange.exchange(_Leader(others_own=other), None, [], [], True, True, True, False)
    assert (got.dp_waiting, got.busy, got.dp_held, got.dp_arrived) == (2, 1, 1, 1)
    moved_in = exchange.exchange(_Leader(others_own=1), None, [], [], True, False)
    assert moved_in.dp_waiting == 2 and moved_in.dp_arrived == 0
    parking = exchange.exchange(_Leader(others_own=other + (1 << 32)), None, [], [], False,
                                True, parking=True)
    assert (parking.parking, parking.dp_arrived, parking.dp_waiting) == (2, 1, 1)


def test_session_ends_only_when_no_member_is_busy():
    idle = exchange.exchange(_Leader(), None, [], [], False, False)
    assert idle.done
    peer_busy = exchange.exchange(_Leader(others_own=256), None, [], [], False, False)
    assert not peer_busy.done  # a peer still has work: nobody leaves alone


def test_a_different_batch_or_token_is_a_lockstep_error():
    leader = exchange.signature(_batch([3, 4]))
    values = leader + [0] * (exchange.WIDTH - exchange.SIG)
    member = _Leader(leader_values=values)
    member.tp_rank = 1
    exchange.exchange(member, _batch([3, 4]), [], [], False, True)
    with pytest.raises(exchange.LockstepError):
        exchange.exchange(member, _batch([3]), [], [], False, True)
    with pytest.raises(exchange.LockstepError):  # same lengths, another token
        exchange.exchange(member, _batch([3, 4], last=(8,)), [], [], False, True)


def test_dp_held_is_counted_apart_from_dp_work_and_busy():
    peer = 1 + 256 + 65536  # a peer with DP work, session work, and DP held for KV
    got = exchange.exchange(_Leader(others_own=peer), None, [], [], True, True, True)
    assert (got.dp_waiting, got.busy, got.dp_held) == (2, 2, 2)
    alone = exchange.exchange(_Leader(), None, [], [], True, False)
    assert (alone.dp_waiting, alone.busy, alone.dp_held) == (1, 0, 0)
