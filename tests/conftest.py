"""Shared fixtures. Integration servers start once per session: SGLang takes ~40-60 s."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from workloads.measure.server import PortInUse, Server

#: KV slots per engine in the shared server; small so "too long" prompts are cheap.
MAX_TOTAL_TOKENS = 2048
#: A server environment whose steps (DP and TP-2) each take 4 ms longer (the test-only
#: ``flying.session.faults.step_delays``): tests that need a request still running when
#: the next one arrives (moves, joins) must not depend on how fast the machine decodes
#: (the demo model: ~200-1000 tokens/s).
SLOWER = {"FLYING_TEST_STEP_DELAY_MS": "1:4,2:4"}


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    from flying.node.demo_model import ensure_demo_model

    return ensure_demo_model()


def serve(log: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """A ``python -m flying.launch`` server with ``args`` for a fixture (``yield from``).
    Started again on another port if its port was taken before it bound it (a race of
    ``free_port`` with other processes' ephemeral sockets, not the system under test)."""
    for attempt in range(3):
        server = Server(list(args), log, env=env)
        try:
            server.wait_ready()
            break
        except PortInUse:
            server.stop()
            if attempt == 2:
                raise
        except BaseException:
            server.stop()
            raise
    try:
        yield server
    finally:
        server.stop()


def demo_server(
    model_dir: Path, log: Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """The demo model on 2 engines, for a fixture.

    Normal requests stay DP (``static-dp``: deterministic routing for the tests);
    priority and long-context requests still switch to TP. A TP-2 group is slower per
    step than one engine on the demo model, so the policy would keep priority requests
    in DP; ``--flying-tp-gain -10`` lets them into groups, whose mechanics these tests
    exercise (``test_adaptive`` runs the measured-cost policy with its default).
    """
    yield from serve(
        log, "--model-path", str(model_dir), "--dp-size", "2",
        "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--flying-policy", "static-dp",
        "--flying-tp-gain", "-10", *extra,
        env=env,
    )


@pytest.fixture(scope="session")
def dp2_server(demo_model_dir: Path, tmp_path_factory) -> Iterator[Server]:
    """The shared server of the integration tier (hard preemption, the default), with
    the test-only fault switch mounted (it does nothing until a test arms a fault)."""
    yield from demo_server(
        demo_model_dir, tmp_path_factory.mktemp("dp2") / "server.log", "--enable-metrics",
        env={"FLYING_TEST_FAULTS": "1"},
    )


def pytest_collection_modifyitems(config, items):
    """Unit tests first; then integration modules that start their own servers, before
    the shared ``dp2_server`` comes up, so two servers never compete for the 2 cores."""

    def tier(item) -> int:
        if item.get_closest_marker("integration") is None:
            return 0
        return 2 if "dp2_server" in getattr(item, "fixturenames", ()) else 1

    items.sort(key=tier)
