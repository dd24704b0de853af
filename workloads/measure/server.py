"""Start and stop real ``python -m flying.launch`` servers: the one launcher of the project.

Tests (``tests/conftest.py`` fixtures, ``tests/integration``), the comparison runner and the
benchmarks all start servers through this module, so start-up, readiness, log handling and
clean shutdown behave the same everywhere. The package must not import ``tests``; tests
import this module (``tests/server.py`` re-exports it for older imports).

A server runs in its own process group so that ``stop`` can end the whole tree (HTTP
server, tokenizer, detokenizer, DP controller, engines) even when its leader is gone, but
in the caller's session: on a kernel with session autogroup scheduling
(``/proc/sys/kernel/sched_autogroup_enabled``) a server in a session of its own would
compete with the benchmark client as one scheduling group, and its engines would lose
their cores for up to a second whenever the client is busy (stalls measured in both
Flying and plain SGLang that a server started from a shell does not show).
Its combined output goes to a log file that callers read (e.g. for "flying: applied" lines).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests

#: Generous: a 2-core machine shared with other servers may take minutes to start one.
STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
#: After the launcher exits, how long its engines get to finish their own clean-up (they
#: unlink their shared-memory outboxes on SIGTERM) before what is left is killed.
STRAGGLER_S = 5.0

#: Log lines left out of a log tail: the (very long) args dump, import warnings, C++ frames.
LOG_NOISE = ("server_args=", "warnings.warn", "UserWarning", "frame #")


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (the OS picks it; free when this returns)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: What SGLang's HTTP server logs when its port was taken between ``free_port`` and its
#: bind (another process's ephemeral socket); the process tree then stays up unserved.
BIND_FAILED = "error while attempting to bind on address"


class PortInUse(RuntimeError):
    """The server's HTTP port was taken before it bound it: start it again elsewhere."""


class Server:
    """One ``flying.node.launch`` process tree on 127.0.0.1, started on construction."""

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.args = list(args)
        self.command = [sys.executable, "-m", "flying.node.launch", "--host", "127.0.0.1",
                        "--port", str(self.port), *self.args]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,  # a background group must never read the terminal
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            process_group=0,  # its own group, the caller's session (module docstring)
        )

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> float:
        """Seconds until ``/health_generate`` answers 200 (it runs one real generation).

        Raises RuntimeError (with the log tail) when the server exits first, TimeoutError
        when it is not ready in ``timeout_s``.
        """
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            if BIND_FAILED in self.log():
                raise PortInUse(f"port {self.port} was taken before the server bound it")
            try:
                if requests.get(self.url + "/health_generate", timeout=10).status_code == 200:
                    return time.monotonic() - start
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not ready in {timeout_s:g} s:\n{self.log_tail()}")

    def log(self) -> str:
        """The server's whole output so far."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` meaningful lines of the output, for failure messages."""
        lines = [
            line for line in self.log().splitlines()
            if line.strip() and not any(noise in line for noise in LOG_NOISE)
        ]
        return "\n".join(line[:300] for line in lines[-n:])

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL what is left after a grace period."""
        if self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
        _await_group(self.proc.pid, STRAGGLER_S)
        try:  # children that outlived the leader are still in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not self._log.closed:
            self._log.close()

    # -- request helpers ------------------------------------------------------------

    def post(self, path: str, payload: dict, timeout: float = 120, **kw: Any) -> requests.Response:
        """POST JSON to ``path`` on this server."""
        return requests.post(self.url + path, json=payload, timeout=timeout, **kw)

    def generate_ids(self, input_ids: list[int], max_new_tokens: int, **kw: Any) -> dict:
        """Greedy generation on /generate, EOS ignored; the JSON body (raises on HTTP error)."""
        payload = {
            "input_ids": input_ids,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        resp = self.post("/generate", payload, **kw)
        resp.raise_for_status()
        return resp.json()


def _await_group(pgid: int, timeout_s: float) -> None:
    """Wait until no live process is left in group ``pgid``, at most ``timeout_s``
    (a zombie left for init to reap counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _live_members(pgid):
        time.sleep(0.1)


def _live_members(pgid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            return True
    return False


class ServerFailed(RuntimeError):
    """A server that did not come up; carries the tail of its log."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(message)
        self.log_tail = log_tail


def start_server(
    args: Sequence[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    port: int | None = None,
    retries: int = 0,
    timeout_s: float = STARTUP_TIMEOUT_S,
    on_retry: Any = None,
) -> tuple[Server, float]:
    """A ready server and its start-up seconds; retried when a signal killed it while starting.

    On a shared machine another user's cleanup may kill a starting server; that says nothing
    about the system under test, so it is retried (``retries`` times, ``on_retry(message)``
    told). A server that fails by itself (non-signal exit, timeout) raises ServerFailed.
    """
    for attempt in range(retries + 1):
        server = Server(args, log_path, env=env, port=port)
        try:
            return server, server.wait_ready(timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            code = server.proc.poll()
            tail = server.log_tail(30)
            server.stop()
            if isinstance(exc, PortInUse) and port is None and attempt < retries:
                if on_retry is not None:
                    on_retry(f"{exc}; retrying on another port")
                continue
            if code is None or code >= 0 or attempt == retries:
                raise ServerFailed(str(exc).split("\n", 1)[0], tail) from exc
            if on_retry is not None:
                on_retry(f"server killed by signal {-code} during start-up; retrying")
    raise AssertionError("unreachable")
