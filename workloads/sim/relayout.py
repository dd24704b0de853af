"""What a session does with requests beyond stepping: take its bind, admit, join, move.

Each follows the engine code it models (``flying.session.lifecycle``, ``admission``,
``join``, ``move``, ``upgrade``) and decides with the same pure functions
(``scheduler.relayout``: ``assign``, ``running_budget``, ``reservable``,
``joinable``; ``flying.session.budget.kv_tokens_needed``), so that the "move" and
"join" lines it writes replay with ``python -m scheduler.replay``.

- taking a bind: every member reserves the request's KV (``kv_tokens_needed``:
  prompt + max_new_tokens + admission slack, in slots of ``per_slot`` tokens); if one
  cannot, the leader runs the request in DP. An upgrade's bind takes the running DP
  request from its holder instead, with its KV;
- admission: the same-group binds at the head of the leader's queue (at most
  ``MAX_ADMITS`` a boundary) join while every member can reserve; the first that
  cannot closes admission for the session (it runs in a later session, in order);
- join (a forming session whose bind may move, no member but the leader with DP
  requests waiting or being prefilled): the members' running DP requests, in rank
  order, join with their KV, as many as every member can reserve;
- move (a session that may move, DP requests arrived at a member during it, every
  request decoding; ``node`` keeps the marks): the requests go to DP on the members by
  ``assign``; refused, it retries ``RETRY_STEPS`` group steps later. A move costs the
  profile's ``move_ms`` plus ``move_ms_per_ktok`` per 1k tokens of context, during which
  the members run nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flying.session.budget import kv_tokens_needed
from flying.session.exchange import MAX_ADMITS
from scheduler.relayout import MAX_JOIN, assign, joinable, reservable, running_budget
from workloads.sim.batching import SimRequest

if TYPE_CHECKING:
    from workloads.sim.node import SimNode
    from workloads.sim.parts import Bind, Session

#: ``flying.session.move.RETRY_STEPS`` (that module needs torch): group steps a
#: session waits after a refused move.
RETRY_STEPS = 8
MOVED_REASON = "moved to DP with its KV: DP work arrived"


def per_slot(degree: int, kv_heads: int) -> int:
    """Tokens of a group one DP slot holds: the degree, or the KV heads when a group
    replicates them (``Node.capacity``, ``kv_adaptor.tokens_per_slot``)."""
    return min(degree, kv_heads) if kv_heads else degree


def may_move(mode: str, reasons: set[str]) -> bool:
    """``flying.session.move.allowed``: which sessions hand their requests to DP."""
    return mode == "all" or (mode == "policy" and bool(reasons) and reasons <= {"policy"})


def ready(s: Session) -> bool:
    """``move.ready``: every request of the session is decoding."""
    b = s.server
    return (not b.waiting and b.chunk is None and not b.prefilling and bool(b.running)
            and b.last_kind != "prefill")


def _place(node: SimNode, s: Session, req: SimRequest, reason: str, slots: int) -> None:
    req.slots, req.where, req.reason = slots, s, reason
    req.degree, req.ranks, req.queued_at = s.bind.degree, s.ranks, node.loop.now
    s.server.waiting.append(req)
    s.reasons.add(reason)


def _need(node: SimNode, s: Session, req: SimRequest) -> int:
    return s.slots(kv_tokens_needed(req.prompt, req.max_new, node.profile.max_req_len))


def take_bind(node: SimNode, s: Session, bind: Bind) -> bool:
    """The members' vote on ``bind``: True if the session starts with its request."""
    if bind.upgrade is not None:
        return _take_upgrade(node, s, bind)
    req = bind.req
    if req is None or req.done:  # aborted by its client: voted down
        return False
    if not s.grow(_need(node, s, req)):
        node.queue_dp(s.members[0], req,
                      f"TP-{bind.degree} group did not form: a member cannot reserve its KV")
        return False
    _place(node, s, req, bind.reason, _need(node, s, req))
    return True


def _take_upgrade(node: SimNode, s: Session, bind: Bind) -> bool:
    req, holder = bind.upgrade, node.engines[bind.holder]
    if req is None or req.done or req.where is not holder or req not in holder.dp.running:
        return False
    need = _need(node, s, req)
    if not s.grow(need):
        return False  # it goes on in DP, to its engine's limit
    holder.dp.remove(req)
    holder.dp_used -= req.slots
    req.slots, req.where, req.moved = need, s, f"joined a TP-{bind.degree} group: long context"
    s.server.running.append(req)
    s.reasons.add(bind.reason)
    s.extra_ms += node.switch.relayout(req.kv_len)
    node.counters["upgrades"] += 1
    return True


def offers(s: Session) -> list:
    """The same-group binds at the head of the leader's queue (``admission.candidates``):
    what a boundary offers before its batch is formed (``exchange.offer``) and admits."""
    out = []
    for b in s.members[0].pending:
        if b.ranks != s.ranks or b.degree != s.bind.degree or b.upgrade is not None:
            break
        out.append(b)
        if len(out) == MAX_ADMITS:
            break
    return out


def admit(node: SimNode, s: Session, offered: list) -> None:
    """Admit the ``offered`` binds (``admission.admit``), in order, while
    every member can reserve their KV (else admission closes for the session)."""
    for b in offered:
        if b not in s.members[0].pending:
            break  # taken meanwhile (it formed its own session, or was aborted)
        req = b.req
        if req is None or req.done:
            break  # an aborted request is not admitted; its bind forms (and aborts) later
        need = _need(node, s, req)
        if not s.grow(need):
            s.admitting = False
            break
        for m in s.members:
            m.pending.remove(b)
        b.formed = True
        _place(node, s, req, b.reason, need)


def _about(s: Session, rank: int) -> dict:
    """``layout_log.about``: the fields every layout-change line carries."""
    return {"bind": s.bind.id, "degree": s.bind.degree, "ranks": list(s.ranks), "rank": rank}


def _write(node: SimNode, kind: str, doc: dict) -> None:
    if node.log is not None:
        node.log({"kind": kind, "t": round(node.loop.now, 6), **doc})


def join(node: SimNode, s: Session) -> None:
    """The members' running DP requests join the forming session (``join.gather``):
    every member's, in rank order, at most ``MAX_JOIN``; none where a member other than
    the leader has DP requests waiting or being prefilled."""
    if not may_move(node.move_to_dp, {s.bind.reason}):
        return
    if any(m.dp.waiting or m.dp.chunk is not None or m.dp.prefilling for m in s.members[1:]):
        return
    picked = [(m, r) for m in s.members for r in m.dp.running][:MAX_JOIN]
    if not picked:
        return
    lens = [r.kv_len for _, r in picked]
    budgets = [running_budget(r.kv_len, r.max_new, r.out) for _, r in picked]
    rooms = [m.free() for m in s.members]
    reserved = [reservable(budgets, room, s.per_slot) for room in rooms]
    k = joinable(reserved)
    ms = node.switch.relayout(sum(lens[:k]))
    for m, room, n in zip(s.members, rooms, reserved, strict=True):
        doc = {**_about(s, m.rank), "lens": lens, "budgets": budgets, "per_slot": s.per_slot,
               "room": room, "reserved": n, "joined": k}
        own = [r for holder, r in picked if holder is m]
        if own:
            doc["requests"] = [{"rid": r.rid, "kv": r.kv_len, "max_new_tokens": r.max_new,
                                "outputs": r.out} for r in own]
        if k:
            doc.update(ms=round(ms, 3), tokens=sum(lens[:k]))
        _write(node, "join", doc)
    for (holder, req), budget in zip(picked[:k], budgets[:k], strict=True):
        holder.dp.remove(req)
        holder.dp_used -= req.slots
        need = s.slots(budget)
        grown = s.grow(need)
        assert grown, "every member reserved for the joining requests"
        req.slots, req.where = need, s
        req.moved = f"joined a TP-{s.bind.degree} group with its KV"
        s.server.running.append(req)
    s.extra_ms += ms
    node.counters["joins"] += k


def move(node: SimNode, s: Session) -> bool:
    """The session's requests go on in DP on its members (``move.to_dp``); False if
    one may grow beyond one engine or fits on no member (the session goes on)."""
    reqs = list(s.server.running)
    if any(r.budget > node.profile.max_req_len for r in reqs):
        return False
    lens = [r.kv_len for r in reqs]
    rooms = [m.free() + s.reserved for m in s.members]
    loads = [sum(m.dp.load()) for m in s.members]
    owners = assign(lens, rooms, loads)
    decision = {"lens": lens, "rooms": rooms, "loads": loads, "owners": owners}
    if owners is None:
        _write(node, "move", {**_about(s, s.members[0].rank), **decision})
        return False
    ms = node.switch.relayout(sum(lens))
    s.server.running = []
    for req, owner in zip(reqs, owners, strict=True):
        m = s.members[owner]
        req.slots, req.where, req.moved = req.budget, m, MOVED_REASON
        m.dp_used += req.budget
        m.dp.running.append(req)
    for i, m in enumerate(s.members):
        mine = [n for n, o in zip(lens, owners, strict=True) if o == i]
        _write(node, "move", {**_about(s, m.rank), **decision, "requests": len(mine),
                              "tokens": sum(mine), "ms": round(ms, 3)})
    node.counters["moves"] += 1
    node.release(s, ms)
    return True
