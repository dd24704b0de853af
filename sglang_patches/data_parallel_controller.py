"""Hooks on ``sglang.srt.managers.data_parallel_controller.DataParallelController``.

- ``__init__`` (after): a ``BindIssuer`` for the node's TP degrees and the policy; the
  receive socket waits in ``zmq.poll`` when idle instead of spinning a core
  (``flying.idle_wait``).
- ``dispatching_with_trace`` (around): a request marked for TP (explicit header,
  priority, long context: decided in the HTTP process), or one the adaptive policy
  places in TP from the engines' load snapshots, becomes one Bind per group member,
  sent in this process's single order; every other request is dispatched by SGLang.
"""

from __future__ import annotations

from flying import controller as flying_controller
from flying.idle_wait import BlockingWhenIdle


def init(result, controller, *args, **kwargs):
    flying_controller.attach(controller)
    sock = getattr(controller, "recv_from_tokenizer", None)  # absent on node_rank > 0
    if sock is not None:
        controller.recv_from_tokenizer = BlockingWhenIdle(sock)


def dispatching_with_trace(original, controller, req, *args, **kwargs):
    binds = flying_controller.binds_for(controller, req)
    if not binds:
        return original(controller, req, *args, **kwargs)
    from sglang.srt.managers.io_struct import sock_send, wrap_as_pickle

    for rank, bind in binds:
        sock_send(controller.workers[rank], wrap_as_pickle(bind))
