"""The default adaptive policy on real SGLang (2 engines of the demo model).

At light load the DP controller places a request from the engines' load snapshots and
their measured step costs (the HTTP process sees neither and leaves it unmarked): in a
TP-2 group only where a group step is measured faster than one engine's (on the demo
model on CPU it is slower, so the node stays in DP). The response says where it ran,
the tokens equal transformers', and the decision log replays to the same decisions.
"""

from __future__ import annotations

import json

import pytest
import requests

from scheduler import replay
from scheduler.policy import Costs, PolicyConfig
from tests.conftest import MAX_TOTAL_TOKENS, serve
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def adaptive_server(demo_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("adaptive")
    server_gen = serve(  # --flying-policy adaptive: the default
        log_dir / "server.log", "--model-path", str(demo_model_dir),
        "--dp-size", "2", "--max-total-tokens", str(MAX_TOTAL_TOKENS),
        "--flying-decision-log", str(log_dir / "decisions.jsonl"),
    )
    server = next(server_gen)
    server.decisions = log_dir / "decisions.jsonl"
    yield server
    server_gen.close()


def test_engines_measure_step_costs_per_mode(adaptive_server):
    """The start-up probe ran one request in a TP-2 group and one in DP: every engine
    has a measured single-request decode step for both."""
    doc = requests.get(adaptive_server.url + "/flying/status", timeout=30).json()
    for engine in doc["engines"]:
        assert set(engine["decode_ms"]) == {"1", "2"}, engine
        assert all(ms > 0 for ms in engine["decode_ms"].values())


def test_light_load_placement_follows_measured_costs(adaptive_server, demo_model_dir):
    """At light load the controller puts a request in a TP-2 group only where the
    engines measured a group step at least ``--flying-tp-gain`` faster than one
    engine's; each decision is in the log with its inputs and replays offline to the
    same decision."""
    for ids in prompts(3, 9, seed=21):
        body = adaptive_server.generate_ids(ids, 10)
        assert body["output_ids"] == greedy_tokens(demo_model_dir, ids, 10)
        line = json.loads(adaptive_server.decisions.read_text().splitlines()[-1])
        costs = Costs.from_json(line["costs"])
        assert costs is not None and costs.gain(2) is not None
        want = "tp" if costs.gain(2) >= PolicyConfig().tp_gain else "dp"
        assert line["decision"]["mode"] == want, line
        assert body["meta_info"]["flying"]["mode"] == want, body["meta_info"]
        if want == "dp":
            assert "does not pay" in line["decision"]["reason"]
    assert replay.main([str(adaptive_server.decisions)]) == 0
    # The same log under a policy that allows a slower group: every decision differs.
    assert replay.main([str(adaptive_server.decisions), "--config", '{"tp_gain": -10}']) == int(
        want == "dp"
    )
