"""Hook on ``sglang.srt.entrypoints.http_server`` (HTTP process).

- ``_wait_and_warmup`` (around): after SGLang's own warm-up (in DP), run Flying's
  start-up probe (``flying.node.probe``): one group forward per TP degree compared with DP;
  TP groups open only if all match. /health answers 503 until the probe has decided, so
  a client that waits for health never sees the gate still closed for probing. The
  hook wraps the warm-up function SGLang hands in (its default argument is bound at
  import, so patching ``_execute_server_warmup`` itself would not take effect).
"""

from __future__ import annotations

from flying.node import probe
from flying.node.config import get_config
from flying.substrate.comm_pool import hosted_store


def wait_and_warmup(original, *args, **kwargs):
    from sglang.srt.entrypoints import http_server

    warmup = kwargs.get("execute_warmup_func") or http_server._execute_server_warmup
    kwargs["execute_warmup_func"] = lambda server_args: _warmup_then_probe(warmup, server_args)
    return original(*args, **kwargs)


def _warmup_then_probe(warmup, server_args) -> bool:
    ok = warmup(server_args)
    store = hosted_store()
    if not ok or store is None:  # not the launcher's process: nothing to probe
        return ok
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.tokenizer_manager import ServerStatus

    manager = http_server._global_state.tokenizer_manager
    status, manager.server_status = manager.server_status, ServerStatus.Starting
    try:
        probe.run(server_args.url(), get_config().degree_list() or [], store,
                  server_args.dp_size)
    finally:
        manager.server_status = status
    return ok
