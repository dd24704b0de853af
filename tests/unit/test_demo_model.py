from __future__ import annotations

import hashlib

import pytest

from flying.node.demo_model import DEFAULT_SPEC, DemoSpec, ensure_demo_model

pytestmark = pytest.mark.unit

TINY = DemoSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=300)


def _digest(path):
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.suffix in {".safetensors", ".json"}
    }


def test_same_spec_gives_identical_checkpoint(tmp_path):
    a = ensure_demo_model(TINY, tmp_path / "a")
    b = ensure_demo_model(TINY, tmp_path / "b")
    assert _digest(a) == _digest(b)
    assert ensure_demo_model(TINY, tmp_path / "a") == a  # cached, not rebuilt


def test_tokenizer_is_byte_complete(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_demo_model(TINY, tmp_path))
    text = "naïve café ✈ flying\n\t 123"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert len(tok) <= TINY.vocab_size


def test_default_spec_allows_tp_up_to_4():
    assert DEFAULT_SPEC.num_key_value_heads % 4 == 0
    assert DEFAULT_SPEC.num_attention_heads % 4 == 0
