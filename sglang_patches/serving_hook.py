"""Resolution hook on ``sglang.srt.arg_groups.serving_hook.handle_missing_default_values``.

On the CPU platform SGLang's own default device is a ``torch.device`` (from the OOT
platform), which the step then ``.split``s; we default it to the string "cpu" first.
We also give each engine its own share of the cores (SGLANG_CPU_OMP_THREADS_BIND)
when there is more than one rank, since SGLang's default binds one NUMA node per rank.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from flying.node.config import wants_cpu_platform
from flying.substrate import cpu_threads

logger = logging.getLogger(__name__)

STEP = "handle_missing_default_values"
BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def handle_missing_default_values(server_args: Any, previous) -> None:
    if wants_cpu_platform():
        from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

        cfg = resolving_view(server_args)
        if cfg.device is None:
            declare_resolution(server_args, "flying_cpu_platform", device="cpu")
        ranks = cfg.dp_size * cfg.tp_size * cfg.pp_size
        if ranks > 1 and BIND_ENV not in os.environ:
            shares = cpu_threads.split_cores(cpu_threads.visible_cores(), ranks)
            os.environ[BIND_ENV] = cpu_threads.bind_spec(shares)
            logger.info("flying: %s=%s", BIND_ENV, os.environ[BIND_ENV])
    previous(server_args)
