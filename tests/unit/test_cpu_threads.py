from __future__ import annotations

import pytest

from flying.substrate.cpu_threads import bind_spec, parse_cpu_list, split_cores

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n_cores,ranks", [(2, 2), (2, 1), (16, 3), (1, 2), (5, 4)])
def test_split_is_contiguous_and_covers(n_cores, ranks):
    cores = list(range(n_cores))
    shares = split_cores(cores, ranks)
    assert len(shares) == ranks and all(shares)
    if n_cores >= ranks:
        assert [c for s in shares for c in s] == cores
        sizes = [len(s) for s in shares]
        assert max(sizes) - min(sizes) <= 1


def test_bind_spec_roundtrip():
    shares = split_cores(list(range(6)), 2)
    spec = bind_spec(shares)
    assert spec == "0,1,2|3,4,5"
    assert [parse_cpu_list(s) for s in spec.split("|")] == shares


def test_parse_ranges():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list([3, 1]) == [1, 3]
