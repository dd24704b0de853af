"""The node's name behind a router: the flag, the launcher's default, ``meta_info.flying``
and the ``X-Flying-Node`` response header (on a real Starlette app, no server)."""

from __future__ import annotations

import pytest

from flying.node import config, node_name, request_tags

pytestmark = pytest.mark.unit


@pytest.fixture
def named(monkeypatch):
    """Publish a config with ``node_name`` for one test (restored afterwards)."""

    def set_name(name: str) -> config.FlyingConfig:
        value = config.FlyingConfig(node_name=name).validate()
        monkeypatch.setattr(config, "_CONFIG", value)
        return value

    return set_name


def test_the_flag_is_parsed_and_validated():
    from flying.node.launch import split_argv

    cfg, rest = split_argv(["--flying-node-name", "rack1-node7:30000", "--port", "30000"])
    assert cfg.node_name == "rack1-node7:30000" and rest == ["--port", "30000"]
    for bad in ("a b", "node\r\nX-Evil: 1", "ü", "x" * 256):
        with pytest.raises(config.ConfigError, match="--flying-node-name"):
            config.FlyingConfig(node_name=bad).validate()


def test_the_launcher_names_the_node_host_port():
    cfg = config.FlyingConfig()
    assert node_name.with_node_name(cfg, "127.0.0.1", 30000).node_name == "127.0.0.1:30000"
    assert node_name.with_node_name(cfg, "::1", 8000).node_name == "[::1]:8000"
    import socket

    wildcard = node_name.with_node_name(cfg, "0.0.0.0", 8000).node_name
    assert wildcard == f"{socket.gethostname()}:8000"
    given = config.FlyingConfig(node_name="n1")
    assert node_name.with_node_name(given, "127.0.0.1", 30000).node_name == "n1"


def test_meta_info_names_the_node(named):
    named("n1:30000")
    assert request_tags.placement(2, 0) == {
        "mode": "tp", "degree": 2, "ranks": [0, 1], "node": "n1:30000"
    }
    assert request_tags.placement(1, 1, "why")["node"] == "n1:30000"
    # answered by a member that is not the group's leader: still the group's ranks
    assert request_tags.placement(2, 1)["ranks"] == [0, 1]
    assert request_tags.placement(4, 6)["ranks"] == [4, 5, 6, 7]
    named("")  # outside a launched node: no name, the document as before
    assert request_tags.placement(1, 1) == {"mode": "dp", "degree": 1, "ranks": [1]}


def test_every_response_carries_the_header(named):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    named("n1:30000")

    async def ok(request):
        return JSONResponse({"ok": True})

    async def stream(request):
        async def chunks():
            yield b"data: 1\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/ok", ok), Route("/stream", stream)])
    app.add_middleware(node_name.NodeHeader)
    client = TestClient(app)
    for path in ("/ok", "/stream", "/missing"):
        assert client.get(path).headers["x-flying-node"] == "n1:30000", path
