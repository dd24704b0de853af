"""The test tier's server launcher: a re-export of ``workloads.measure.server``.

One launcher serves tests and benchmarks alike (``workloads/measure/server.py``); this
module keeps ``from tests.server import Server, free_port`` working. A server is started
once per test session (fixtures in conftest.py) because SGLang takes ~40-60 s to come up
on a small machine.
"""

from __future__ import annotations

from workloads.measure.server import (
    STARTUP_TIMEOUT_S,
    Server,
    ServerFailed,
    free_port,
    start_server,
)

__all__ = ["STARTUP_TIMEOUT_S", "Server", "ServerFailed", "free_port", "start_server"]
