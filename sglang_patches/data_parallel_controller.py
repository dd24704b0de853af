"""Hooks on ``sglang.srt.managers.data_parallel_controller.DataParallelController``.

- ``__init__`` (after): a ``BindIssuer`` for the node's TP degrees and the policy; the
  receive socket waits in ``zmq.poll`` when idle instead of spinning a core
  (``flying.node.idle_wait``) and also binds the address engines send their ``Upgrade``
  asks to (so asks and requests arrive in one order); the request dispatcher shows
  Flying each ``AbortReq`` (placement records of aborted requests are deleted) and
  turns each ``Upgrade`` into binds (``flying.session.upgrade``).
- ``dispatching_with_trace`` (around): a request marked for TP (explicit header,
  priority, long context: decided in the HTTP process), or one the adaptive policy
  places in TP from the engines' load snapshots, becomes one Bind per group member,
  sent in this process's single order; every other request is dispatched by SGLang,
  and where its round robin chose the engine, Flying reads which one afterwards (the
  conversation index: ``flying.node.turns``). Either way the engine that answers the
  request counts it in flight until its load snapshot shows it
  (``flying.node.in_flight``).

Containment: the controller is one process for the whole node, so nothing Flying does
here may raise into SGLang's event loop. Any exception while deciding or sending is
logged and the request is dispatched as plain DP by SGLang's original.
"""

from __future__ import annotations

import logging

from flying.node import controller as flying_controller
from flying.node.idle_wait import BlockingWhenIdle
from flying.session.messages import Upgrade, upgrade_endpoint

logger = logging.getLogger(__name__)


def init(result, controller, *args, **kwargs):
    flying_controller.attach(controller)
    sock = getattr(controller, "recv_from_tokenizer", None)  # absent on node_rank > 0
    if sock is not None:
        if controller._flying_issuer is not None:
            sock.bind(upgrade_endpoint())
        controller.recv_from_tokenizer = BlockingWhenIdle(sock)
    dispatcher = getattr(controller, "_request_dispatcher", None)
    if dispatcher is not None:
        controller._request_dispatcher = _FlyingDispatcher(controller, dispatcher)


class _FlyingDispatcher:
    """SGLang's TypeBasedDispatcher, with a look at each AbortReq first; engines'
    ``Upgrade`` asks (pickled) are Flying's own and end here."""

    def __init__(self, controller, dispatcher):
        self.controller = controller
        self.dispatcher = dispatcher

    def __call__(self, obj):
        from sglang.srt.managers.io_struct import AbortReq, PickleWrapper, unwrap_from_pickle

        if isinstance(obj, (PickleWrapper, Upgrade)):
            ask = unwrap_from_pickle(obj) if isinstance(obj, PickleWrapper) else obj
            if isinstance(ask, Upgrade):
                return _upgrade(self.controller, ask)
        if isinstance(obj, AbortReq):
            try:
                flying_controller.on_abort(self.controller, obj)
            except Exception:  # noqa: BLE001 - containment
                logger.exception("flying: abort bookkeeping failed; continuing")
        return self.dispatcher(obj)

    def __getattr__(self, name):  # add_fallback_fn and the like
        return getattr(self.dispatcher, name)


def dispatching_with_trace(original, controller, req, *args, **kwargs):
    try:
        binds = flying_controller.binds_for(controller, req)
    except Exception:  # noqa: BLE001 - containment: decide DP, keep the controller up
        logger.exception(
            "flying: placing request %s failed; dispatching it in DP", getattr(req, "rid", "?")
        )
        flying_controller.strip_marker(req)
        binds = []
    if not binds:
        mark = flying_controller.round_robin_mark(controller)
        with flying_controller.dispatching(controller):
            result = original(controller, req, *args, **kwargs)
        flying_controller.dispatched(controller, req, mark)
        return result
    if not _send(controller, binds):
        return original(controller, req, *args, **kwargs)
    flying_controller.sent(controller, binds)


def _upgrade(controller, ask: Upgrade) -> None:
    try:
        binds = flying_controller.upgrade_binds_for(controller, ask)
        if binds:
            _send(controller, binds)
    except Exception:  # noqa: BLE001 - containment: the request ends in DP
        logger.exception("flying: upgrading request %s failed; it stays in DP", ask.rid)


def _send(controller, binds) -> bool:
    """Send every member its bind, the leader last: if any send fails before the leader
    has its bind, no session can start (the others time out and abort) and the request is
    dispatched in DP instead (False). Once the leader has it, the group owns it."""
    leader = binds[0][1].ranks[0]
    ordered = [b for b in binds if b[0] != leader] + [b for b in binds if b[0] == leader]
    distinct = {id(b): b for _, b in ordered}  # every member gets the same Bind
    try:
        encoded = {key: _encode(b) for key, b in distinct.items()}  # once, before any send
    except Exception:  # noqa: BLE001 - containment
        logger.exception("flying: encoding binds %s failed; dispatching in DP",
                         [b.bind_id for b in distinct.values()])
        return False
    # The sends back to back: a member woken by its bind can take the controller's core
    # (each engine is pinned to its own), so encoding between two sends let the first
    # member reach its boundary ~1 ms before the leader and wait there for it.
    for rank, bind in ordered:
        try:
            controller.workers[rank].send(encoded[id(bind)])
        except Exception:  # noqa: BLE001 - containment
            logger.exception(
                "flying: sending bind %s to engine %d failed; dispatching request %s in DP",
                bind.bind_id, rank, bind.rid,
            )
            return False
    return True


def _encode(obj) -> bytes:
    """The bytes SGLang's ``sock_send`` puts on the wire for ``obj`` (wrapped as a pickle),
    so that one encoding serves every member."""
    import pickle

    from sglang.srt.managers import io_struct

    wrapped = io_struct.wrap_as_pickle(obj)
    if io_struct._USE_PICKLE_IPC:  # sock_send's send_pyobj
        return pickle.dumps(wrapped, protocol=pickle.HIGHEST_PROTOCOL)
    return io_struct.msgpack_encode(wrapped)
