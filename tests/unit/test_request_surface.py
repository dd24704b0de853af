"""The HTTP / controller side of the request surface, without a server: control inputs,
the routing-key marker and its secret, DP-only features, max_new_tokens None, the
placement log's key hygiene, and the controller hook's containment."""

from __future__ import annotations

import json
import random
import string
from types import SimpleNamespace

import pytest

from flying.node import config, costs_reader, placement, placement_log, request_tags
from flying.node import controller as flying_controller
from flying.session import messages
from scheduler.policy import Costs, Node, Policy, PolicyConfig, Request, least_loaded_group

pytestmark = pytest.mark.unit


@pytest.fixture
def cfg(monkeypatch):
    """Set this process's Flying config (2 engines, TP-2 allowed) for one test."""

    def set_config(**kw):
        kw.setdefault("tp_degrees", "2")
        value = config.FlyingConfig(**kw).validate()
        monkeypatch.setattr(config, "_CONFIG", value)
        return value

    set_config()
    return set_config


@pytest.fixture(autouse=True)
def groups_open(monkeypatch):
    """The start-up probe has passed (``flying.node.probe``'s gate), as on a ready server."""
    from flying.node import controller, probe

    monkeypatch.setitem(probe._STATE, "gate", probe.OPEN)
    monkeypatch.setattr(controller, "_groups_open", lambda ctl: True)


@pytest.fixture(autouse=True)
def fresh_secret(monkeypatch):
    monkeypatch.setenv(messages.SECRET_ENV, "s3cret" * 4)


# -- the marker -------------------------------------------------------------------------


def test_mark_roundtrip_keeps_user_key():
    key = messages.mark("user;with;semicolons", 2, "priority")
    assert key.startswith("flying:") and "s3cret" in key
    m = messages.read_mark(key)
    assert (m.degree, m.reason, m.user_key, m.forged) == (2, "priority", "user;with;semicolons", False)
    assert messages.unmark(messages.mark(None, 4)) == (4, None)


def test_marker_without_this_launchs_secret_is_not_obeyed(monkeypatch):
    forged = "flying:tp=2"  # the old, secret-less format a client could write
    assert messages.read_mark(forged).degree == 0 and messages.read_mark(forged).forged
    key = messages.mark("k", 2)
    monkeypatch.setenv(messages.SECRET_ENV, "another-launch")
    m = messages.read_mark(key)
    assert m.degree == 0 and m.forged and m.user_key == "k"


@pytest.mark.parametrize(
    "key",
    [
        None, "", "plain", "flying:", "flying:tp=-2", "flying:tp=x", "flying::::",
        "flying:s3crets3crets3crets3cret:tp=-2:explicit",
        "flying:s3crets3crets3crets3cret:tp=99999999999999999999:explicit",
        "flying:s3crets3crets3crets3cret:tp=1:explicit",
        "flying:s3crets3crets3crets3cret:tp=2:why",
        "flying:s3crets3crets3crets3cret:tp=٢:explicit",  # a non-ASCII digit
        b"flying:tp=2", 7, ["flying:tp=2"], {"a": 1}, 3.5,
    ],
)
def test_read_mark_never_raises_and_never_obeys_malformed(key):
    m = messages.read_mark(key)
    assert m.degree == 0


def test_read_mark_never_raises_on_random_input():
    rng = random.Random(7)
    alphabet = string.printable + "\x00é٢;:="
    for _ in range(2000):
        body = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        key = rng.choice(["", "flying:", "flying:s3crets3crets3crets3cret:"]) + body
        m = messages.read_mark(key)
        assert m.degree == 0 or (1 < m.degree <= messages.MAX_DEGREE)


def test_new_secret_changes_per_launch(monkeypatch):
    a = messages.new_secret()
    b = messages.new_secret()
    assert a != b and len(a) == 32


@pytest.mark.parametrize(
    "value,match",
    [
        ("flying:tp=2", "reserved"),
        ("  FLYING:tp=2", "reserved"),
        ("x" * 1025, "at most 1024"),
        ("a\x00b", "control"),
        (12, "expected a string"),
    ],
)
def test_client_routing_keys_validated(value, match):
    with pytest.raises(ValueError, match=match):
        messages.check_routing_key(value, "routing_key")


def test_ordinary_routing_keys_pass():
    for value in (None, "", "user-42", "tenant:a/b", "fly:x", "x" * 1024):
        messages.check_routing_key(value, "routing_key")


# -- headers ----------------------------------------------------------------------------


def test_headers_parsed(cfg):
    c = request_tags.check_headers({"x-flying-tp": " 2 ", "x-priority": "HIGH"})
    assert (c.degree, c.priority) == (2, 1)
    assert request_tags.check_headers({"x-flying-tp": "1"}).degree == 0
    assert request_tags.check_headers({"x-priority": "-7"}).priority == -7
    assert request_tags.check_headers(None) == request_tags.Controls()


@pytest.mark.parametrize(
    "headers,match",
    [
        ({"x-flying-tp": "two"}, "X-Flying-TP"),
        ({"x-flying-tp": "-2"}, "X-Flying-TP"),
        ({"x-flying-tp": "2.0"}, "X-Flying-TP"),
        ({"x-flying-tp": "٢"}, "X-Flying-TP"),
        ({"x-flying-tp": "4"}, "not an allowed TP degree"),
        ({"x-flying-tp": "0"}, "not an allowed TP degree"),
        ({"x-priority": "urgent"}, "X-Priority"),
        ({"x-priority": "1e3"}, "X-Priority"),
        ({"x-priority": str(1 << 63)}, "64-bit"),
        ({"x-smg-routing-key": "flying:tp=2"}, "reserved"),
    ],
)
def test_bad_headers_are_400s_with_a_reason(cfg, headers, match):
    with pytest.raises(ValueError, match=match):
        request_tags.check_headers(headers)


def test_conflicting_repeated_headers_refused(cfg):
    from starlette.datastructures import Headers

    headers = Headers(raw=[(b"x-flying-tp", b"2"), (b"x-flying-tp", b"4")])
    with pytest.raises(ValueError, match="conflicting"):
        request_tags.check_headers(headers)


def test_client_controls_can_be_ignored(cfg):
    cfg(client_priority="ignore", client_tp="ignore")
    c = request_tags.check_headers({"x-flying-tp": "garbage", "x-priority": "garbage"})
    assert c == request_tags.Controls()
    with pytest.raises(ValueError, match="reserved"):  # routing keys stay checked
        request_tags.check_headers({"x-smg-routing-key": "flying:x"})


def _gen(**kw):
    from sglang.srt.managers.io_struct import GenerateReqInput

    kw.setdefault("text", "hi")
    kw.setdefault("sampling_params", {"max_new_tokens": 4})
    return GenerateReqInput(**kw)


def test_tag_request_applies_and_validates(cfg):
    obj = _gen(routing_key="mine", priority=3)
    request_tags.tag_request(obj, {"x-flying-tp": "2", "x-priority": "low"})
    assert obj.priority == -1
    m = messages.read_mark(obj.routing_key)
    assert (m.degree, m.reason, m.user_key) == (2, "explicit", "mine")
    for bad in ({"routing_key": "flying:tp=-2"}, {"priority": "high"}, {"priority": True},
                {"priority": 1 << 64}):
        with pytest.raises(ValueError):
            request_tags.tag_request(_gen(**bad), {})


def test_tag_request_ignores_client_priority(cfg, monkeypatch):
    cfg(client_priority="ignore")
    obj = _gen(priority=9)
    request_tags.tag_request(obj, {"x-priority": "high"})
    assert obj.priority is None
    monkeypatch.setenv("SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES", "1")
    obj = _gen(priority=9)  # SGLang applied a trusted router's x-override-priority
    request_tags.tag_request(obj, {"x-override-priority": "9"})
    assert obj.priority == 9


def test_request_slo_from_header_or_body_header_wins(cfg):
    obj = _gen(sampling_params={"max_new_tokens": 4,
                                "custom_params": {"flying_slo_ttft_ms": 900, "other": 1}})
    request_tags.tag_request(obj, {"x-flying-slo-tpot-ms": " 25.5 "})
    assert obj.sampling_params["custom_params"] == {
        "flying_slo_ttft_ms": 900, "other": 1, "flying_slo_tpot_ms": 25.5}
    obj = _gen(sampling_params={"custom_params": {"flying_slo_tpot_ms": 80}})
    request_tags.tag_request(obj, {"x-flying-slo-tpot-ms": "20"})
    assert placement.request_of(3, obj.sampling_params, 0, 0).slo_tpot_ms == 20.0
    obj = _gen(sampling_params=None)  # no body parameters: the header makes them
    request_tags.tag_request(obj, {"x-flying-slo-ttft-ms": "300"})
    assert obj.sampling_params == {"custom_params": {"flying_slo_ttft_ms": 300.0}}
    batch = _gen(text=["a", "b"], sampling_params=[{}, {"custom_params": None}])
    request_tags.tag_request(batch, {"x-flying-slo-ttft-ms": "300"})
    assert [p["custom_params"] for p in batch.sampling_params] == [
        {"flying_slo_ttft_ms": 300.0}] * 2


@pytest.mark.parametrize("value", ["fast", "0", "-5", "nan", "inf", "1e12", ""])
def test_bad_request_slo_is_a_400_with_a_reason(cfg, value):
    with pytest.raises(ValueError, match="x-flying-slo-ttft-ms"):
        request_tags.check_headers({"x-flying-slo-ttft-ms": value})


@pytest.mark.parametrize("value", ["fast", 0, -5, True, [1], {"a": 1}, float("nan")])
def test_bad_body_slo_is_a_400_with_a_reason(cfg, value):
    obj = _gen(sampling_params={"custom_params": {"flying_slo_tpot_ms": value}})
    with pytest.raises(ValueError, match="custom_params.flying_slo_tpot_ms"):
        request_tags.tag_request(obj, {})


def test_client_slos_dropped_when_client_priority_ignored(cfg):
    cfg(client_priority="ignore")
    obj = _gen(sampling_params={"custom_params": {"flying_slo_tpot_ms": "bad", "k": 1}})
    request_tags.tag_request(obj, {"x-flying-slo-tpot-ms": "also bad"})
    assert obj.sampling_params["custom_params"] == {"k": 1}
    assert placement.request_of(3, obj.sampling_params, 0, 0).slo_tpot_ms == 0.0


def test_tp_header_on_embedding_request_refused(cfg):
    from sglang.srt.managers.io_struct import EmbeddingReqInput

    with pytest.raises(ValueError, match="embedding"):
        request_tags.tag_request(EmbeddingReqInput(text="hi"), {"x-flying-tp": "2"})


# -- max_new_tokens None and the policy --------------------------------------------------


def test_max_new_tokens_as_sglang_reads_it():
    assert placement.max_new_tokens({}) == 128
    assert placement.max_new_tokens({"max_new_tokens": None}) is None
    assert placement.max_new_tokens({"max_new_tokens": 7}) == 7
    assert placement.max_new_tokens(SimpleNamespace(max_new_tokens=None)) is None
    for bad in ("7", [7], True, -1, 2.5):
        with pytest.raises(ValueError):
            placement.max_new_tokens({"max_new_tokens": bad})


def test_kv_tokens_needed():
    # None grows to SGLang's bound limit - prompt - 1; explicit values are the request's own
    assert placement.kv_tokens_needed(100, None, 1000, slack=0) == 999
    assert placement.kv_tokens_needed(100, 20, 1000, slack=0) == 120
    assert placement.kv_tokens_needed(100, 20, 1000) == 120 + placement.ADMISSION_SLACK
    assert placement.kv_tokens_needed(1200, None, 1000, slack=0) == 1200  # never negative
    assert placement.resolved_max_new_tokens(10, None, 100) == 89


NODE = Node(num_engines=4, degrees=(2, 4), engine_capacity=1000)


def _policy(kind="adaptive") -> Policy:
    return Policy(PolicyConfig(kind).validate(), NODE)


def test_none_is_placed_by_its_prompt_alone():
    p = _policy("static-dp")
    assert p.decide(Request(900, None)).mode == "dp"  # not a long-context upgrade
    assert p.decide(Request(999, None)).mode == "dp"
    d = p.decide(Request(1500, None))
    assert (d.mode, d.degree, d.reason) == ("tp", 2, "long context")
    d = p.decide(Request(4000, None))
    assert d.mode == "reject" and "prompt of 4000 tokens" in d.reason
    assert p.decide(Request(10, None, explicit_degree=2)).mode == "tp"
    fast = Costs({1: 10.0, 2: 8.0, 4: 7.0})
    assert _policy().decide(Request(10, None), loads=[], costs=fast).mode == "tp"  # adaptive, idle


def test_dp_only_feature_rules():
    p = _policy("static-dp")
    feature = "LoRA adapters (lora_path)"
    d = p.decide(Request(10, 10, explicit_degree=2, dp_only=feature))
    assert d.mode == "reject" and feature in d.reason and "X-Flying-TP" in d.reason
    d = p.decide(Request(10, 10, priority=5, dp_only=feature))
    assert (d.mode, d.reason) == ("dp", f"{feature} runs in DP")
    d = p.decide(Request(1500, 10, dp_only=feature))
    assert d.mode == "reject" and feature in d.reason and "TP-2" in d.reason
    assert _policy("static-tp").decide(Request(10, 10, dp_only=feature)).mode == "dp"
    assert _policy().decide(Request(10, 10, dp_only=feature), loads=[]).mode == "dp"


def test_least_loaded_group():
    from scheduler.policy import EngineLoad

    loads = [EngineLoad(0, 3, 1), EngineLoad(1, 0, 0), EngineLoad(2, 1, 0), EngineLoad(3, 0, 0)]
    assert least_loaded_group(loads, 2, 4) == ((2, 3), 1)
    assert least_loaded_group(loads, 4, 4) == ((0, 1, 2, 3), 5)


# -- DP-only features --------------------------------------------------------------------


@pytest.mark.parametrize(
    "params,expected",
    [
        ({"max_new_tokens": 4, "temperature": 0.7, "top_k": 2, "n": 2, "stop": ["x"]}, ""),
        # constrained decoding runs in groups (``flying.session.grammar``)
        ({"regex": "a+"}, ""),
        ({"json_schema": '{"type": "object"}'}, ""),
        ({"ebnf": "root ::= 'a'"}, ""),
        ({"structural_tag": "{}"}, ""),
        ({"regex": "a+", "beam_width": 2}, "beam search (beam_width)"),
        ({"beam_width": 4}, "beam search (beam_width)"),
        ({"beam_width": 1}, ""),
    ],
)
def test_sampling_features(params, expected):
    assert placement.dp_only_feature(_gen(sampling_params=params)) == expected


def test_sampling_features_on_sglang_sampling_params():
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = SimpleNamespace(sampling_params=SamplingParams(json_schema='{"type":"object"}'))
    assert placement.dp_only_feature(req) == ""
    req = SimpleNamespace(sampling_params=SamplingParams(), lora_path="adapter")
    assert placement.dp_only_feature(req) == "LoRA adapters (lora_path)"
    req = SimpleNamespace(sampling_params=SamplingParams(max_new_tokens=None), mm_inputs=None)
    assert placement.dp_only_feature(req) == ""


@pytest.mark.parametrize(
    "field,value,feature",
    [
        ("custom_logit_processor", "{}", "custom_logit_processor"),
        ("lora_path", "adapter", "LoRA"),
        ("image_data", ["http://x/a.png"], "multimodal"),
        ("input_embeds", [[0.1]], "input_embeds"),
        ("session_params", {"id": "s"}, "sessions"),
        ("return_routed_experts", True, "return_routed_experts"),
        ("bootstrap_room", 0, "disaggregation"),
        ("routed_dp_rank", 0, "routed_dp_rank"),
    ],
)
def test_request_features(field, value, feature):
    assert feature in placement.dp_only_feature(_gen(**{field: value}))


def test_dp_only_feature_never_raises():
    class Odd:
        @property
        def sampling_params(self):
            raise RuntimeError("boom")

    assert placement.dp_only_feature(Odd())


# -- place() in the HTTP process ---------------------------------------------------------

MANAGER = SimpleNamespace(max_req_input_len=994, context_len=0)  # capacity(1) = 995


@pytest.fixture
def fresh_policy(monkeypatch):
    monkeypatch.setattr(request_tags, "_POLICY", None)


def _normalized(**kw):
    obj = _gen(**kw)
    obj.normalize_batch_and_arguments()
    return obj


def test_dp_only_forced_into_a_group_is_refused_naming_it(cfg, fresh_policy):
    obj = _normalized(sampling_params={"max_new_tokens": 4}, lora_path="adapter")
    request_tags.tag_request(obj, {"x-flying-tp": "2"})
    with pytest.raises(ValueError, match=r"LoRA adapters \(lora_path\)"):
        request_tags.place(obj, [1] * 10, MANAGER)
    constrained = _normalized(sampling_params={"regex": "a+", "max_new_tokens": 4})
    request_tags.tag_request(constrained, {"x-flying-tp": "2"})
    request_tags.place(constrained, [1] * 10, MANAGER)
    assert request_tags.degree_of(constrained) == 2


def test_dp_only_priority_runs_in_dp_and_says_why(cfg, fresh_policy):
    cfg(policy="static-dp")
    obj = _normalized(sampling_params={"max_new_tokens": 4}, lora_path="adapter", priority=5)
    request_tags.place(obj, [1] * 10, MANAGER)
    assert request_tags.degree_of(obj) == 0
    degree, reason = request_tags.where_it_ran(obj, {"id": obj.rid})
    assert degree == 0 and "LoRA adapters (lora_path) runs in DP" == reason
    info = request_tags.placement(degree, 1, reason)
    assert info == {"mode": "dp", "degree": 1, "ranks": [1], "reason": reason}
    constrained = _normalized(sampling_params={"json_schema": "{}"}, priority=5)
    request_tags.place(constrained, [1] * 10, MANAGER)
    assert messages.read_mark(constrained.routing_key).reason == "priority"


def test_priority_marks_for_the_largest_group(cfg, fresh_policy):
    cfg(policy="static-dp")
    obj = _normalized(sampling_params={"max_new_tokens": None}, priority=1)
    request_tags.place(obj, [1] * 10, MANAGER)
    m = messages.read_mark(obj.routing_key)
    assert (m.degree, m.reason) == (2, "priority")
    assert obj.sampling_params["max_new_tokens"] is None  # the engine resolves it as DP does


def test_none_long_prompt_gets_the_groups_bound(cfg, fresh_policy):
    cfg(policy="static-dp")
    obj = _normalized(sampling_params={"max_new_tokens": None})
    request_tags.place(obj, [1] * 1500, MANAGER)
    assert request_tags.degree_of(obj) == 2
    cap2 = (994 + placement.SLOTS_ABOVE_INPUT_LIMIT) * 2 - placement.ADMISSION_SLACK
    assert obj.sampling_params["max_new_tokens"] == cap2 - 1500
    # a chat request without max_tokens and a short prompt stays DP
    obj = _normalized(sampling_params={"max_new_tokens": None})
    request_tags.place(obj, [1] * 10, MANAGER)
    assert request_tags.degree_of(obj) == 0


def test_dp_only_long_prompt_refused_naming_it(cfg, fresh_policy):
    obj = _normalized(sampling_params={"max_new_tokens": 8}, lora_path="adapter")
    with pytest.raises(ValueError, match=r"LoRA adapters \(lora_path\)"):
        request_tags.place(obj, [1] * 1500, MANAGER)
    constrained = _normalized(sampling_params={"ebnf": "root ::= 'a'", "max_new_tokens": 8})
    request_tags.place(constrained, [1] * 1500, MANAGER)
    assert request_tags.degree_of(constrained) == 2


# -- placement log: every key deleted ----------------------------------------------------


class FakeStore:
    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def delete_key(self, key):
        return self.data.pop(key, None) is not None


def test_lookup_reads_once_and_deletes():
    store = FakeStore()
    placement_log.expect("r1")
    placement_log.record(store, "r1", 2)
    assert placement_log.lookup(store, "r1", finished=False) == (2, "")
    assert store.data == {}
    assert placement_log.lookup(store, "r1", finished=True) == (2, "")
    placement_log.forget(store, "r1")
    assert "r1" not in placement_log._SEEN and "r1" not in placement_log._PENDING


def test_request_ended_without_output_deletes_its_key():
    store = FakeStore()
    placement_log.expect("r2")
    placement_log.record(store, "r2", 2, "")
    placement_log.forget(store, "r2")  # e.g. the client left before the first token
    assert store.data == {}


def test_controller_deletes_records_of_aborted_requests():
    store = FakeStore()
    rec = placement_log.Recorded(limit=3)
    for rid in ("a1", "a2", "b1", "b2"):
        placement_log.record(store, rid, 2)
        rec.add(rid)
    assert len(rec) == 3  # bounded memory: the oldest is forgotten, not deleted
    assert rec.aborted(store, "a") == 1  # "a1" was forgotten; SGLang aborts by prefix
    assert rec.aborted(store, "", abort_all=True) == 2
    assert set(store.data) == {"flying/placed/a1"}


def test_demotion_reason_travels():
    store = FakeStore()
    placement_log.record(store, "r3", 0, "priority: kept in DP")
    assert placement_log.lookup(store, "r3", finished=True) == (0, "priority: kept in DP")


# -- the controller and its hook ---------------------------------------------------------


#: engines' measured decode step per degree (ms): a group pays (TP-2 20 % faster)
FAST_STEPS = {"1": 10.0, "2": 8.0}


class FakeController:
    def __init__(self, loads=(0, 0), policy=None, decode_ms=FAST_STEPS):
        self.server_args = SimpleNamespace(dp_size=len(loads))
        self.max_req_input_len = 994
        self._loads = loads
        self.load_snapshot_reader = SimpleNamespace(read_all=self._read)
        self.workers = [f"sock{i}" for i in range(len(loads))]
        self._flying_store = FakeStore()
        for r in range(len(loads)):
            self._flying_store.set(f"flying/status/{r}", json.dumps({"rank": r, "decode_ms": decode_ms}))
        # the costs refresher's own store client, as ``controller._costs`` builds it
        self._flying_costs = costs_reader.CostsReader(lambda: self._flying_store, len(loads))
        self.sent: list = []
        self.dispatched_dp: list = []
        flying_controller.attach(self)

    def _read(self):
        return [
            SimpleNamespace(dp_rank=r, num_running_reqs=n, num_waiting_reqs=0)
            for r, n in enumerate(self._loads)
        ]


def _tok(routing_key=None, priority=None, lora_path=None, **params):
    from sglang.srt.sampling.sampling_params import SamplingParams

    params.setdefault("max_new_tokens", 8)
    return SimpleNamespace(
        rid="rid-" + str(random.random()), routing_key=routing_key, priority=priority,
        input_ids=[1, 2, 3], sampling_params=SamplingParams(**params), lora_path=lora_path,
    )


def test_binds_for_marked_request_strips_the_marker(cfg):
    ctl = FakeController()
    req = _tok(routing_key=messages.mark("mine", 2, "explicit"))
    binds = flying_controller.binds_for(ctl, req)
    assert [r for r, _ in binds] == [0, 1] and req.routing_key == "mine"


def test_forged_marker_is_dropped_and_runs_dp(cfg):
    ctl = FakeController()
    req = _tok(routing_key="flying:tp=-2;mine")
    assert flying_controller.binds_for(ctl, req) == [] and req.routing_key == "mine"


def test_dp_only_never_bound_by_the_controller(cfg):
    cfg(policy="adaptive")
    ctl = FakeController()
    assert flying_controller.binds_for(ctl, _tok(lora_path="adapter")) == []
    marked = _tok(routing_key=messages.mark(None, 2, "priority"), lora_path="adapter")
    assert flying_controller.binds_for(ctl, marked) == []
    # without it, on an idle node (its first arrival): a group; constrained too
    assert flying_controller.binds_for(FakeController(), _tok())
    assert flying_controller.binds_for(FakeController(), _tok(regex="a+"))


def test_priority_bound_keeps_busy_members_in_dp(cfg):
    cfg(policy="static-dp", priority_max_paused=2)
    busy = FakeController(loads=(2, 1))
    req = _tok(routing_key=messages.mark(None, 2, "priority"), priority=1)
    assert flying_controller.binds_for(busy, req) == []
    degree, reason = placement_log._parse(busy._flying_store.data["flying/placed/" + req.rid])
    assert degree == 0 and "--flying-priority-max-paused 2" in reason
    ok = FakeController(loads=(1, 1))
    req = _tok(routing_key=messages.mark(None, 2, "priority"), priority=1)
    assert [r for r, _ in flying_controller.binds_for(ok, req)] == [0, 1]


def test_controller_hook_contains_any_failure(cfg, monkeypatch):
    from sglang_patches import data_parallel_controller as hook

    cfg(policy="adaptive")
    ctl = FakeController()

    def broken():
        raise RuntimeError("load snapshot unreadable")

    ctl.load_snapshot_reader = SimpleNamespace(read_all=broken)
    calls = []

    def original(controller, req, *a, **k):
        calls.append(req)

    req = _tok(routing_key=messages.mark("mine", 2, "priority"))
    cfg(policy="adaptive", priority_max_paused=0)
    hook.dispatching_with_trace(original, ctl, req)
    assert calls == [req] and req.routing_key == "mine"
    # a request the controller cannot even read
    odd = SimpleNamespace(rid="odd")
    hook.dispatching_with_trace(original, ctl, odd)
    assert calls[-1] is odd


class _Sock:
    """An engine's socket as the controller hook uses it: ``send(bytes)``; ``recv`` gives
    the last bytes back, so SGLang's own ``sock_recv`` decodes what was sent."""

    def __init__(self, name: str, log: list, fail: bool = False):
        self.name, self.log, self.fail = name, log, fail

    def send(self, data: bytes, flags: int = 0) -> None:
        if self.fail:
            raise OSError("socket gone")
        self.log.append((self.name, data))
        self.last = data

    def recv(self, flags: int = 0) -> bytes:
        return self.last

    def recv_pyobj(self, flags: int = 0):
        import pickle

        return pickle.loads(self.last)


def _sockets(ctl, sent: list, fail: bool = False) -> None:
    ctl.workers = [_Sock(f"sock{i}", sent, fail) for i in range(len(ctl.workers))]


def test_controller_hook_sends_leader_last_and_falls_back(cfg):
    from sglang.srt.managers.io_struct import sock_recv, unwrap_from_pickle

    from sglang_patches import data_parallel_controller as hook

    ctl = FakeController()
    sent: list = []
    _sockets(ctl, sent)
    dp = []
    hook.dispatching_with_trace(lambda c, r: dp.append(r), ctl, _tok(routing_key=messages.mark(None, 2)))
    assert [name for name, _ in sent] == ["sock1", "sock0"] and dp == []
    assert sent[0][1] == sent[1][1]  # one encoding for every member
    bind = unwrap_from_pickle(sock_recv(ctl.workers[0]))
    assert bind.degree == 2 and bind.ranks == (0, 1)

    _sockets(ctl, sent, fail=True)
    req = _tok(routing_key=messages.mark(None, 2))
    hook.dispatching_with_trace(lambda c, r: dp.append(r), ctl, req)
    assert dp == [req]


def test_dispatcher_sees_aborts(cfg):
    from sglang.srt.managers.io_struct import AbortReq

    from sglang_patches import data_parallel_controller as hook

    ctl = FakeController()
    placement_log.record(ctl._flying_store, "gone-1", 2)
    ctl._flying_recorded.add("gone-1")
    seen = []
    wrapped = hook._FlyingDispatcher(ctl, seen.append)
    wrapped(AbortReq(rid="gone-1"))
    assert not [k for k in ctl._flying_store.data if k.startswith("flying/placed/")] and len(seen) == 1


@pytest.mark.parametrize("holder", [0, 1])
def test_an_engines_upgrade_ask_becomes_binds_for_its_group(cfg, holder):
    """An engine's Upgrade (pickled, as engines send it) never reaches SGLang's
    dispatcher: it becomes one bind per member of the holder's group, leader last."""
    from sglang.srt.managers.io_struct import sock_recv, unwrap_from_pickle, wrap_as_pickle

    from sglang_patches import data_parallel_controller as hook

    ctl = FakeController()
    sent: list = []
    _sockets(ctl, sent)
    seen: list = []
    ask = messages.Upgrade("long-1", holder, 0.0)
    hook._FlyingDispatcher(ctl, seen.append)(wrap_as_pickle(ask))
    assert seen == [] and [name for name, _ in sent] == ["sock1", "sock0"]
    binds = [unwrap_from_pickle(sock_recv(sock)) for sock in ctl.workers]
    assert {b.bind_id for b in binds} == {binds[0].bind_id}
    bind = binds[0]
    assert bind.req is None and bind.upgrade == ask and bind.rid == "long-1"
    assert bind.ranks == (0, 1) and bind.degree == 2 and bind.reason == "long"


def test_no_upgrade_under_the_manual_policy_or_before_the_probe(cfg, monkeypatch):
    from sglang_patches import data_parallel_controller as hook

    ask = messages.Upgrade("long-2", 1, 0.0)
    ctl = FakeController()
    assert flying_controller.upgrade_binds_for(ctl, ask) != []
    monkeypatch.setattr(flying_controller, "_groups_open", lambda ctl: False)
    assert flying_controller.upgrade_binds_for(ctl, ask) == []  # the probe has not passed
    monkeypatch.setattr(flying_controller, "_groups_open", lambda ctl: True)
    cfg(policy="manual")
    ctl = FakeController()
    assert flying_controller.upgrade_binds_for(ctl, ask) == []
    seen: list = []
    hook._FlyingDispatcher(ctl, seen.append)(ask)  # not sent on, not dispatched
    assert seen == []


# -- HTTP surface ------------------------------------------------------------------------


def test_header_middleware_answers_400_before_the_endpoint(cfg):
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    hits = []

    async def endpoint(request):
        hits.append(1)
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/generate", endpoint, methods=["POST"]),
                            Route("/v1/chat/completions", endpoint, methods=["POST"])])
    app.add_middleware(request_tags.HeaderCheck)
    client = TestClient(app)
    r = client.post("/generate", headers={"X-Flying-TP": "banana"})
    assert r.status_code == 400 and "X-Flying-TP" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", headers={"x-smg-routing-key": "flying:tp=2"})
    assert r.status_code == 400 and "reserved" in r.json()["message"]
    assert client.post("/generate", headers={"X-Priority": "high"}).status_code == 200
    assert client.post("/generate").status_code == 200
    assert hits == [1, 1]


@pytest.mark.parametrize("enabled", [False, True])
def test_metrics_only_with_enable_metrics(cfg, monkeypatch, enabled):
    import sys

    from fastapi import FastAPI

    from flying.node import launch

    app = FastAPI()
    monkeypatch.setitem(
        sys.modules, "sglang.srt.entrypoints.http_server", SimpleNamespace(app=app)
    )
    launch.add_routes(2, enable_metrics=enabled)
    paths = {getattr(r, "path", None) for r in app.router.routes}
    assert "/flying/status" in paths
    assert ("/metrics" in paths) is enabled


def test_replay_roundtrips_none_and_dp_only():
    from scheduler.replay import record, replay

    p = _policy("static-dp")
    reqs = [Request(10, None), Request(1500, None), Request(10, 5, priority=3, dp_only="x")]
    lines = [record(r, None, p.decide(r)) for r in reqs]
    assert replay(lines, PolicyConfig("static-dp"), NODE) == (3, [])


def test_explicit_tp_waits_for_the_start_up_probe(cfg, monkeypatch):
    from flying.node import probe

    monkeypatch.setitem(probe._STATE, "gate", probe.PROBING)
    with pytest.raises(ValueError, match="probe is running"):
        request_tags.tag_request(_gen(), {"x-flying-tp": "2"})
    obj = _gen()  # the probe's own request carries the per-launch secret
    request_tags.tag_request(obj, {"x-flying-tp": "2", probe.PROBE_HEADER: probe.secret()})
    assert messages.read_mark(obj.routing_key).degree == 2
    monkeypatch.setitem(probe._STATE, "gate", "closed:the start-up probe failed: x")
    with pytest.raises(ValueError, match="TP groups are off on this node"):
        request_tags.tag_request(_gen(), {"x-flying-tp": "2"})


def test_controller_keeps_groups_only_where_they_pay_and_logs_replayable_decisions(
    cfg, tmp_path
):
    from scheduler import replay

    log = tmp_path / "decisions.jsonl"
    cfg(policy="adaptive", decision_log=str(log))
    slow = FakeController(decode_ms={"1": 10.0, "2": 13.0})
    assert flying_controller.binds_for(slow, _tok()) == []  # a group is slower: DP
    prio = _tok(routing_key=messages.mark(None, 2, "priority"), priority=1)
    assert flying_controller.binds_for(slow, prio) == []  # priority too
    degree, reason = placement_log._parse(slow._flying_store.data["flying/placed/" + prio.rid])
    assert degree == 0 and "does not pay" in reason
    unmeasured = FakeController(decode_ms={})
    assert flying_controller.binds_for(unmeasured, _tok()) == []
    fast = FakeController()
    assert flying_controller.binds_for(fast, _tok())
    lines = log.read_text().splitlines()
    assert len(lines) == 2  # the last controller's log: its header and one decision
    assert replay.main([str(log)]) == 0
    assert replay.main([str(log), "--config", '{"tp_gain": 0.5}']) == 1


def test_the_controller_logs_upgrade_asks_and_starts_its_log_before_any_bind(cfg, tmp_path):
    """The log starts (truncated, head first) when the controller attaches, before any
    bind, so the engines' appended lines are never cut; every upgrade ask's answer is a
    line that replays through ``Policy.upgrade``."""
    from scheduler import replay

    log = tmp_path / "decisions.jsonl"
    log.write_text("a previous launch's line\n")
    cfg(decision_log=str(log))
    ctl = FakeController()
    assert list(json.loads(log.read_text())) == ["config", "node"]
    with open(log, "a") as engine:  # an engine appends while the controller logs
        engine.write(json.dumps({"kind": "move", "bind": "x", "degree": 2, "ranks": [0, 1],
                                 "rank": 0, "lens": [9], "rooms": [50, 50], "loads": [0, 0],
                                 "owners": [0]}) + "\n")
    assert flying_controller.upgrade_binds_for(ctl, messages.Upgrade("long-1", 1, 0.0))
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x.get("kind") for x in lines] == [None, "move", "upgrade"]
    assert lines[2]["holder"] == 1 and lines[2]["rid"] == "long-1"
    assert lines[2]["decision"] == {"mode": "tp", "degree": 2, "reason": "long context",
                                     "turn": False}
    assert replay.main([str(log)]) == 0
    assert replay.main([str(log), "--config", '{"policy": "manual"}']) == 1


def test_an_empty_prompt_or_an_id_outside_the_vocabulary_is_refused():
    bare = SimpleNamespace(input_embeds=None, image_data=None, video_data=None, audio_data=None)
    with pytest.raises(ValueError, match="empty"):
        request_tags.refuse_bad_prompt(bare, [], 512)
    with pytest.raises(ValueError, match="token id 512, outside .* \\[0, 512\\)"):
        request_tags.refuse_bad_prompt(bare, [1, 512], 512)
    with pytest.raises(ValueError, match="token id -5"):
        request_tags.refuse_bad_prompt(bare, [-5, 1], 512)
    request_tags.refuse_bad_prompt(bare, [0, 511], 512)
    request_tags.refuse_bad_prompt(bare, [1, 9999], None)  # no vocabulary known
    request_tags.refuse_bad_prompt(bare, None, 512)  # not tokenized here: SGLang's to check
    request_tags.refuse_bad_prompt(SimpleNamespace(input_embeds=[[0.0]]), [], 512)
    request_tags.refuse_bad_prompt(SimpleNamespace(image_data=["x.png"]), [], 512)
