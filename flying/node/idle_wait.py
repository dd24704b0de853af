"""Idle waiting for SGLang's DP controller: block in ``zmq.poll`` instead of spinning.

SGLang 0.5.23's ``DataParallelController.event_loop`` receives with ``zmq.NOBLOCK`` in a
tight loop, so the controller takes a whole core even when no request arrives. On a GPU
host that is one wasted core; on a CPU host it is a core the engines need: measured on
2 cores with 2 engines, the controller at 99% of a core while idle, and a TP-2 group
whose members sit on both cores running at about half speed, each member waiting ~50%
of its time for the one that shares a core with the controller.

``BlockingWhenIdle`` wraps the controller's receive socket: a non-blocking receive first
waits (``Socket.poll``) up to ``IDLE_WAIT_MS`` for a message. A message wakes it at once,
so dispatch latency is unchanged; with nothing to do the loop sleeps in the kernel. A
``--sleep-on-idle``-style fix inside SGLang's loop would make this unnecessary.
"""

from __future__ import annotations

import zmq

#: Longest a receive with nothing to read blocks before the loop goes round (the loop
#: feeds SGLang's soft watchdog each round).
IDLE_WAIT_MS = 100


class BlockingWhenIdle:
    """Proxy for a zmq socket whose NOBLOCK receives wait briefly for a message."""

    def __init__(self, sock: zmq.Socket):
        self._sock = sock

    def __getattr__(self, name: str):
        return getattr(self._sock, name)

    def _wait(self, flags: int) -> None:
        if flags & zmq.NOBLOCK:
            self._sock.poll(IDLE_WAIT_MS, zmq.POLLIN)

    def recv(self, flags: int = 0, **kwargs):
        self._wait(flags)
        return self._sock.recv(flags=flags, **kwargs)

    def recv_pyobj(self, flags: int = 0):
        self._wait(flags)
        return self._sock.recv_pyobj(flags=flags)
