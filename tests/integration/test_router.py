"""Several Flying nodes behind a router: sglang-router and the Shepherd Model Gateway (smg).

Two real Flying nodes (2 engines each, the demo model, ``--served-model-name demo``) are
started once for the module; both routers of the ``router`` extra run in front of the same
two nodes at the same time, each with ``round_robin``: sglang-router 0.3.2 (``python -m
sglang_router.launch_router``) and its maintained successor smg 1.13.0 (``python -m smg
launch``). Most tests run once per router (``cluster`` is parametrized, in place), so
each claim in docs/ROUTER.md is checked against both. The router picks the node, Flying
picks DP or a TP group inside it.

Checked per router: the OpenAI endpoints and /generate through it; which node served
(``X-Flying-Node``, ``meta_info.flying.node``); requests spread over both nodes; what of
Flying's request controls reaches a node (the body ``priority``: everywhere but
sglang-router's chat endpoint; ``X-Flying-TP`` and ``X-Priority``: dropped by both); the
router's view of a node's load while a group session runs there (sglang-router: Flying's
``/get_load``; smg: SGLang's ``/v1/loads``). smg only: it routes the OpenAI endpoints by
model name; its overload protection and its ``power_of_two`` keep requests off the node
whose engines run a group. Last, one node crashes behind both routers at once.

The two nodes start together (~2 min on 2 cores); a router starts in seconds (one more smg
is started for ``power_of_two``). A router that is not installed is skipped with the
reason; so is smg where its binary cannot run.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.conftest import MAX_TOTAL_TOKENS
from tests.server import Server, free_port

pytestmark = pytest.mark.integration

NODES = ("node-a", "node-b")
#: The routers of the ``router`` extra, by the name the tests use.
ROUTERS = ("sglang-router", "smg")
#: The model name the nodes serve (``--served-model-name``): smg routes the OpenAI
#: endpoints by the request's ``model`` and answers 404 for a name no worker serves.
MODEL = "demo"
#: Seconds the test waits for a router to see a change in its workers' health.
ROUTER_NOTICE_S = 30
#: Seconds a stopped router gets to exit before it is killed (no graceful drain needed).
ROUTER_STOP_S = 3
#: smg's KV-usage ceiling for its worker overload protection (default 0.8), lowered so
#: that the test's group session crosses it early and for seconds.
SMG_OVERLOAD_KV = 0.25
#: Flags each router gets in ``routers`` (both: ``--policy round_robin``). smg polls every
#: node's load each second (default 10 s: a veto would outlive its cause by up to 10 s).
ROUTER_FLAGS = {
    "sglang-router": (),
    "smg": ("--load-monitor-interval", "1",
            "--worker-overload-token-usage", str(SMG_OVERLOAD_KV)),
}


def _launch_command(kind: str) -> list[str]:
    """How each router is started: both are Rust binaries behind a Python entry point."""
    if kind == "sglang-router":
        return [sys.executable, "-m", "sglang_router.launch_router"]
    return [sys.executable, "-m", "smg", "launch"]


@functools.cache
def _unavailable(kind: str) -> str | None:
    """Why ``kind`` cannot run here (a skip reason), or None.

    Not installed: skip. smg installed but its binary cannot run on this machine (the
    wheel is a manylinux_2_17 x86_64 Rust extension): skip with its error. A router that
    runs but fails to serve is a test failure, not a skip."""
    module = "sglang_router" if kind == "sglang-router" else "smg"
    if importlib.util.find_spec(module) is None:
        return f"{kind} is not installed: pip install -e '.[router]' (pyproject.toml pins it)"
    if kind == "smg":
        probe = subprocess.run(
            [sys.executable, "-m", "smg", "--version"], capture_output=True, text=True,
            timeout=60,
        )
        if probe.returncode != 0:
            lines = (probe.stderr or probe.stdout).strip().splitlines() or ["no output"]
            return f"smg is installed but cannot run on this machine: {lines[-1][:300]}"
    return None


class Router:
    """One router process (sglang-router or smg) on 127.0.0.1 in front of ``worker_urls``.

    Both routers take the same flags for what the tests need and serve the same
    ``GET /workers`` (each worker's URL and ``is_healthy``). Each gets its own Prometheus
    port: both default to 29000 and run at the same time here."""

    def __init__(self, kind: str, worker_urls: list[str], log_path: Path, *extra: str):
        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            *_launch_command(kind), "--host", "127.0.0.1", "--port", str(self.port),
            "--worker-urls", *worker_urls,
            # Health checks every second: a stopped node leaves the rotation quickly.
            "--health-check-interval-secs", "1", "--log-level", "info",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *extra,
        ]
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def workers(self) -> dict[str, dict]:
        """The router's workers by URL (its own view: health, load)."""
        body = requests.get(self.url + "/workers", timeout=5).json()
        return {w["url"]: w for w in body.get("workers", [])}

    def wait_workers(self, urls: list[str], timeout_s: float = ROUTER_NOTICE_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited:\n{self.log_tail()}")
            try:
                seen = self.workers()
                if all(seen.get(u, {}).get("is_healthy") for u in urls):
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.kind} did not list {urls} as healthy:\n{self.log_tail()}")

    def wait_unhealthy(self, url: str, timeout_s: float = ROUTER_NOTICE_S) -> None:
        deadline = time.monotonic() + timeout_s
        while self.workers().get(url, {}).get("is_healthy", False):
            assert time.monotonic() < deadline, f"{self.kind} never marked {url} unhealthy"
            time.sleep(0.5)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # smg drains in-flight requests for seconds: don't wait
            try:
                self.proc.wait(timeout=ROUTER_STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


class Cluster:
    """The two nodes and one router in front of them."""

    def __init__(self, nodes: dict[str, Server], router: Router):
        self.nodes = nodes
        self.router = router

    def post(self, path: str, payload: dict, headers: dict | None = None) -> requests.Response:
        resp = requests.post(self.router.url + path, json=payload, headers=headers, timeout=120)
        assert resp.status_code == 200, (self.router.kind, resp.status_code, resp.text)
        assert resp.headers.get("x-flying-node") in self.nodes, resp.headers
        return resp


@pytest.fixture(scope="module")
def nodes(demo_model_dir, tmp_path_factory) -> Iterator[dict[str, Server]]:
    reasons = [r for r in map(_unavailable, ROUTERS) if r]
    if len(reasons) == len(ROUTERS):  # no router to test: don't start the nodes
        pytest.skip("; ".join(reasons))
    logs = tmp_path_factory.mktemp("router")
    started: dict[str, Server] = {}
    try:
        for name in NODES:  # both start before either is waited for: they come up together
            started[name] = Server(
                ["--model-path", str(demo_model_dir), "--dp-size", "2",
                 "--served-model-name", MODEL,
                 "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--flying-policy", "static-dp",
                 # a priority request takes a group even though a TP-2 step is slower
                 # than one engine on the demo model (as in tests/conftest.demo_server)
                 "--flying-tp-gain", "-10", "--flying-node-name", name],
                logs / f"{name}.log",
                # group steps 6 ms slower: GroupSession's 800 steps last ~7 s, not ~2.5 s,
                # so the session outlives smg's 1 s load polls on a busy 2-core machine
                env={"FLYING_TEST_STEP_DELAY_MS": "2:6"},
            )
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def routers(nodes, tmp_path_factory) -> Iterator[dict[str, Router | str]]:
    """Every router of the extra in front of the two nodes, started once, side by side;
    a router that cannot run here maps to the reason (the tests skip with it)."""
    logs = tmp_path_factory.mktemp("routers")
    urls = [s.url for s in nodes.values()]
    out: dict[str, Router | str] = {}
    try:
        for kind in ROUTERS:
            out[kind] = _unavailable(kind) or Router(
                kind, urls, logs / f"{kind}.log", "--policy", "round_robin", *ROUTER_FLAGS[kind]
            )
        for router in out.values():
            if isinstance(router, Router):
                router.wait_workers(urls)
        yield out
    finally:
        for router in out.values():
            if isinstance(router, Router):
                router.stop()


@pytest.fixture(params=ROUTERS)
def cluster(request, nodes, routers) -> Cluster:
    """The two nodes behind one router; each test runs once per router, in place (a
    function-scoped parameter: no reordering, so the node-stopping test stays last)."""
    return Cluster(nodes, _running(routers, request.param))


def _running(routers: dict[str, Router | str], kind: str) -> Router:
    """The running router of ``kind``; the test is skipped with the reason if it is not."""
    router = routers[kind]
    if isinstance(router, str):
        pytest.skip(router)
    return router


def _generate(text: str = "Hello", new: int = 8, **extra) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": new, "temperature": 0}, **extra}


def _tp_requests(node: Server) -> int:
    """Requests the node's engines have run in TP groups (Flying's counters)."""
    status = requests.get(node.url + "/flying/status", timeout=5).json()
    return sum(int(e["tp_requests"]) for e in status["engines"])


def test_openai_and_generate_through_the_router(cluster):
    # Greedy, so the answer is the same on either node; the demo model may stop early (EOS).
    chat = cluster.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "temperature": 0,
    }).json()
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert 1 <= chat["usage"]["completion_tokens"] <= 8, chat
    completion = cluster.post("/v1/completions", {
        "model": MODEL, "prompt": "hi", "max_tokens": 8, "temperature": 0,
    }).json()
    assert 1 <= completion["usage"]["completion_tokens"] <= 8, completion
    gen = cluster.post("/generate", _generate())
    flying = gen.json()["meta_info"]["flying"]
    assert flying["mode"] == "dp" and flying["node"] == gen.headers["x-flying-node"], flying
    if cluster.router.kind == "smg":
        # smg also names the worker it routed to, by URL.
        served = cluster.nodes[flying["node"]].url
        assert gen.headers["x-smg-routed-worker-id"] == served, gen.headers


def test_smg_routes_the_openai_endpoints_by_model_name(routers):
    """smg sends an OpenAI request only to workers that serve its ``model``: a name no node
    serves is answered 404 by smg itself (sglang-router passes any name on)."""
    smg = _running(routers, "smg")
    resp = requests.post(smg.url + "/v1/completions", json={
        "model": "no-such-model", "prompt": "hi", "max_tokens": 2,
    }, timeout=60)
    assert resp.status_code == 404, (resp.status_code, resp.text)
    assert resp.json()["error"]["code"] == "model_not_found", resp.text


def test_requests_spread_over_both_nodes(cluster):
    served = Counter(
        cluster.post("/generate", _generate(f"prompt {i}")).json()["meta_info"]["flying"]["node"]
        for i in range(6)
    )
    assert set(served) == set(NODES) and min(served.values()) >= 2, served


#: Where a router passes SGLang's body ``priority`` on to the node. sglang-router 0.3.2
#: parses chat requests into its own type, which has no ``priority``: the field is lost
#: there. smg parses and re-serializes the OpenAI bodies too, and keeps it.
BODY_PRIORITY_CARRIED = {
    ("sglang-router", "/generate"): True,
    ("sglang-router", "/v1/completions"): True,
    ("sglang-router", "/v1/chat/completions"): False,
    ("smg", "/generate"): True,
    ("smg", "/v1/completions"): True,
    ("smg", "/v1/chat/completions"): True,
}
PRIORITY_BODIES = {
    "/generate": _generate("urgent", new=4, priority=1),
    "/v1/completions": {"model": MODEL, "prompt": "urgent", "max_tokens": 4, "priority": 1},
    "/v1/chat/completions": {
        "model": MODEL, "messages": [{"role": "user", "content": "urgent"}], "max_tokens": 4,
        "priority": 1,
    },
}


def _ran_in_group(node: Server, before: int, wait_s: float = 3.0) -> bool:
    """Whether the node's TP-request counter moved past ``before`` (within ``wait_s``:
    Flying publishes its status on events, so a miss is waited for, not a hit)."""
    deadline = time.monotonic() + wait_s
    while _tp_requests(node) <= before:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_body_priority_takes_effect_on_the_node_that_got_it(cluster):
    """SGLang's body ``priority`` travels with the body: the node runs it in its largest
    group (``--flying-priority-threshold`` 1), and names itself; on /generate each node
    forms its own group. On the OpenAI endpoints it arrives where the router keeps it
    (``BODY_PRIORITY_CARRIED``); the same chat body sent to a node directly runs in a
    group, so a miss through the router is the router's."""
    seen: set[str] = set()
    deadline = time.monotonic() + ROUTER_NOTICE_S
    i = 0
    while seen != set(NODES):  # each node forms its own group
        # smg's overload protection may leave a node out until its next load poll (its
        # KV usage after a group session): round robin then resumes within seconds.
        assert i < 4 or time.monotonic() < deadline, ("one node only", seen)
        resp = cluster.post("/generate", _generate(f"urgent {i}", priority=1))
        flying = resp.json()["meta_info"]["flying"]
        assert flying["mode"] == "tp" and flying["degree"] == 2, flying
        assert flying["ranks"] == [0, 1] and flying["node"] == resp.headers["x-flying-node"]
        seen.add(flying["node"])
        i += 1
        time.sleep(0.5 if i >= 4 else 0)
    for path, body in PRIORITY_BODIES.items():
        before = {name: _tp_requests(node) for name, node in cluster.nodes.items()}
        name = cluster.post(path, body).headers["x-flying-node"]
        carried = _ran_in_group(cluster.nodes[name], before[name])
        assert carried == BODY_PRIORITY_CARRIED[cluster.router.kind, path], (path, name)
    node = cluster.nodes["node-a"]
    before = _tp_requests(node)
    assert node.post("/v1/chat/completions", PRIORITY_BODIES["/v1/chat/completions"]).ok
    assert _ran_in_group(node, before)


#: Whether each router hands a request's ``custom_params`` (where a client behind a
#: router puts its own SLOs, ``flying.node.request_slo``) to the node, per endpoint.
BODY_SLO_CARRIED = {
    ("sglang-router", "/generate"): False,
    ("sglang-router", "/v1/completions"): True,
    ("sglang-router", "/v1/chat/completions"): False,
    ("smg", "/generate"): True,
    ("smg", "/v1/completions"): True,
    ("smg", "/v1/chat/completions"): True,
}
_BAD_SLO = {"flying_slo_tpot_ms": "soon"}
SLO_BODIES = {
    "/generate": {"text": "x", "sampling_params": {"max_new_tokens": 2,
                                                   "custom_params": _BAD_SLO}},
    "/v1/completions": {"model": MODEL, "prompt": "x", "max_tokens": 2,
                        "custom_params": _BAD_SLO},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                             "max_tokens": 2, "custom_params": _BAD_SLO},
}


def test_which_router_carries_a_body_slo_to_the_node(cluster):
    """A request's SLO in the body's ``custom_params`` reaches the node where the router
    keeps the field: an invalid value is then the node's 400 naming it (so the field
    arrived); where the router drops it, the request is served (200). Sent to a node
    directly, every endpoint answers the 400."""
    carried, expected = {}, {}
    for path, body in SLO_BODIES.items():
        resp = requests.post(cluster.router.url + path, json=body, timeout=120)
        carried[path] = resp.status_code == 400 and "flying_slo_tpot_ms" in resp.text
        expected[path] = BODY_SLO_CARRIED[cluster.router.kind, path]
        if not carried[path]:
            assert resp.status_code == 200, (path, resp.text)
        direct = cluster.nodes["node-a"].post(path, body)
        assert direct.status_code == 400 and "flying_slo_tpot_ms" in direct.text, direct.text
    assert carried == expected, cluster.router.kind


def test_the_router_drops_flying_request_headers(cluster):
    """Both routers forward only a fixed set of request headers (authorization,
    x-request-id*, x-correlation-id, traceparent, tracestate, x-smg-routing-key), and smg
    has no option to add one: ``X-Flying-TP`` and ``X-Priority`` never reach the node,
    which places the request by its own policy (static-dp here). The same request sent to
    a node directly runs in a group. If a router release starts forwarding them, this
    fails: update docs/ROUTER.md. A header on the list does reach the node: a routing key
    with Flying's reserved prefix ``flying:`` is refused by the node itself (400), and the
    router hands that answer back."""
    for headers in ({"X-Flying-TP": "2"}, {"X-Priority": "high"}):
        via_router = cluster.post("/generate", _generate(), headers=headers)
        assert via_router.json()["meta_info"]["flying"]["mode"] == "dp", headers
        node = cluster.nodes[via_router.headers["x-flying-node"]]
        direct = node.post("/generate", _generate(), headers=headers).json()
        assert direct["meta_info"]["flying"]["mode"] == "tp", (headers, direct["meta_info"])
    refused = requests.post(cluster.router.url + "/generate", json=_generate(),
                            headers={"x-smg-routing-key": "flying:tp=2"}, timeout=60)
    assert refused.status_code == 400 and "reserved" in refused.text, refused.text
    assert refused.headers.get("x-flying-node") in cluster.nodes, refused.headers


class GroupSession:
    """A long TP-2 request sent to one node directly (not through a router, so a router
    learns of it only from the node's load): a group session of 800 steps, ~7 s here
    (the nodes' group steps are slowed by the test-only step delay)."""

    def __init__(self, node: Server):
        self.node = node
        self.body: dict = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        payload = {"text": "a long one",
                   "sampling_params": {"max_new_tokens": 800, "ignore_eos": True}}
        try:
            self.body = self.node.post(
                "/generate", payload, timeout=300, headers={"X-Flying-TP": "2"}
            ).json()
        finally:
            self.done.set()

    def join(self) -> dict:
        self.thread.join(timeout=300)
        assert self.body["meta_info"]["flying"]["mode"] == "tp", self.body
        return self.body


def _wait_for(what: str, check, session: GroupSession, timeout_s: float = 60):
    """Poll ``check`` (returns a truthy value when seen) while the session runs."""
    deadline = time.monotonic() + timeout_s
    while not session.done.is_set() and time.monotonic() < deadline:
        seen = check()
        if seen:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"{what}: not seen while the group session ran")


def _router_load(cluster: Cluster, url: str) -> int | None:
    """The router's own view of one node's load (what its load-aware policies compare):
    sglang-router fans out to Flying's ``/get_load`` (summed ``num_tokens``; -1 where it
    cannot read one); smg answers from its last poll of SGLang's ``/v1/loads`` (summed
    ``num_used_tokens`` over the node's DP ranks; None before its first poll)."""
    if cluster.router.kind == "sglang-router":
        view = requests.get(cluster.router.url + "/get_loads", timeout=10).json()
        loads = {w["worker"]: w["load"] for w in view["workers"]}
        assert set(loads) == {s.url for s in cluster.nodes.values()}, view
        return int(loads[url])
    entries = _smg_loads(cluster.router, url)
    if not entries:
        return None
    assert sorted(e["dp_rank"] for e in entries) == [0, 1], entries
    return sum(int(e["num_used_tokens"]) for e in entries)


def _wait_idle(cluster: Cluster, url: str) -> None:
    """Until the router's view of the node's load is zero: an earlier test's session may
    still be in its last poll."""
    deadline = time.monotonic() + ROUTER_NOTICE_S
    while _router_load(cluster, url) != 0:
        assert time.monotonic() < deadline, f"{cluster.router.kind} never saw {url} idle"
        time.sleep(0.2)


def test_the_router_reads_a_node_load_that_counts_a_group_session(cluster):
    """While node-a's engines run a group session: Flying's ``/get_load`` shows it, and
    the router's own view of node-a's load is above zero (it was zero before, and the
    session never went through the router). For smg, its overload veto follows."""
    node = cluster.nodes["node-a"]
    _wait_idle(cluster, node.url)
    session = GroupSession(node)

    def group_in_get_load():
        loads = requests.get(node.url + "/get_load", timeout=5).json()
        assert [e["dp_rank"] for e in loads] == [0, 1]
        grouped = all(
            e["flying"]["mode"] == "tp2" and e["flying"]["session_tokens"] > 0 for e in loads
        )
        return loads if grouped else None

    seen = _wait_for("the group in /get_load", group_in_get_load, session)
    assert all(e["num_tokens"] >= e["flying"]["session_tokens"] for e in seen), seen
    _wait_for(f"{cluster.router.kind}'s load of node-a",
              lambda: (_router_load(cluster, node.url) or 0) > 0, session)
    if cluster.router.kind == "smg":
        _smg_vetoes_the_busy_node(cluster, session)
    session.join()


def _smg_loads(router: Router, url: str) -> list[dict]:
    """smg's last poll of one node: one entry per DP rank (SGLang's ``/v1/loads`` fields)."""
    view = requests.get(router.url + "/get_loads", timeout=10).json()
    return [e for e in view["loads"] if e["worker"] == url]


def _smg_vetoes_the_busy_node(cluster: Cluster, session: GroupSession) -> None:
    """smg's worker overload protection (on by default) leaves a node out of routing
    while its mean KV usage (SGLang's ``token_usage``, which counts the group session's
    KV) is at or above the ceiling and another node is under it, whatever the policy:
    round robin sends everything to node-b then."""
    busy = cluster.nodes["node-a"]

    def over_ceiling():
        entries = _smg_loads(cluster.router, busy.url)
        usage = sum(e["token_usage"] for e in entries) / max(1, len(entries))
        return usage >= SMG_OVERLOAD_KV

    _wait_for("node-a over smg's KV ceiling", over_ceiling, session)
    served = Counter(
        cluster.post("/generate", _generate(f"vetoed {i}", new=2)).headers["x-flying-node"]
        for i in range(4)
    )
    assert not session.done.is_set(), "the session ended before the requests were sent"
    assert served == Counter({"node-b": 4}), served


def test_smg_power_of_two_avoids_the_node_running_a_group(nodes, routers, tmp_path):
    """smg's load-aware ``power_of_two`` (polling each node's ``/v1/loads`` every second
    here) sends short requests to the idle node while the other node's engines run a
    group session it never saw (sent to the node directly). Overload protection is off
    in this router, so the policy alone decides."""
    _running(routers, "smg")
    urls = [s.url for s in nodes.values()]
    router = Router("smg", urls, tmp_path / "smg-p2.log", "--policy", "power_of_two",
                    "--load-monitor-interval", "1", "--disable-worker-overload-protection")
    try:
        router.wait_workers(urls)
        cluster = Cluster(nodes, router)
        busy = nodes["node-a"]
        _wait_idle(cluster, busy.url)
        session = GroupSession(busy)

        def polled_busy():
            return any(e["num_used_tokens"] > 0 for e in _smg_loads(router, busy.url))

        _wait_for("smg's poll of the busy node", polled_busy, session)
        served: Counter = Counter()
        while not session.done.is_set() and sum(served.values()) < 12:
            resp = cluster.post("/generate", _generate("short", new=2))
            served[resp.headers["x-flying-node"]] += 1
            time.sleep(0.5)
        session.join()
    finally:
        router.stop()
    # An 800-step session lasts ~5 s on an idle 2-core machine: room for 3 requests or more.
    assert sum(served.values()) >= 3, served
    # smg also charges its own dispatches between two polls (requests closer together than
    # here reach the busy node now and then); the idle node is chosen at least three times
    # as often.
    assert served["node-b"] >= 3 * served["node-a"], served


def _wait_spread(kind: str, cluster: Cluster, timeout_s: float = ROUTER_NOTICE_S) -> None:
    """Until two requests in a row through a round-robin router reach both nodes."""
    deadline = time.monotonic() + timeout_s
    while True:
        pair = {cluster.post("/generate", _generate("spread", new=2)).headers["x-flying-node"]
                for _ in range(2)}
        if pair == set(NODES):
            return
        assert time.monotonic() < deadline, (kind, "never routed to both nodes", pair)
        time.sleep(0.5)


def test_a_lost_node_is_routed_around(nodes, routers):
    """node-b crashes (SIGKILL of its whole process tree), behind every router at once.
    Requests sent at once, while a router still lists node-b healthy (round robin sends
    one of two there), are answered by node-a: the router re-sends a request whose
    connection the dead node refused. Each router marks node-b unhealthy within seconds
    (health checks every second), and every request sent afterwards is served by node-a."""
    running = {k: r for k, r in routers.items() if isinstance(r, Router)}
    if not running:
        pytest.skip("; ".join(str(r) for r in routers.values()))
    for kind, router in running.items():  # no router still leaves a node out (a veto)
        _wait_spread(kind, Cluster(nodes, router))
    gone = nodes["node-b"]
    os.killpg(gone.proc.pid, signal.SIGKILL)
    gone.proc.wait(timeout=30)
    try:
        for kind, router in running.items():
            burst = []
            for i in range(2):
                listed = router.workers()[gone.url]["is_healthy"]
                resp = requests.post(router.url + "/generate", json=_generate(f"lost {i}"),
                                     timeout=120)
                burst.append((listed, resp.status_code, resp.headers.get("x-flying-node")))
            assert all(b[1:] == (200, "node-a") for b in burst), (kind, burst)
            assert all(listed for listed, *_ in burst), (kind, "noticed too early", burst)
        for router in running.values():
            router.wait_unhealthy(gone.url)
        for kind, router in running.items():
            cluster = Cluster(nodes, router)
            served = Counter(
                cluster.post("/generate", _generate(f"after {i}")).json()["meta_info"]
                ["flying"]["node"]
                for i in range(6)
            )
            assert served == Counter({"node-a": 6}), (kind, served)
    finally:
        gone.stop()  # what the crash left (its log file)
