"""Build the scheduler policy from Flying's config, and turn a request into its inputs.

Used in the HTTP process (priority, long context, explicit degree: needs no load) and in
the DP controller (the adaptive load decision: needs the engines' load snapshots).

``max_new_tokens`` as SGLang 0.5.23 reads it: a ``/generate`` request that leaves it out
gets ``SamplingParams``' default (128); an explicit ``null``, and every OpenAI chat
request without ``max_tokens`` / ``max_completion_tokens``, carries ``None``, which SGLang
treats as "no limit of its own": ``Scheduler.init_req_max_new_tokens`` makes it
``1 << 30`` and clips it to ``max_req_len - prompt - 1`` (then to the KV pool). So None
is kept as None here (``scheduler.policy.Request`` places it by its prompt alone), and
``kv_tokens_needed`` gives the KV a grouped request may use.

``dp_only_feature`` names the first request feature that does not run in a TP group;
such a request is served in DP (or refused where a client forced a group).
"""

from __future__ import annotations

import json
from pathlib import Path

from flying.node import request_slo
from flying.node.config import FlyingConfig, get_config
from flying.session.budget import (  # noqa: F401 (re-exported for callers)
    ADMISSION_SLACK,
    kv_tokens_needed,
    resolved_max_new_tokens,
)
from scheduler.policy import EngineLoad, Node, Policy, PolicyConfig, Request

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default
#: SGLang 0.5.23 (``TpModelWorker``): max_req_len = kv_slots - 1, and
#: max_req_input_len = max_req_len - 5, so an engine's KV slots are the input limit + 6
#: (when the context length is not the tighter bound).
SLOTS_ABOVE_INPUT_LIMIT = 6


def node_of(
    num_engines: int, degrees: tuple[int, ...], max_req_input_len: int, context_len: int = 0,
    kv_pool: int = 0, kv_heads: int = 0, prefill_tokens: int = 0,
) -> Node:
    """The policy's ``Node`` from the limits SGLang's engines report: one request's
    limit (``max_req_input_len``), the KV pool (``kv_pool``: SGLang's
    ``max_total_num_tokens``; 0 where the process does not know it, then the request
    limit stands for it, which is the pool only where the pool is the tighter bound),
    the context length (0: not bounded here), the checkpoint's KV heads and the most
    new tokens of one extend step (``prefill_tokens``: ``extend_tokens``).

    The pool matters to the adaptive policy: it is how many requests a server batches
    (a pool of 800k tokens under an 8k context holds ~100 requests, not ~2)."""
    return Node(
        num_engines,
        degrees,
        engine_capacity=max_req_input_len + 1,
        engine_slots=kv_pool or max_req_input_len + SLOTS_ABOVE_INPUT_LIMIT,
        group_slack=ADMISSION_SLACK,
        context_limit=max(0, context_len - 1),
        kv_heads=kv_heads,
        prefill_tokens=prefill_tokens,
    )


def extend_tokens(server_args) -> int:
    """The most new tokens SGLang puts in one extend step: its chunked prefill size, or
    where chunking is off (<= 0) its ``max_prefill_tokens``; 0 where not known.

    SGLang 0.5.23 resolves a chunk size left unset (by the device's memory; 4096 on a
    CPU) into its runtime context's schedule bag, not into ``server_args``, whose field
    stays None: the bag is read first, the raw field where no bag is published."""
    chunk = _resolved("chunked_prefill_size", server_args)
    if chunk is None:
        return 0
    if chunk > 0:
        return chunk
    most = _resolved("max_prefill_tokens", server_args)
    return most if most is not None and most > 0 else 0


def _resolved(name: str, server_args) -> int | None:
    """SGLang's resolved value of the schedule field ``name`` (None: unknown)."""
    value = None
    try:
        from sglang.srt.runtime_context import get_schedule

        value = getattr(get_schedule(), name, None)
    except Exception:  # noqa: BLE001 - no context published in this process (or no SGLang)
        value = None
    if value is None:
        value = getattr(server_args, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def make_policy(
    num_engines: int, max_req_input_len: int, context_len: int = 0,
    model_path: str | None = None, kv_pool: int = 0, server_args=None,
) -> Policy:
    """The policy for this node (``node_of``), with the checkpoint's KV heads (a group
    replicating them pools less KV: ``Node.kv_heads``) and SGLang's extend step
    (``extend_tokens(server_args)``: how a deep queue is prefilled)."""
    cfg = get_config()
    node = node_of(num_engines, tuple(cfg.degree_list() or ()), max_req_input_len,
                   context_len, kv_pool, model_kv_heads(model_path),
                   extend_tokens(server_args))
    return Policy(policy_config(cfg), node)


def policy_config(cfg: FlyingConfig) -> PolicyConfig:
    """The policy's settings from Flying's (the node's and the simulator's)."""
    return PolicyConfig(
        cfg.policy, cfg.priority_threshold, cfg.light_load, cfg.heavy_load, cfg.tp_gain,
        slo_ttft_ms=cfg.slo_ttft, slo_tpot_ms=cfg.slo_tpot, phase_s=cfg.phase_s,
        joins=cfg.move_to_dp != "off", mixed=cfg.layouts == "mixed",
    ).validate()


def model_kv_heads(model_path: str | None) -> int:
    """The checkpoint's KV heads (``num_key_value_heads``, else its attention heads) from
    its ``config.json``; 0 where there is none to read (a hub id: groups are off then,
    ``launch.resolve_degrees``)."""
    config = Path(model_path or "") / "config.json"
    if not model_path or not config.is_file():
        return 0
    hf = json.loads(config.read_text())
    return int(hf.get("num_key_value_heads") or hf.get("num_attention_heads") or 0)


def max_new_tokens(sampling_params) -> int | None:
    """The request's max_new_tokens: None when SGLang would run it without a limit of its
    own, SGLang's default when the field is absent. A ValueError (HTTP 400) for a value
    SGLang could not use (not an integer, negative)."""
    if sampling_params is None:
        return DEFAULT_MAX_NEW_TOKENS
    if isinstance(sampling_params, dict):
        if "max_new_tokens" not in sampling_params:
            return DEFAULT_MAX_NEW_TOKENS
        value = sampling_params["max_new_tokens"]
    else:
        value = getattr(sampling_params, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(
                f"invalid max_new_tokens {value!r}: expected a non-negative integer or null"
            )
    if value < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {value}")
    return value


def request_of(
    prompt_len: int, sampling_params, priority, explicit_degree: int, dp_only: str = "",
    turn_tokens: int = 0, turn_held: bool = True,
) -> Request:
    """The policy's view of one request (the DP controller's: the HTTP process has
    already refused a bad SLO value with a 400; one that slips through counts as none)."""
    try:
        ttft, tpot = request_slo.of(sampling_params)
    except ValueError:
        ttft, tpot = 0.0, 0.0
    return Request(
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens(sampling_params),
        priority=int(priority or 0),
        explicit_degree=explicit_degree,
        dp_only=dp_only,
        slo_ttft_ms=ttft,
        slo_tpot_ms=tpot,
        turn_tokens=turn_tokens,
        turn_held=turn_held,
    )


def loads_of(snapshots) -> list[EngineLoad]:
    return [EngineLoad(s.dp_rank, s.num_running_reqs, s.num_waiting_reqs) for s in snapshots]


# -- request features that run in DP only ---------------------------------------------

#: (request field, feature name): per-request options of SGLang 0.5.23's
#: GenerateReqInput / TokenizedGenerateReqInput that a TP group does not run. Each is
#: read with getattr, so the same list serves the HTTP process (GenerateReqInput) and the
#: controller (TokenizedGenerateReqInput).
DP_ONLY_FIELDS = (
    ("custom_logit_processor", "custom_logit_processor"),
    ("lora_path", "LoRA adapters (lora_path)"),
    ("lora_id", "LoRA adapters (lora_path)"),
    ("lora_name", "LoRA adapters (lora_path)"),
    ("input_embeds", "input_embeds"),
    ("positional_embed_overrides", "positional_embed_overrides"),
    ("image_data", "multimodal input (image_data)"),
    ("video_data", "multimodal input (video_data)"),
    ("audio_data", "multimodal input (audio_data)"),
    ("mm_inputs", "multimodal input"),
    ("session_params", "sessions (session_params)"),
    ("session_id", "sessions (session_id)"),
    ("bootstrap_host", "PD disaggregation (bootstrap_host)"),
    ("bootstrap_room", "PD disaggregation (bootstrap_room)"),
    ("bootstrap_pair_key", "PD disaggregation (bootstrap_pair_key)"),
    ("disagg_prefill_dp_rank", "PD disaggregation (disagg_prefill_dp_rank)"),
    ("routed_dp_rank", "routed_dp_rank (the client chose an engine)"),
    ("data_parallel_rank", "routed_dp_rank (the client chose an engine)"),
    ("return_routed_experts", "return_routed_experts"),
    ("return_indexer_topk", "return_indexer_topk"),
    ("max_thinking_tokens", "max_thinking_tokens"),
    ("multi_item_delimiter_indices", "multi-item scoring"),
    ("token_indices_to_pool", "token_indices_to_pool"),
    ("kv_hints", "kv_hints"),
)

#: Sampling options that run in DP only. (Constrained decoding, SGLang's ``regex``,
#: ``json_schema``, ``ebnf`` and ``structural_tag``, runs in groups: every member's copy
#: gets its grammar at the same step, ``flying.session.grammar``.)
DP_ONLY_SAMPLING = (
    ("beam_width", "beam search (beam_width)"),
    ("watermark", "watermark"),
)


def _present(value) -> bool:
    """A field counts when it holds something: not None, False or an empty container
    (a list counts when any item does). 0 counts: ``routed_dp_rank=0`` names engine 0."""
    if value is None or value is False:
        return False
    if isinstance(value, (list, tuple)):
        return any(_present(v) for v in value)
    if isinstance(value, (dict, str, bytes)):
        return bool(value)
    return True


def _sampling_field(sampling_params, name):
    if isinstance(sampling_params, dict):
        return sampling_params.get(name)
    return getattr(sampling_params, name, None)


def dp_only_feature(req) -> str:
    """The first feature of ``req`` (a GenerateReqInput or TokenizedGenerateReqInput)
    that runs in DP only, or "". Never raises."""
    try:
        params = getattr(req, "sampling_params", None)
        if isinstance(params, list):  # an un-split batch: any of its requests
            found = [_sampling_feature(p) for p in params]
            feature = next((f for f in found if f), "")
        else:
            feature = _sampling_feature(params)
        if feature:
            return feature
        for name, feature in DP_ONLY_FIELDS:
            if _present(getattr(req, name, None)):
                return feature
        return ""
    except Exception:  # noqa: BLE001 - an odd request is DP, never an error here
        return "an unrecognised request option"


def _sampling_feature(params) -> str:
    if params is None:
        return ""
    for name, feature in DP_ONLY_SAMPLING:
        value = _sampling_field(params, name)
        if name == "beam_width":
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                return feature
        elif _present(value):
            return feature
    return ""
