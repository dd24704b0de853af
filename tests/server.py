"""Start and stop real ``python -m flying.launch`` servers for integration tests.

A server is started once per test session (fixtures in conftest.py) because SGLang
takes ~40-60 s to come up on this kind of machine. Its combined output goes to a log
file that tests read (e.g. for the per-process "flying: applied" lines).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

STARTUP_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``flying.node.launch`` process tree on 127.0.0.1."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "flying.node.launch", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), *args]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health_generate", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not ready in {timeout_s} s:\n{self.log_tail()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        lines = [ln for ln in self.log().splitlines() if "server_args=" not in ln]
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self._log.close()

    # -- request helpers ------------------------------------------------------------

    def post(self, path: str, payload: dict, timeout: float = 120, **kw) -> requests.Response:
        return requests.post(self.url + path, json=payload, timeout=timeout, **kw)

    def generate_ids(self, input_ids: list[int], max_new_tokens: int, **kw) -> dict:
        """Greedy generation on /generate; returns the JSON body (raises on HTTP error)."""
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
