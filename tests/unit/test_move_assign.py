"""Where a group's moved requests land: the least loaded member with room, same on all."""

from __future__ import annotations

import pytest

from flying.session.move import assign

pytestmark = pytest.mark.unit


def test_requests_spread_over_members_by_dp_load():
    # 4 requests, both members with room; the leader already runs 1 DP request
    assert assign([100, 100, 100, 100], rooms=[10_000, 10_000], loads=[1, 0]) == [1, 0, 1, 0]


def test_ties_go_to_the_lowest_rank():
    assert assign([50], rooms=[1000, 1000], loads=[0, 0]) == [0]


def test_a_member_without_room_takes_none():
    # the request needs its KV plus one decode token: 100 + 1 > 100
    assert assign([100, 10], rooms=[100, 1000], loads=[0, 5]) == [1, 0]


def test_a_request_that_fits_nowhere_refuses_the_move():
    assert assign([500, 10], rooms=[400, 400], loads=[0, 0]) is None


def test_room_is_used_up_by_earlier_requests():
    assert assign([300, 300, 300], rooms=[602, 301], loads=[0, 0]) == [0, 1, 0]
