"""Hooks on ``sglang.srt.managers.data_parallel_controller.DataParallelController``.

- ``__init__`` (after): a ``BindIssuer`` for the node's TP degrees.
- ``dispatching_with_trace`` (around): a request marked for TP becomes one Bind per
  group member, sent in this process's single order; every other request is
  dispatched by SGLang unchanged.
"""

from __future__ import annotations

from flying.config import get_config
from flying.controller import BindIssuer
from flying.messages import unmark


def init(result, controller, *args, **kwargs):
    degrees = get_config().degree_list() or []
    controller._flying_issuer = BindIssuer(controller.server_args.dp_size, degrees) if degrees else None


def dispatching_with_trace(original, controller, req, *args, **kwargs):
    degree, _ = unmark(getattr(req, "routing_key", None))
    issuer = getattr(controller, "_flying_issuer", None)
    if not degree or issuer is None:
        return original(controller, req, *args, **kwargs)
    from sglang.srt.managers.io_struct import sock_send, wrap_as_pickle

    for rank, bind in issuer.make_binds(req, degree):
        sock_send(controller.workers[rank], wrap_as_pickle(bind))
