"""The test and benchmark launcher notices a server whose HTTP port was taken."""

from __future__ import annotations

import pytest

from workloads.measure import server as launcher

pytestmark = pytest.mark.unit


class _Running:
    def poll(self):
        return None


def test_a_port_taken_before_the_server_bound_it_is_reported_at_once(tmp_path):
    """SGLang logs the failed bind and its process tree stays up unserved (a fixture
    once waited out the whole start-up timeout for it): ``wait_ready`` says so at once,
    and the fixtures start the server again on another port."""
    srv = launcher.Server.__new__(launcher.Server)
    srv.port, srv.url, srv.log_path = 1, "http://127.0.0.1:1", tmp_path / "server.log"
    srv._log = open(srv.log_path, "w")  # noqa: SIM115 - closed below
    srv.proc = _Running()
    try:
        srv._log.write("[t] ERROR:    [Errno 98] error while attempting to bind on address "
                       "('127.0.0.1', 1): address already in use\n")
        with pytest.raises(launcher.PortInUse):
            srv.wait_ready(30)
    finally:
        srv._log.close()


def test_stop_lets_the_launcher_s_children_finish_before_killing_them(tmp_path):
    """Engines outlive their launcher by their clean-up (their shared-memory outboxes
    are unlinked on SIGTERM): ``stop`` waits for the group's live members, up to
    STRAGGLER_S, before it SIGKILLs what is left."""
    import subprocess
    import time

    marker = tmp_path / "cleaned"
    srv = launcher.Server.__new__(launcher.Server)
    srv._log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed by stop
    # the leader exits at once; its child finishes a short clean-up after it
    srv.proc = subprocess.Popen(
        ["bash", "-c", f"(sleep 0.5; touch {marker}) & exit 0"], start_new_session=True)
    srv.proc.wait()
    started = time.monotonic()
    srv.stop()
    assert marker.exists()  # the child was not killed mid clean-up
    assert time.monotonic() - started < launcher.STRAGGLER_S
    assert not launcher._live_members(srv.proc.pid)
