"""TP copies of a model's decoder layers, swapped in as one attribute.

Why: the TP state's layer entries (``weight_views.layer_toggle``: per-instance forwards
and per-rank head counts) are ~11 per decoder layer, and an engine enters and leaves the
TP state around every group step (DP steps run between them): ~350 exchanges per
enter on a 32-layer model, ~900 per step, against one here. On a CPU host woken from its
idle sleep each exchange runs cold, and entering was a third of a bind's critical path.

What is made (once per degree, at start-up): for each decoder layer that an entry
touches, a shallow copy of every object on the path from the layer down to the entry's
object (``nn.Module`` copies get their own child registry, so the originals keep
theirs), the entries applied to the copies, and a copy of the ``nn.ModuleList`` holding
the copied layers. Parameters, buffers and everything off those paths are shared with
the originals: no weight is copied, and the originals are never written, so DP mode is
SGLang's untouched model. The one entry swaps the list on its parent module.

Invariant: equivalent to entering the per-object entries for every call that reaches
the layers through the list (SGLang's model forwards: ``self.layers[i](...)``). Objects
off the copied paths that hold a reference to a copied object would see the original:
``shadow`` returns None (the caller keeps the per-object entries) when an entry's object
is not reachable from a layer of one ``ModuleList`` by attributes.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

Entry = tuple[object, str, object]


def _paths(root: nn.Module) -> dict[int, tuple[str, ...]]:
    """id(object) -> attribute path from ``root``, for every module and every plain
    (non-module, non-tensor) object a module holds in its ``__dict__``."""
    paths: dict[int, tuple[str, ...]] = {}
    for name, module in root.named_modules():
        path = tuple(name.split(".")) if name else ()
        paths.setdefault(id(module), path)
        for attr, value in vars(module).items():
            plain = hasattr(value, "__dict__") and not isinstance(value, nn.Module | torch.Tensor)
            if plain and not attr.startswith("_"):
                paths.setdefault(id(value), (*path, attr))
    return paths


def _child(obj: object, name: str) -> object:
    return obj._modules[name] if isinstance(obj, nn.Module) and name in obj._modules else getattr(obj, name)


def _copy(obj: object) -> object:
    new = copy.copy(obj)
    if isinstance(obj, nn.Module):
        new.__dict__["_modules"] = type(obj._modules)(obj._modules)  # its own child registry
    return new


def _attach(parent: object, name: str, child: object) -> None:
    if isinstance(parent, nn.Module) and name in parent._modules:
        parent._modules[name] = child
    else:
        object.__setattr__(parent, name, child)


def shadow(root: nn.Module, entries: list[Entry]) -> Entry | None:
    """The one entry (list's parent, attribute, list of TP copies) equivalent to
    ``entries``, or None if they do not all lie under the layers of one ``ModuleList``."""
    if not entries:
        return None
    paths = _paths(root)
    located: list[tuple[tuple[str, ...], str, object]] = []
    list_path: tuple[str, ...] | None = None
    for obj, name, value in entries:
        path = paths.get(id(obj))
        if path is None:
            return None
        cut = next((i for i in range(len(path)) if isinstance(_resolve(root, path[:i]), nn.ModuleList)), None)
        if cut is None or (list_path is not None and path[:cut] != list_path):
            return None
        list_path = path[:cut]
        located.append((path, name, value))
    holder = _resolve(root, list_path[:-1]) if list_path else None
    if not isinstance(holder, nn.Module) or not list_path:
        return None
    layers = _copy(_resolve(root, list_path))
    copies: dict[tuple[str, ...], object] = {list_path: layers}
    for path, name, value in located:
        target = _copied(root, path, copies)
        if isinstance(target, nn.Module):
            setattr(target, name, value)
        else:  # plain objects, frozen dataclasses included
            object.__setattr__(target, name, value)
    return holder, list_path[-1], layers


def _resolve(root: object, path: tuple[str, ...]) -> object:
    obj = root
    for name in path:
        obj = _child(obj, name)
    return obj


def _copied(root: nn.Module, path: tuple[str, ...], copies: dict) -> object:
    """The copy of the object at ``path``, copying (and attaching) every object on the
    way down from the copied list."""
    if path in copies:
        return copies[path]
    parent = _copied(root, path[:-1], copies)
    new = _copy(_child(parent, path[-1]))
    _attach(parent, path[-1], new)
    copies[path] = new
    return new
