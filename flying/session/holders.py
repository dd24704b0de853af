"""Every SGLang component that holds a given object, found by scanning attributes.

SGLang hands the tree cache, the KV allocator and the pool size to several scheduler
components at construction (result processor, output streamer, load inquirer, ...). A TP
session (``flying.session.tp_scope``) must swap every such reference, and a list kept by
hand would break silently on an SGLang upgrade; so the holders are found once, at engine
start-up, by looking one level into the scheduler's ``sglang.*`` attributes.
"""

from __future__ import annotations


def components(root) -> list[object]:
    """``root`` and its direct ``sglang.*`` components, each once."""
    holders, seen = [], set()
    for value in [root, *_attrs(root).values()]:
        module = type(value).__module__ or ""
        if (value is root or module.startswith("sglang.")) and id(value) not in seen:
            seen.add(id(value))
            holders.append(value)
    return holders


def references(root, targets: dict[int, object]) -> list[tuple[object, str, object]]:
    """(holder, attribute, targets' value) for every attribute of ``root`` and of its direct
    components that refers to one of ``targets`` (keyed by ``id`` of the object to
    replace)."""
    return [
        (holder, name, targets[id(value)])
        for holder in components(root)
        for name, value in _attrs(holder).items()
        if id(value) in targets
    ]


def pool_size_holders(root) -> list[object]:
    """``root`` and the components holding their own copy of ``max_total_num_tokens``
    (pool-usage observer, load inquirer, invariant checker, ...): in a session they must
    all see the session's pool, or usage = 1 - free/size goes negative and SGLang's
    metrics assert."""
    size = root.max_total_num_tokens
    return [h for h in components(root) if _attrs(h).get("max_total_num_tokens") == size]


def _attrs(obj) -> dict[str, object]:
    """``obj``'s instance attributes, ``__slots__`` included."""
    out = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                out[name] = getattr(obj, name)
    return out
