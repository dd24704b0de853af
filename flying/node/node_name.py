"""Which node served a request, for clients of several nodes behind a router.

A router (docs/ROUTER.md) picks one node per request and hides which; Flying then picks
DP or a TP group inside that node. ``meta_info.flying.node`` (``request_tags.placement``)
and the ``X-Flying-Node`` response header name the node, so a client, a log line or a
test can tell the nodes apart without asking the router. The name is
``--flying-node-name``, or ``<host>:<port>`` filled in by the launcher.
"""

from __future__ import annotations

import socket
from dataclasses import replace

from flying.node.config import FlyingConfig, get_config

NODE_HEADER = "x-flying-node"

#: Hosts that name no single interface: the node is named by the machine's hostname.
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def default_node_name(host: str | None, port: int) -> str:
    """``<host>:<port>`` as a client would dial it (IPv6 in brackets)."""
    host = (host or "").strip()
    if host in _WILDCARD_HOSTS:
        host = socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def with_node_name(cfg: FlyingConfig, host: str | None, port: int) -> FlyingConfig:
    """``cfg`` with its node name filled in when the user gave none (launcher only)."""
    if cfg.node_name:
        return cfg
    return replace(cfg, node_name=default_node_name(host, port)).validate()


def node_name() -> str:
    """This process's node name ("" outside a launched node, e.g. in unit tests)."""
    return get_config().node_name


class NodeHeader:
    """ASGI middleware: ``X-Flying-Node`` on every HTTP response of this node, streaming
    ones included (the header goes out with the response start), errors too."""

    def __init__(self, app):
        self.app = app
        self._header = (NODE_HEADER.encode(), node_name().encode())

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or not self._header[1]:
            await self.app(scope, receive, send)
            return

        async def send_with_name(message):
            if message.get("type") == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self._header]}
            await send(message)

        await self.app(scope, receive, send_with_name)
