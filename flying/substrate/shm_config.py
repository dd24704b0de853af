"""How the shared-memory collectives (``flying.substrate.shm_allreduce``) are set up:
whether they are used at all, each rank's slot size, and how a rank waits for its peers.

Environment (read where a group's segment is created):

- ``FLYING_SHM_ALLREDUCE=0``: gloo for every collective (no shared segment);
- ``FLYING_SHM_ALLREDUCE_BYTES``: the slot per rank and parity (default 4 MiB); larger
  tensors take gloo;
- ``FLYING_SHM_ALLREDUCE_TIMEOUT_S``, ``FLYING_SHM_ALLREDUCE_SPIN_US``: ``WaitPolicy``.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

ENV_ENABLE = "FLYING_SHM_ALLREDUCE"  # "0" disables the shared path (gloo everywhere)
ENV_BYTES = "FLYING_SHM_ALLREDUCE_BYTES"  # slot size per rank
ENV_TIMEOUT = "FLYING_SHM_ALLREDUCE_TIMEOUT_S"
ENV_SPIN_US = "FLYING_SHM_ALLREDUCE_SPIN_US"
DEFAULT_SLOT_BYTES = 4 << 20


def enabled() -> bool:
    """Whether the shared path may be used at all (x86-64 only, not disabled by env)."""
    return os.environ.get(ENV_ENABLE, "1") != "0" and platform.machine() in ("x86_64", "AMD64")


@dataclass(frozen=True)
class WaitPolicy:
    """How a rank waits for its peers.

    Spin for ``spin_s`` (peers on other cores arrive within microseconds), then
    ``sched_yield`` until ``yield_s`` (lets a peer sharing this core run), then sleep with
    exponential backoff up to ``max_sleep_s`` (a descheduled or busy peer costs no core),
    and raise ``ShmAllReduceError`` after ``timeout_s``.
    """

    spin_s: float = 50e-6
    yield_s: float = 2e-3
    first_sleep_s: float = 20e-6
    max_sleep_s: float = 1e-3
    timeout_s: float = 120.0

    @classmethod
    def from_env(cls, **overrides: float) -> WaitPolicy:
        kw: dict[str, float] = {}
        if os.environ.get(ENV_TIMEOUT):
            kw["timeout_s"] = float(os.environ[ENV_TIMEOUT])
        if os.environ.get(ENV_SPIN_US):
            kw["spin_s"] = float(os.environ[ENV_SPIN_US]) * 1e-6
        kw.update(overrides)
        return cls(**kw)


def slot_bytes_from_env() -> int:
    return int(os.environ.get(ENV_BYTES, DEFAULT_SLOT_BYTES))
