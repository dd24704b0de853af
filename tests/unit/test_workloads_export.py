"""Export to SGLang's Mooncake trace format, read back with SGLang's own loader."""

from __future__ import annotations

import json

import pytest

from workloads.load.export import (
    export,
    load_mooncake,
    load_tokenizer,
    mooncake_records,
    sglang_block_tokens,
    write_jsonl,
)
from workloads.load.presets import build_preset
from workloads.load.replay import replay_trace

pytestmark = pytest.mark.unit


def test_mooncake_records_fields_times_and_unique_blocks():
    trace = build_preset("cpu-burst")
    records = mooncake_records(trace, block_tokens=64)
    assert len(records) == len(trace)
    for rec, req in zip(records, trace, strict=True):
        assert set(rec) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert isinstance(rec["timestamp"], int)
        assert rec["timestamp"] == round(req.arrival_s * 1000)
        assert (rec["input_length"], rec["output_length"]) == (req.prompt_len, req.output_len)
        assert len(rec["hash_ids"]) == max(1, round(req.prompt_len / 64))
    ids = [h for rec in records for h in rec["hash_ids"]]
    assert len(ids) == len(set(ids))  # no two prompts share a block (no shared prefix)
    with pytest.raises(ValueError):
        mooncake_records(trace, block_tokens=0)


def test_vidur_csv_export_replays_to_the_same_requests(tmp_path):
    trace = build_preset("cpu-small")[:20]
    export(trace, tmp_path / "t.csv", "vidur-csv", 512)
    back = replay_trace(tmp_path / "t.csv", with_input_ids=False)
    assert [(r.prompt_len, r.output_len) for r in back] == [
        (r.prompt_len, r.output_len) for r in trace]
    assert [r.arrival_s for r in back] == pytest.approx(
        [r.arrival_s - trace[0].arrival_s for r in trace], abs=1e-6)


def test_sglang_loader_reads_our_file(tmp_path):
    """SGLang's Mooncake loader and prompt builder take the exported times and output
    lengths as they are; prompt lengths follow the block count."""
    from flying.node.demo_model import ensure_demo_model

    tokenizer = load_tokenizer(ensure_demo_model())
    block = sglang_block_tokens(tokenizer)
    trace = build_preset("cpu-gamma")[:12]
    path = tmp_path / "trace.jsonl"
    write_jsonl(mooncake_records(trace, block), path)
    assert all(json.loads(line)["hash_ids"] for line in path.read_text().splitlines())
    sent = load_mooncake(path, tokenizer)
    assert [r.arrival_s for r in sent] == pytest.approx(
        [round(r.arrival_s * 1000) / 1000 for r in trace])
    assert [r.output_len for r in sent] == [r.output_len for r in trace]
    one_block = [r.prompt_len for r in sent]
    assert all(block < n < 2 * block for n in one_block)  # cpu-gamma prompts: one block
    assert len({tuple(r.input_ids or []) for r in sent}) == len(sent)  # distinct prompts
