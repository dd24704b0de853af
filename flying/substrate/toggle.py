"""Attribute toggles: the one mechanism behind every mode switch.

A ``Toggle`` holds (object, attribute, other value) entries. ``enter()`` puts every
other value in place and keeps the current one; ``leave()`` puts the kept values back
(in reverse order). Both are exchanges, so state that changed while entered (a running
batch, a queue, a capacity) is kept for the next ``enter()``: one toggle switches an
engine between its DP state and its TP state any number of times within one session,
at the cost of a few hundred attribute writes, with nothing rebuilt.

Invariant: a toggle is entered at most once at a time; ``leave()`` of a toggle not
entered is a no-op, so ``finally`` blocks may always call it. ``MISSING`` stands for
"no instance attribute" (a class attribute shows through): entering deletes, leaving
restores.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


def _get(obj: object, name: str) -> object:
    own = getattr(obj, "__dict__", None)
    if own is not None and not _is_slot(obj, name):
        return own.get(name, MISSING)
    return getattr(obj, name, MISSING)


def _is_slot(obj: object, name: str) -> bool:
    return any(name in getattr(cls, "__slots__", ()) for cls in type(obj).__mro__)


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


class Toggle:
    """A set of attribute exchanges entered and left as one (see the module docstring)."""

    def __init__(self, entries: list[tuple[object, str, object]] | None = None):
        self._entries: list[list] = [[obj, name, value] for obj, name, value in entries or ()]
        self.entered = False

    def add(self, obj: object, name: str, value: object) -> None:
        """Add an entry; while entered, it takes effect at once."""
        entry = [obj, name, value]
        self._entries.append(entry)
        if self.entered:
            self._exchange(entry)

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
        obj, name, value = entry
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
