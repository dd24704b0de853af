"""Cost profiles: what one node's steps, switches and KV cost, as a small JSON file.

A profile carries exactly the inputs the real policy reads (``scheduler.costs.Costs``
with its curves, ``scheduler.layout_choice.SwitchCosts``) plus what the simulated
engines need (KV tokens per engine, the model's context length and head counts, the
chunked-prefill size and the running-request cap). The simulator interpolates the
curves with the same ``Costs`` object the policy uses, so a step costs in the
simulation exactly what the policy believes it costs: the simulation measures the
policy's choices, not a disagreement between two cost models.

Where a profile comes from:

- measured: ``from_decision_log`` (a real node's ``--flying-decision-log``: the head
  line's node, the last placement line's costs and switch costs) or ``from_status`` (a
  saved ``/flying/status``: the engines' curve points merged as the controller merges
  them, ``flying.node.costs_reader.merge``);
- first principles: ``workloads.sim.gpu_profile`` writes the GPU profiles shipped in
  ``workloads/sim/profiles/``, each constant with its source.

Two constants outside the engines' steps: ``overlap`` (SGLang's default overlap loop
on engines whose forward runs inside the launch, as on a CPU: a step's tokens reach
the client when the next step ends; on a GPU the launch is asynchronous and the result
is processed during the next step, so the first-principles profiles turn it off) and
``frontend_ms`` (HTTP, tokenization, the DP controller's dispatch, detokenization and
streaming, added to every TTFT and E2E; 0 where unknown).

Invariant: ``costs`` knows degree 1 and every degree in ``degrees``; a node simulated
with more engines than ``max_engines`` may only use those degrees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from flying.node.costs_reader import merge, switch_costs
from flying.node.placement import SLOTS_ABOVE_INPUT_LIMIT, node_of
from flying.substrate.layout import allowed_degrees
from scheduler.costs import Costs
from scheduler.layout_choice import SwitchCosts
from scheduler.policy import Node

#: Where the shipped profiles live (next to this module: no absolute path).
PROFILES_DIR = Path(__file__).parent / "profiles"
#: SGLang's chunked-prefill size on a GPU (tokens per extend step) where a measured
#: source does not say.
DEFAULT_CHUNK = 8192
#: SGLang 0.5.23 sizes its request pool at 2048-4096 requests per worker
#: (``KVCacheConfigurator.resolve_max_num_reqs``); the lower bound where unknown.
DEFAULT_MAX_RUNNING = 2048
#: The frontend latency measured on the 2-core CPU machine: a sequential 1-token
#: /generate of a 100-token prompt on the demo model took 18.3 ms end to end on a
#: groups-off server, against 9.3-10.1 ms for the engine's prefill of 100 tokens (the
#: decision logs' prefill curves): 8-9 ms outside the engine, the lower end. Not
#: fitted to any validation run; ``validate --frontend-ms`` sets another.
CPU_FRONTEND_MS = 8.0


@dataclass(frozen=True)
class Profile:
    """One node's costs (see the module docstring); ``constants`` and ``assumptions``
    say where each number comes from, for the reader of the JSON file."""

    name: str
    costs: Costs
    switch: SwitchCosts
    kv_tokens: int  # KV slots per engine (SGLang's max_total_num_tokens)
    degrees: tuple[int, ...]  # TP degrees the costs cover
    max_engines: int  # engines of the node the profile describes
    context_len: int = 0  # the model's context length (0: unknown, the KV bounds)
    kv_heads: int = 0  # the model's KV heads (0: unknown: a group pools m engines)
    heads: int = 0  # attention heads (0: unknown: every power-of-two degree fits)
    chunk_tokens: int = DEFAULT_CHUNK
    max_running: int = DEFAULT_MAX_RUNNING
    overlap: bool = True  # a step's tokens reach the client when the next step ends
    frontend_ms: float = 0.0  # per request outside the engines (0: unknown)
    kind: str = "measured"  # "measured" | "first-principles" | "documented"
    source: str = ""
    constants: dict = field(default_factory=dict)
    assumptions: tuple[str, ...] = ()

    # -- the node as SGLang and Flying see it ---------------------------------------

    @property
    def max_req_len(self) -> int:
        """SGLang's longest request on one engine (``TpModelWorker``: the context or
        the KV pool, less one)."""
        kv = self.kv_tokens - 1
        return min(self.context_len - 1, kv) if self.context_len else kv

    def degrees_for(self, engines: int) -> tuple[int, ...]:
        """The degrees a node of ``engines`` forms ("auto": the launcher's
        ``allowed_degrees``), among those the profile has costs for."""
        if self.heads and self.kv_heads:
            fits = allowed_degrees(engines, self.kv_heads, self.heads)
        else:
            fits = [m for m in (2, 4, 8, 16, 32, 64) if m <= engines and engines % m == 0]
        return tuple(m for m in fits if m in self.degrees)

    def node(self, engines: int, degrees: tuple[int, ...], http: bool = False) -> Node:
        """The policy's ``Node`` as the node builds it (``flying.node.placement.node_of``,
        through ``make_policy``) from SGLang's limits: the DP controller's (no context
        length passed; the KV pool, SGLang's ``max_total_num_tokens``) or, with
        ``http``, the HTTP process's (its engine count is the largest degree, the
        context length known, the pool not: SGLang's request limit stands for it)."""
        input_limit = self.max_req_len - 5  # SGLang: max_req_input_len = max_req_len - 5
        if http:
            return node_of(max(degrees or (1,)), tuple(degrees), input_limit,
                           self.context_len, kv_pool=0, kv_heads=self.kv_heads,
                           prefill_tokens=self.chunk_tokens)
        return node_of(engines, tuple(degrees), input_limit, kv_pool=self.kv_tokens,
                       kv_heads=self.kv_heads, prefill_tokens=self.chunk_tokens)

    # -- JSON -------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "name": self.name, "kind": self.kind, "source": self.source,
            "kv_tokens_per_engine": self.kv_tokens, "degrees": list(self.degrees),
            "max_engines": self.max_engines, "context_len": self.context_len,
            "kv_heads": self.kv_heads, "heads": self.heads,
            "chunked_prefill_tokens": self.chunk_tokens,
            "max_running_requests": self.max_running,
            "overlap": self.overlap, "frontend_ms": self.frontend_ms,
            "switch": {"bind_ms": self.switch.bind_ms,
                       "move_ms_per_ktok": self.switch.move_ms_per_ktok,
                       "move_ms": self.switch.move_ms},
            "costs": self.costs.to_json(),
            "constants": self.constants, "assumptions": list(self.assumptions),
        }

    @staticmethod
    def from_json(doc: dict) -> Profile:
        costs = Costs.from_json(doc["costs"])
        if costs is None or not costs.known(1):
            raise ValueError(f"profile {doc.get('name')!r}: no DP (degree 1) step cost")
        degrees = tuple(int(d) for d in doc.get("degrees", ()))
        missing = [d for d in degrees if not costs.known(d)]
        if missing:
            raise ValueError(f"profile {doc.get('name')!r}: no step cost for TP-{missing}")
        switch = doc.get("switch") or {}
        return Profile(
            name=str(doc.get("name", "profile")), costs=costs,
            switch=SwitchCosts(**{k: float(v) for k, v in switch.items()}),
            kv_tokens=int(doc["kv_tokens_per_engine"]), degrees=degrees,
            max_engines=int(doc.get("max_engines") or max(degrees or (1,))),
            context_len=int(doc.get("context_len") or 0),
            kv_heads=int(doc.get("kv_heads") or 0), heads=int(doc.get("heads") or 0),
            chunk_tokens=int(doc.get("chunked_prefill_tokens") or DEFAULT_CHUNK),
            max_running=int(doc.get("max_running_requests") or DEFAULT_MAX_RUNNING),
            overlap=bool(doc.get("overlap", True)),
            frontend_ms=float(doc.get("frontend_ms") or 0.0),
            kind=str(doc.get("kind", "measured")), source=str(doc.get("source", "")),
            constants=dict(doc.get("constants") or {}),
            assumptions=tuple(doc.get("assumptions") or ()),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def shipped() -> list[str]:
    """Names of the profiles in ``PROFILES_DIR``."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load(name_or_path: str) -> Profile:
    """A profile by file path, or by the name of a shipped one (``shipped()``)."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no profile {name_or_path!r}: not a file, and not one of {', '.join(shipped())}")
    return Profile.from_json(json.loads(path.read_text()))


# -- measured profiles ----------------------------------------------------------------


def from_decision_log(path: str | Path, chunk_tokens: int = DEFAULT_CHUNK,
                      max_running: int = DEFAULT_MAX_RUNNING) -> Profile:
    """A profile from a node's decision log: the head line's node (engines, degrees,
    KV heads; ``engine_slots`` is the KV pool, ``engine_capacity`` one request's limit,
    which gives the context length where the pool is larger; a log written before the
    controller knew the pool has SGLang's ``min(context, KV pool)`` there, which stands
    for both) and the costs and switch costs of the last placement line that has them
    (the node's latest measurements). Chunk size and running cap are not in the log."""
    head, costs, switch = None, None, None
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        ev = json.loads(line)
        if "kind" not in ev and "config" in ev and "node" in ev:
            head = ev["node"]
        elif ev.get("kind", "place") == "place" and ev.get("costs"):
            logged = Costs.from_json(ev["costs"])  # its points, not the moment's stretch
            costs = Costs(logged.decode_ms, logged.curves)
            switch = SwitchCosts(**ev["switch"]) if ev.get("switch") else switch
    if head is None or costs is None:
        raise ValueError(f"{path}: needs the head line and a placement line with costs")
    degrees = tuple(d for d in head["degrees"] if costs.known(d))
    pool = int(head.get("engine_slots") or head["engine_capacity"])
    # ``node_of``: capacity = max_req_input_len + 1, max_req_len = min(context, pool) - 1
    bound = int(head["engine_capacity"]) - 1 + SLOTS_ABOVE_INPUT_LIMIT  # min(context, pool)
    limit = int(head.get("context_limit") or 0)  # the controller's node has none
    context = limit + 1 if limit else (bound if pool > bound else 0)
    return Profile(
        name=Path(path).stem, costs=costs, switch=switch or SwitchCosts(),
        kv_tokens=pool, degrees=degrees, max_engines=int(head["num_engines"]),
        context_len=context,
        kv_heads=int(head.get("kv_heads") or 0), chunk_tokens=chunk_tokens,
        max_running=max_running, kind="measured",
        source=f"decision log {Path(path).name}: head line (node), last placement line's "
               "costs and switch costs",
    )


def from_status(path: str | Path, kv_heads: int = 0, chunk_tokens: int = DEFAULT_CHUNK,
                max_running: int = DEFAULT_MAX_RUNNING) -> Profile:
    """A profile from a saved ``/flying/status`` document: the engines' curve points
    merged as the controller merges them (without their stretch), their measured bind
    and move times, and their KV pools (the smallest engine's). The KV heads are not in
    the document."""
    doc = json.loads(Path(path).read_text())
    engines = [e for e in doc.get("engines", []) if e.get("mode") != "unknown"]
    costs = merge(engines)
    if costs is None:
        raise ValueError(f"{path}: no engine has measured step costs")
    # the quiet points only: the stretch is how the snapshot's moment ran, not the model
    costs = Costs(costs.decode_ms, costs.curves)
    kv = [int(e["total_kv_slots"]) for e in engines if e.get("total_kv_slots")]
    if not kv:
        raise ValueError(f"{path}: no engine reports total_kv_slots")
    listed = {int(d) for e in engines for d in e.get("degrees", ())}
    return Profile(
        name=Path(path).stem, costs=costs, switch=switch_costs(engines), kv_tokens=min(kv),
        degrees=tuple(sorted(d for d in listed if costs.known(d))),
        max_engines=len(doc.get("engines", [])), kv_heads=kv_heads,
        chunk_tokens=chunk_tokens, max_running=max_running, kind="measured",
        source=f"status document {Path(path).name}: engines' curves merged "
               "(flying.node.costs_reader.merge), switch_costs",
    )


def restricted(profile: Profile, degrees: tuple[int, ...]) -> Profile:
    """``profile`` allowing only ``degrees`` (a ``--flying-tp-degrees`` list)."""
    return replace(profile, degrees=tuple(d for d in profile.degrees if d in degrees))
