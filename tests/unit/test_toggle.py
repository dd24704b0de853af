"""Attribute toggles: the exchange semantics every mode switch relies on."""

from __future__ import annotations

import dataclasses

import pytest

from flying.substrate.toggle import MISSING, Toggle, entered

pytestmark = pytest.mark.unit


class Obj:
    cls_attr = "class"

    def __init__(self):
        self.queue = ["dp"]
        self.limit = 10


@dataclasses.dataclass(frozen=True)
class Frozen:
    size: int = 1


def test_enter_leave_restores_and_keeps_each_sides_state():
    o = Obj()
    t = Toggle([(o, "queue", ["tp"]), (o, "limit", 20)])
    t.enter()
    assert o.queue == ["tp"] and o.limit == 20
    o.queue.append("tp2")  # the TP side's state changes while entered
    o.limit = 21
    t.leave()
    assert o.queue == ["dp"] and o.limit == 10
    o.queue.append("dp2")  # and the DP side's while left
    t.enter()
    assert o.queue == ["tp", "tp2"] and o.limit == 21
    t.leave()
    assert o.queue == ["dp", "dp2"] and t.other(o, "limit") == 21


def test_missing_instance_attribute_shows_the_class_one_again():
    o = Obj()
    t = Toggle([(o, "cls_attr", "instance")])
    with entered(t):
        assert o.cls_attr == "instance"
    assert o.cls_attr == "class" and "cls_attr" not in vars(o)
    t2 = Toggle([(o, "queue", MISSING)])
    with entered(t2):
        assert not hasattr(o, "queue")
    assert o.queue == ["dp"]


def test_frozen_dataclass_duplicates_and_add_while_entered():
    f, o = Frozen(), Obj()
    t = Toggle([(f, "size", 2), (o, "limit", 1), (o, "limit", 2)])  # the same attribute twice
    t.enter()
    assert f.size == 2 and o.limit == 2
    t.add(o, "queue", [])
    assert o.queue == []
    t.leave()
    assert f.size == 1 and o.limit == 10 and o.queue == ["dp"]


def test_leave_is_idempotent_and_double_enter_refused():
    o = Obj()
    t = Toggle([(o, "limit", 5)])
    t.leave()
    assert o.limit == 10
    t.enter()
    with pytest.raises(RuntimeError):
        t.enter()
    t.leave()
    t.leave()
    assert o.limit == 10


def test_entered_restores_on_error():
    o = Obj()
    with pytest.raises(ValueError), entered(Toggle([(o, "limit", 99)])):
        assert o.limit == 99
        raise ValueError("boom")
    assert o.limit == 10


class WithProperty:
    def __init__(self):
        self._size = 1
        self.writes = 0

    @property
    def size(self):
        return self._size

    @size.setter
    def size(self, v):
        self.writes += 1
        self._size = v


def test_property_goes_through_its_setter():
    o = WithProperty()
    t = Toggle([(o, "size", 7)])
    with entered(t):
        assert o.size == 7
    assert o.size == 1 and o.writes == 2 and "size" not in vars(o)


def test_module_forward_and_registered_submodule():
    import torch

    lin = torch.nn.Linear(2, 2)
    outer = torch.nn.Sequential(lin)
    other = torch.nn.Linear(2, 2)
    t = Toggle([(lin, "forward", lambda x: x * 0), (outer, "0", other)])
    x = torch.ones(1, 2)
    with entered(t):
        assert torch.equal(lin(x), torch.zeros(1, 2))  # the instance forward is used
        assert outer[0] is other and dict(outer.named_children())["0"] is other
    assert "forward" not in vars(lin) and not torch.equal(lin(x), torch.zeros(1, 2))
    assert outer[0] is lin and dict(outer.named_children())["0"] is lin


def test_reload_gives_a_reused_toggle_new_other_values():
    """A session's TP state is one toggle per degree, reloaded with each session's
    fresh queues and limits: the entries before ``start`` keep their values."""
    o = Obj()
    shared = object()
    t = Toggle([(o, "pool", shared), (o, "queue", ["tp"]), (o, "limit", 20)])
    t.enter()
    o.queue.append("left over")
    t.leave()
    t.reload(1, [(o, "queue", []), (o, "limit", 30)])
    t.enter()
    assert o.pool is shared and o.queue == [] and o.limit == 30
    with pytest.raises(RuntimeError):
        t.reload(1, [(o, "queue", []), (o, "limit", 30)])  # entered
    t.leave()
    assert o.queue == ["dp"] and o.limit == 10 and not hasattr(o, "pool")
    with pytest.raises(ValueError):
        t.reload(1, [(o, "limit", 1), (o, "queue", [])])  # out of order
    with pytest.raises(ValueError):
        t.reload(1, [(o, "queue", [])])  # not every entry from start on
