"""The default adaptive policy on real SGLang (2 engines of the demo model).

At light load the DP controller places a request in a TP-2 group from the engines' load
snapshots (the HTTP process cannot see load and leaves it unmarked); the response says
so in ``meta_info.flying`` and the tokens equal transformers'.
"""

from __future__ import annotations

import pytest

from tests.conftest import MAX_TOTAL_TOKENS, serve
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def adaptive_server(demo_model_dir, tmp_path_factory):
    yield from serve(  # --flying-policy adaptive: the default
        tmp_path_factory.mktemp("adaptive") / "server.log", "--model-path", str(demo_model_dir),
        "--dp-size", "2", "--max-total-tokens", str(MAX_TOTAL_TOKENS),
    )


def test_light_load_request_runs_in_a_tp_group(adaptive_server, demo_model_dir):
    for ids in prompts(2, 9, seed=21):
        body = adaptive_server.generate_ids(ids, 10)
        assert body["meta_info"]["flying"] == {
            "mode": "tp", "degree": 2, "ranks": [0, 1], "node": f"127.0.0.1:{adaptive_server.port}"
        }
        assert body["output_ids"] == greedy_tokens(demo_model_dir, ids, 10)
