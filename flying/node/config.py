"""Flying's own settings: one dataclass, one argparse group, one environment hand-off.

The launcher parses SGLang's flags and Flying's flags from one command line. Flying's
settings travel to every SGLang process (tokenizer, controller, engines are separate
processes, started with ``spawn``) through one environment variable holding JSON, set
before SGLang starts any process. ``get_config()`` is the set-once accessor every
process uses; it never changes after the first read.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import asdict, dataclass, field, fields

from scheduler.hold import HOLD_STEPS
from scheduler.policy import PolicyConfig

#: The policy's own defaults: the flags below take theirs from it (one place).
_POLICY = PolicyConfig()

ENV_VAR = "FLYING_CONFIG"

PLATFORMS = ("auto", "cpu", "native")
PREEMPT_MODES = ("hard", "soft")
TRUST_MODES = ("trust", "ignore")
MOVE_MODES = ("policy", "all", "off")
LAYOUT_MODES = ("uniform", "mixed")
#: A node name travels in an HTTP header: a short, plain token (host names, IPv6 in [ ]).
NODE_NAME_MAX = 255
_NODE_NAME = re.compile(r"[A-Za-z0-9._:\-\[\]]*")


class ConfigError(ValueError):
    """A Flying flag has an invalid value; the message names the flag."""


@dataclass(frozen=True)
class FlyingConfig:
    """Every Flying setting, with its default. Field ``x_y`` is flag ``--flying-x-y``."""

    #: Which platform serves: "auto" picks Flying's CPU platform when no CUDA device is
    #: visible and SGLang's own platform otherwise; "cpu" forces the CPU platform;
    #: "native" never activates it.
    platform: str = "auto"
    #: Where the embedded demo checkpoint is created (default: $FLYING_CACHE_DIR or
    #: ~/.cache/flying).
    cache_dir: str = ""
    #: Threads per engine on the CPU platform; 0 splits the visible cores evenly.
    cpu_threads: int = 0
    #: TP degrees the node may form: "auto" (every power of two up to the engine count
    #: that divides the model's head counts), "none", or a comma list like "2,4".
    tp_degrees: str = "auto"
    #: Seconds a bind waits for all group members to reach a step boundary.
    bind_timeout_s: float = 30.0
    #: Global scheduler policy: adaptive, static-dp, static-tp or manual.
    policy: str = _POLICY.policy
    #: Requests with priority >= this run in the largest TP group.
    priority_threshold: int = _POLICY.priority_threshold
    #: How a bind treats the members' running DP requests: "hard" pauses them with their
    #: KV kept (latency first); "soft" lets them finish first, admitting no new DP work
    #: on the members meanwhile (throughput first).
    preempt: str = "hard"
    #: Which group sessions end at once when a member has DP work, their running
    #: requests moved into DP on the members with their KV (no recompute): "policy" (the
    #: adaptive policy's light-load groups), "all" (any group, explicit and priority
    #: ones too), "off" (a group keeps its requests; DP work runs between group steps).
    move_to_dp: str = "policy"
    #: The most group steps an arrival for a running group waits while every request
    #: the group decodes finishes (by length) within them, so that its prefill does not
    #: pause them near their end (``scheduler.hold``); 0: admit at once. Only requests
    #: the policy grouped (adaptive, static-tp) wait; priority, long-context and
    #: explicit ones never do.
    hold_steps: int = HOLD_STEPS
    #: Adaptive policy: enter TP below this many requests per engine...
    light_load: float = _POLICY.light_load
    #: ...and go back to DP above this many.
    heavy_load: float = _POLICY.heavy_load
    #: How much faster (a fraction) a group's measured decode step must be than one
    #: engine's for the policy to choose it for latency (adaptive light load, priority).
    #: Negative allows a slower group (for experiments and tests).
    tp_gain: float = _POLICY.tp_gain
    #: The node's TTFT and TPOT SLOs in ms, which the adaptive policy serves the most
    #: requests within; 0: derived from the measured quiet service (4x its TTFT, 1.5x
    #: its TPOT), logged when the first request is placed.
    slo_ttft: float = _POLICY.slo_ttft_ms
    slo_tpot: float = _POLICY.slo_tpot_ms
    #: Seconds a traffic phase is expected to last: the adaptive policy changes layout
    #: only when the predicted gain over it outlasts the change's measured cost.
    phase_s: float = _POLICY.phase_s
    #: The layouts the adaptive policy chooses among on 4+ engines: "uniform" DP or
    #: every engine in groups of one degree; "mixed" also k groups of one degree beside
    #: DP engines (its DP requests then go to its DP engines, its binds to its own
    #: groups). On 2-3 engines both are the same. Uniform by default: simulated at 8
    #: engines, mixed layouts served as much on the paper preset and more past
    #: saturation, but less at 50 req/s on H100s (docs/BENCHMARKS.md, "Mixed layouts").
    layouts: str = "uniform"
    #: Where the DP controller appends its decision log (JSON lines: inputs, decision,
    #: reason), and the engines every layout change they make (moves to DP, joins,
    #: upgrades' joins), for ``python -m scheduler.replay``; empty: no log.
    decision_log: str = ""
    #: Whether a client may set its request's priority (``X-Priority`` and SGLang's body
    #: ``priority`` field): "trust" reads both; "ignore" drops both (SGLang's default
    #: priority applies), so only the operator's own tooling raises priority.
    client_priority: str = "trust"
    #: Whether a client may force a TP group with ``X-Flying-TP``: "trust" or "ignore".
    client_tp: str = "trust"
    #: The most DP requests (running + waiting, from the controller's load snapshot) a
    #: priority request may pause: a priority request goes to the least loaded group of
    #: the largest degree only if its members hold at most this many; otherwise it runs
    #: in DP (SGLang's own priority scheduling). -1: no bound.
    priority_max_paused: int = -1
    #: Allow TP groups on CUDA engines. Group steps on CUDA are unverified (CUDA graphs
    #: captured for DP would replay in group mode; attention backends are built with DP
    #: head counts), so without this flag a GPU node serves with groups off.
    experimental_cuda_groups: bool = False
    #: This node's name in ``meta_info.flying.node`` and the ``X-Flying-Node`` response
    #: header, so that a client behind a router (several nodes) sees which node served
    #: it. Empty: the launcher fills in ``<host>:<port>`` (the machine's hostname for a
    #: wildcard host).
    node_name: str = ""
    #: Help texts, keyed by field name (not a setting).
    _help: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def validate(self) -> FlyingConfig:
        if self.platform not in PLATFORMS:
            raise ConfigError(
                f"--flying-platform must be one of {', '.join(PLATFORMS)}, got {self.platform!r}"
            )
        if self.cpu_threads < 0:
            raise ConfigError(f"--flying-cpu-threads must be >= 0, got {self.cpu_threads}")
        if self.bind_timeout_s <= 0:
            raise ConfigError(f"--flying-bind-timeout-s must be > 0, got {self.bind_timeout_s}")
        self.degree_list()
        from scheduler.policy import POLICIES

        if self.policy not in POLICIES:
            raise ConfigError(f"--flying-policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.preempt not in PREEMPT_MODES:
            raise ConfigError(
                f"--flying-preempt must be one of {', '.join(PREEMPT_MODES)}, got {self.preempt!r}"
            )
        if self.move_to_dp not in MOVE_MODES:
            raise ConfigError(
                f"--flying-move-to-dp must be one of {', '.join(MOVE_MODES)}, got {self.move_to_dp!r}"
            )
        for name in ("client_priority", "client_tp"):
            if getattr(self, name) not in TRUST_MODES:
                raise ConfigError(
                    f"{_flag(name)} must be one of {', '.join(TRUST_MODES)}, "
                    f"got {getattr(self, name)!r}"
                )
        if self.hold_steps < 0:
            raise ConfigError(f"--flying-hold-steps must be >= 0, got {self.hold_steps}")
        if self.priority_max_paused < -1:
            raise ConfigError(
                f"--flying-priority-max-paused must be >= 0, or -1 for no bound, "
                f"got {self.priority_max_paused}"
            )
        if not 0 <= self.light_load <= self.heavy_load:
            raise ConfigError(
                "--flying-light-load and --flying-heavy-load need 0 <= light <= heavy, got "
                f"{self.light_load} and {self.heavy_load}"
            )
        for name in ("slo_ttft", "slo_tpot"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{_flag(name)} must be >= 0 ms (0: derived), "
                                  f"got {getattr(self, name)}")
        if self.layouts not in LAYOUT_MODES:
            raise ConfigError(
                f"--flying-layouts must be one of {', '.join(LAYOUT_MODES)}, got {self.layouts!r}"
            )
        if self.phase_s <= 0:
            raise ConfigError(f"--flying-phase-s must be > 0, got {self.phase_s}")
        if len(self.node_name) > NODE_NAME_MAX or not _NODE_NAME.fullmatch(self.node_name):
            raise ConfigError(
                f"--flying-node-name must be at most {NODE_NAME_MAX} characters of letters, "
                f"digits and . _ : - [ ] (it is sent as an HTTP header), got {self.node_name!r}"
            )
        return self

    def degree_list(self) -> list[int] | None:
        """Explicit degrees, [] for "none", None for "auto"."""
        text = self.tp_degrees.strip().lower()
        if text == "auto":
            return None
        if text in ("none", ""):
            return []
        try:
            return sorted({int(x) for x in text.split(",")})
        except ValueError:
            raise ConfigError(
                f"--flying-tp-degrees must be auto, none or a comma list of integers, "
                f"got {self.tp_degrees!r}"
            ) from None

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("_help")
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FlyingConfig:
        data = json.loads(text)
        known = {f.name for f in fields(cls) if not f.name.startswith("_")}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown Flying settings in ${ENV_VAR}: {unknown}")
        return cls(**data).validate()


_HELP = {
    "platform": "Platform: auto (CPU platform when no CUDA device is visible), cpu, native.",
    "cache_dir": "Directory for the embedded demo checkpoint (default ~/.cache/flying).",
    "cpu_threads": "Threads per engine on the CPU platform (0: split visible cores evenly).",
    "tp_degrees": "TP degrees to allow: auto, none, or a comma list such as 2,4.",
    "bind_timeout_s": "Seconds a bind waits for all group members before it fails.",
    "policy": "Scheduler policy: adaptive, static-dp, static-tp, or manual (headers only).",
    "priority_threshold": "Priority at or above which a request runs in the largest TP group.",
    "preempt": "hard: pause members' DP requests (KV kept) for a bind; soft: let them finish first.",
    "move_to_dp": "Groups whose running requests move between layouts with their KV: policy, all, off.",
    "hold_steps": "Group steps an arrival may wait for a group's running requests to finish where its prefill would leave one past its TPOT SLO (0: never).",
    "light_load": "Adaptive policy: requests per engine below which engines group into TP.",
    "heavy_load": "Adaptive policy: requests per engine above which engines return to DP.",
    "tp_gain": "How much faster a group's measured step must be than one engine's to pick it for latency (0.10: 10 per cent).",
    "slo_ttft": "Node TTFT SLO in ms for the adaptive policy's goodput (0: 4x the measured quiet TTFT).",
    "slo_tpot": "Node TPOT SLO in ms for the adaptive policy's goodput (0: 1.5x the measured quiet TPOT).",
    "phase_s": "Seconds a traffic phase is expected to last: a layout change must gain more over it than it costs.",
    "layouts": "Adaptive layouts on 4+ engines: uniform (DP, or all engines in groups of one degree) or mixed (also groups beside DP engines; simulated only).",
    "decision_log": "File the controller and engines append decisions and layout changes to (JSON lines, for python -m scheduler.replay).",
    "experimental_cuda_groups": "Allow TP groups on CUDA engines (unverified; off by default).",
    "client_priority": "trust: clients set priority (X-Priority, body priority) and their own SLOs (X-Flying-SLO-TTFT-Ms, X-Flying-SLO-TPOT-Ms, custom_params); ignore: all dropped.",
    "client_tp": "trust: clients may force a TP group with X-Flying-TP; ignore: the header is dropped.",
    "priority_max_paused": "Most DP requests a priority group may pause (-1: no bound); beyond it: DP.",
    "node_name": "Node name in meta_info.flying.node and the X-Flying-Node header (default <host>:<port>).",
}


_CHOICES = {
    "platform": PLATFORMS,
    "policy": ("adaptive", "static-dp", "static-tp", "manual"),
    "preempt": PREEMPT_MODES,
    "move_to_dp": MOVE_MODES,
    "layouts": LAYOUT_MODES,
    "client_priority": TRUST_MODES,
    "client_tp": TRUST_MODES,
}


def _flag(name: str) -> str:
    return "--flying-" + name.replace("_", "-")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the "Flying" argument group; defaults come from ``FlyingConfig``."""
    group = parser.add_argument_group("Flying", "Online DP <-> TP switching (Flying plugin).")
    for f in fields(FlyingConfig):
        if f.name.startswith("_"):
            continue
        if isinstance(f.default, bool):
            group.add_argument(
                _flag(f.name), dest="flying_" + f.name, action="store_true", help=_HELP[f.name]
            )
            continue
        group.add_argument(
            _flag(f.name),
            dest="flying_" + f.name,
            type=type(f.default),
            default=f.default,
            choices=_CHOICES.get(f.name),
            help=_HELP[f.name],
        )


def from_cli_args(args: argparse.Namespace) -> FlyingConfig:
    values = {
        f.name: getattr(args, "flying_" + f.name)
        for f in fields(FlyingConfig)
        if not f.name.startswith("_")
    }
    return FlyingConfig(**values).validate()


def flag_reference() -> list[tuple[str, str, str]]:
    """(flag, default, help) rows, for docs/FLAGS.md and its test."""
    return [
        (_flag(f.name), repr(f.default), _HELP[f.name])
        for f in fields(FlyingConfig)
        if not f.name.startswith("_")
    ]


_CONFIG: FlyingConfig | None = None


def publish(config: FlyingConfig, replace: bool = False) -> None:
    """Hand ``config`` to every process SGLang starts from here on (launcher only)."""
    global _CONFIG
    if _CONFIG is not None and not replace and _CONFIG != config:
        raise RuntimeError("Flying config already published with other values")
    os.environ[ENV_VAR] = config.to_json()
    _CONFIG = config


def get_config() -> FlyingConfig:
    """The process's Flying settings: from ${ENV_VAR} if set, else defaults. Set once."""
    global _CONFIG
    if _CONFIG is None:
        text = os.environ.get(ENV_VAR)
        _CONFIG = FlyingConfig.from_json(text) if text else FlyingConfig()
    return _CONFIG


def cuda_visible() -> bool:
    """True when torch sees a CUDA device. Cheap when CUDA_VISIBLE_DEVICES is empty."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    import torch

    return bool(torch.cuda.is_available())


def wants_cpu_platform() -> bool:
    """Whether this process should serve on Flying's CPU platform."""
    mode = get_config().platform
    if mode == "native":
        return False
    if mode == "cpu":
        return True
    return not cuda_visible()
