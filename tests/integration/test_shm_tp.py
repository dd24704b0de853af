"""Vanilla SGLang ``--tp-size N`` on the CPU platform, with the shared-memory all-reduce.

Starts ``python -m flying.launch --tp-size N --dp-size 1`` on the demo checkpoint (the
launcher adds ``--dtype float32`` and ``--max-total-tokens`` on CPU), and checks that

- every rank's log says its TP group uses the shared-memory path (all-reduce of the
  row-parallel layers, and the vocab-parallel logits all-gather),
- greedy tokens equal transformers' ``LlamaForCausalLM`` on the same checkpoint,
- no shared-memory segment is left in /dev/shm after the server stops.

Self-contained: its own server fixture and reference. TP-4 runs 4 ranks on 2 cores,
which works (ranks yield to each other while waiting) but is slow to start.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from workloads.measure.server import Server

pytestmark = pytest.mark.integration

NEW_TOKENS = 12
PROMPTS = [
    [5, 77, 301, 42, 9, 250, 13, 88],
    [400, 12, 12, 99, 187, 3, 60, 222, 311, 18, 71, 150, 9],
]


def _segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("flying_shm_ar_*")}


def _reference(model_dir: Path, ids: list[int]) -> list[int]:
    """Greedy continuation with transformers (float32, no EOS stop)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out, past, step = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            res = model(input_ids=step, past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
            step = torch.tensor([[out[-1]]])
    return out


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from flying.node.demo_model import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture(scope="module")
def references(model_dir: Path) -> list[list[int]]:
    return [_reference(model_dir, p) for p in PROMPTS]


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_greedy_matches_transformers_over_shared_memory(tp, model_dir, references, tmp_path):
    before = _segments()
    server = Server(["--model-path", str(model_dir), "--tp-size", str(tp), "--dp-size", "1",
                     "--max-total-tokens", "2048"], tmp_path / "server.log")
    try:
        server.wait_ready()
        outputs = [server.generate_ids(p, NEW_TOKENS)["output_ids"] for p in PROMPTS]
        log = server.log()
    finally:
        server.stop()
    assert outputs == references
    ranks = list(range(tp))
    for r in ranks:
        assert re.search(
            rf"TP{r}\] flying: group tp:\d+ \(ranks {re.escape(str(ranks))}\) uses shared-memory",
            log,
        ), f"TP{r} does not report the shared-memory path:\n{server.log_tail()}"
    assert re.search(r"TP0\] flying: group tp:\d+ .*: all_gather of .* via shared memory", log)
    assert _segments() <= before
