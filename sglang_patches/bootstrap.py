"""Hooks on ``sglang.srt.distributed.bootstrap``.

``_init_cpu_threads_env`` (AROUND): SGLang's version needs sgl_kernel CPU ops; on
Flying's CPU platform we pin the engine to its share of cores with plain
``os.sched_setaffinity`` + ``torch.set_num_threads``. Elsewhere the original runs.
"""

from __future__ import annotations

import logging

from flying.node.config import get_config, wants_cpu_platform
from flying.substrate import cpu_threads

logger = logging.getLogger(__name__)


def init_cpu_threads_env(original, *, local_omp_cpuid=None, dist_init_method=None):
    if not wants_cpu_platform():
        return original(local_omp_cpuid=local_omp_cpuid, dist_init_method=dist_init_method)
    cores = (
        cpu_threads.parse_cpu_list(local_omp_cpuid)
        if local_omp_cpuid
        else cpu_threads.visible_cores()
    )
    threads = cpu_threads.pin_this_process(cores, get_config().cpu_threads)
    logger.info("flying: engine pinned to cores %s with %d torch threads", cores, threads)
