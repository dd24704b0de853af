"""Attribute toggles: the one mechanism behind every mode switch.

A ``Toggle`` holds (object, attribute, other value) entries. ``enter()`` puts every
other value in place and keeps the current one; ``leave()`` puts the kept values back
(in reverse order). Both are exchanges, so state that changed while entered (a running
batch, a queue, a capacity) is kept for the next ``enter()``: one toggle switches an
engine between its DP state and its TP state any number of times within one session,
at the cost of a few hundred attribute writes, with nothing rebuilt.

Speed: a bind enters two toggles (the TP state's ~35 entries and the layers', one
entry since the layers are swapped as copies: ``shadow_layers``; ~11 a layer before),
and an engine enters and leaves them around every group step, so each exchange matters. An entry whose attribute lives in the object's ``__dict__`` (no slot, no data
descriptor on the class, not one of an ``nn.Module``'s registered parameters, buffers or
submodules) is exchanged in that dict directly, decided once when the entry is added:
``setattr`` on an ``nn.Module`` walks its registries, and the generic path walks the
class's MRO for slots on every exchange (together ~5 us an entry, ~0.5 ms a bind).

Invariant: a toggle is entered at most once at a time; ``leave()`` of a toggle not
entered is a no-op, so ``finally`` blocks may always call it. ``MISSING`` stands for
"no instance attribute" (a class attribute shows through): entering deletes, leaving
restores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import torch


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


def _get(obj: object, name: str) -> object:
    own = getattr(obj, "__dict__", None)
    if own is not None and not _is_slot(obj, name) and not _managed(obj, name):
        return own.get(name, MISSING)
    return getattr(obj, name, MISSING)


def _managed(obj: object, name: str) -> bool:
    """Whether ``name`` is not a plain instance attribute: a data descriptor on the class
    (a property) or an ``nn.Module``'s registered parameter, buffer or submodule."""
    if _descriptor_of(type(obj), name):
        return True
    if isinstance(obj, torch.nn.Module):
        return any(name in r for r in (obj._parameters, obj._buffers, obj._modules))
    return False


def _is_slot(obj: object, name: str) -> bool:
    return _slot_of(type(obj), name)


@functools.cache
def _slot_of(cls: type, name: str) -> bool:
    """Whether ``name`` is a slot of ``cls`` (classes do not change slots: cached)."""
    return any(name in getattr(c, "__slots__", ()) for c in cls.__mro__)


def _put(obj: object, name: str, value: object) -> None:
    try:
        if value is MISSING:
            if _get(obj, name) is not MISSING:
                delattr(obj, name)
        else:
            setattr(obj, name, value)
    except dataclasses.FrozenInstanceError:  # SGLang components that are frozen dataclasses
        if value is MISSING:
            object.__delattr__(obj, name)
        else:
            object.__setattr__(obj, name, value)


@functools.cache
def _descriptor_of(cls: type, name: str) -> bool:
    """Whether ``cls.name`` is a data descriptor (a property): cached per class."""
    on_class = getattr(cls, name, None)
    return hasattr(on_class, "__set__") or hasattr(on_class, "__delete__")


def _own_dict(obj: object, name: str, value: object) -> dict | None:
    """``obj.__dict__`` if exchanging ``name`` there equals ``setattr``/``delattr`` for
    both sides' values, else None (see "Speed" in the module docstring)."""
    own = getattr(obj, "__dict__", None)
    if not isinstance(own, dict) or _is_slot(obj, name) or _managed(obj, name):
        return None
    if isinstance(obj, torch.nn.Module) and any(
        isinstance(v, torch.nn.Module | torch.Tensor) for v in (value, own.get(name))
    ):
        return None  # setattr would register it
    return own


class Toggle:
    """A set of attribute exchanges entered and left as one (see the module docstring)."""

    def __init__(self, entries: list[tuple[object, str, object]] | None = None):
        self._entries: list[list] = []
        self.entered = False
        for obj, name, value in entries or ():
            self.add(obj, name, value)

    def add(self, obj: object, name: str, value: object) -> None:
        """Add an entry; while entered, it takes effect at once."""
        entry = [obj, name, value, _own_dict(obj, name, value)]
        self._entries.append(entry)
        if self.entered:
            self._exchange(entry)

    def reload(self, start: int, entries: list[tuple[object, str, object]]) -> None:
        """Set the other values of the entries from index ``start`` on (not entered), so
        that a toggle built once is reused with new values: ``entries`` name the same
        (object, attribute) pairs in the same order as when they were added."""
        if self.entered:
            raise RuntimeError("toggle reloaded while entered")
        for entry, (obj, name, value) in zip(self._entries[start:], entries, strict=True):
            if entry[0] is not obj or entry[1] != name:
                raise ValueError(f"toggle entry {name!r} reloaded out of order")
            entry[2] = value
            if isinstance(obj, torch.nn.Module):  # where it is exchanged depends on the value
                entry[3] = _own_dict(obj, name, value)

    def other(self, obj: object, name: str) -> object:
        """The value ``obj.name`` has on the side that is not current."""
        for entry in reversed(self._entries):
            if entry[0] is obj and entry[1] == name:
                return entry[2]
        raise KeyError(name)

    def enter(self) -> None:
        if self.entered:
            raise RuntimeError("toggle entered twice")
        for entry in self._entries:
            self._exchange(entry)
        self.entered = True

    def leave(self) -> None:
        if not self.entered:
            return
        for entry in reversed(self._entries):
            self._exchange(entry)
        self.entered = False

    @staticmethod
    def _exchange(entry: list) -> None:
        obj, name, value, own = entry
        if own is not None:
            entry[2] = own.get(name, MISSING)
            if value is MISSING:
                own.pop(name, None)
            else:
                own[name] = value
            return
        entry[2] = _get(obj, name)
        _put(obj, name, value)

    def __len__(self) -> int:
        return len(self._entries)


@contextlib.contextmanager
def entered(*toggles: Toggle) -> Iterator[None]:
    """Enter ``toggles`` in order for the block; leave them in reverse in ``finally``."""
    done: list[Toggle] = []
    try:
        for t in toggles:
            t.enter()
            done.append(t)
        yield
    finally:
        for t in reversed(done):
            t.leave()
