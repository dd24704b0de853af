"""The policy's plain values: a request as placed, an engine's load, the node, the
policy's configuration and its decision. Pure data (validation only), shared by the
policy (``scheduler.policy``), its replay and the controller that fills them in."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("adaptive", "static-dp", "static-tp", "manual")


@dataclass(frozen=True)
class Request:
    prompt_len: int
    #: None: no limit of its own (SGLang: up to the length limit where it runs)
    max_new_tokens: int | None
    priority: int = 0
    explicit_degree: int = 0  # from X-Flying-TP; 0 = none
    #: A feature of the request that runs in DP only (e.g. "constrained decoding
    #: (regex)"); "" = none.
    dp_only: str = ""
    #: The request's own SLOs in ms (0: none; the node's apply), from its headers or
    #: body (``flying.node.request_slo``).
    slo_ttft_ms: float = 0.0
    slo_tpot_ms: float = 0.0
    #: Prompt tokens that are an earlier request's whole prompt (``scheduler.conversations``:
    #: the controller's index of the prompts it placed); 0: none found.
    turn_tokens: int = 0
    #: Whether one engine holds that earlier prompt (False: it ran in a group, whose
    #: cache ends with its session, and no engine's prefix cache serves this one).
    turn_held: bool = True

    @property
    def tokens(self) -> int:
        """KV tokens placement must find room for: prompt + max_new_tokens, or prompt +
        one new token when max_new_tokens is None (it then grows to the local limit)."""
        new = 1 if self.max_new_tokens is None else max(0, self.max_new_tokens)
        return self.prompt_len + new


@dataclass(frozen=True)
class EngineLoad:
    rank: int
    running: int
    waiting: int

    @property
    def requests(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True)
class Node:
    """The node's shape and KV limits, in tokens (prompt + max_new_tokens).

    A DP request is bounded by SGLang's own per-engine limit (``engine_capacity``, a few
    tokens under the pool size). A TP-m group pools m engines' KV slots
    (``engine_slots`` each) less ``group_slack`` tokens of admission headroom, and no
    group goes beyond the model's context length (``context_limit``; 0 = unbounded).
    """

    num_engines: int
    degrees: tuple[int, ...]  # allowed TP degrees, ascending
    engine_capacity: int  # tokens one engine admits for a single DP request
    engine_slots: int = 0  # KV slots per engine (0: same as engine_capacity)
    group_slack: int = 0  # tokens a TP group keeps free for admission headroom
    context_limit: int = 0  # the model's context length; 0 = no limit
    #: the model's KV heads: a group of more ranks replicates them and pools only
    #: kv_heads engines' worth of KV slots, not degree (0: unknown, degree)
    kv_heads: int = 0
    #: the most new tokens of one extend step (SGLang's chunked prefill size): how a
    #: deep queue is prefilled (``scheduler.service.queue_prefill``; 0: unknown, one
    #: prompt a step, as decision logs written before nodes recorded it)
    prefill_tokens: int = 0

    def capacity(self, degree: int) -> int:
        if degree <= 1:
            return self.engine_capacity
        per_slot = min(degree, self.kv_heads) if self.kv_heads else degree
        pooled = (self.engine_slots or self.engine_capacity) * per_slot - self.group_slack
        return min(pooled, self.context_limit) if self.context_limit else pooled


@dataclass(frozen=True)
class PolicyConfig:
    policy: str = "adaptive"
    priority_threshold: int = 1
    light_load: float = 0.5  # requests per engine below which adaptive enters TP
    heavy_load: float = 1.5  # requests per engine above which adaptive leaves TP
    #: how much faster a group's decode step must be than one engine's for the policy
    #: to choose it for latency (adaptive, priority); negative allows a slower group.
    #: 10 %: forming a group pauses the members' DP work for a rendezvous and the
    #: group's first step, which a step a few % faster does not earn back (a 5 % gain
    #: on the demo model made the longest pause of a run 2.7x static DP's: BENCHMARKS)
    tp_gain: float = 0.10
    #: The node's SLOs in ms (0: derived from the measured quiet service, ``derive_slo``):
    #: the adaptive policy picks the layout predicted to serve the most requests within
    #: them (``scheduler.layout_choice``).
    slo_ttft_ms: float = 0.0
    slo_tpot_ms: float = 0.0
    #: How long a traffic phase is expected to last (s): a layout change must gain more
    #: over it than the change costs.
    phase_s: float = 10.0
    #: A forming group takes its members' running DP requests in (the node sets it from
    #: ``--flying-move-to-dp`` not ``off``), up to ``scheduler.relayout.MAX_JOIN`` a
    #: group, instead of running their DP steps between its own
    #: (``interleave.interleave_lost``). False in decision logs written before
    #: nodes did (their nodes joined the leader's requests only, when no peer had any).
    joins: bool = False
    #: The adaptive policy also offers mixed layouts on 4+ engines (k groups of one
    #: degree beside DP engines), placing by the layout (``Policy.engines_for``). False
    #: in decision logs written before nodes placed so (their chooser offered uniform
    #: layouts only).
    mixed: bool = False

    def validate(self) -> PolicyConfig:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0 <= self.light_load <= self.heavy_load:
            raise ValueError("need 0 <= light_load <= heavy_load")
        if self.slo_ttft_ms < 0 or self.slo_tpot_ms < 0:
            raise ValueError("SLOs must be >= 0 ms (0: derived from the measured service)")
        if self.phase_s <= 0:
            raise ValueError("phase_s must be > 0")
        return self


@dataclass(frozen=True)
class Decision:
    mode: str  # "dp" | "tp" | "reject"
    degree: int = 1
    reason: str = ""
    #: a conversation's turn the adaptive policy runs in DP instead of a group
    #: (``_as_turn``): the controller sends it to the engine holding its conversation
    turn: bool = False
