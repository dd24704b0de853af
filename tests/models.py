"""Tiny deterministic checkpoints of every model family Flying claims, for tests.

Nothing is downloaded: each checkpoint is a transformers model with random weights from
a fixed seed, saved with the demo model's byte-level tokenizer (``flying.node.demo_model``)
so that SGLang can serve it and ``tests.reference`` can run it. The Llama family *is* a
small demo checkpoint (the demo builder itself); the others copy its tokenizer.

Invariants (what the tests rely on):
- 8 query heads and 4 KV heads in every family (``FAMILIES``), so TP degrees 2 and 4
  split the heads; the ``REPLICATED`` checkpoints have fewer KV heads (2, 1) than a
  TP-4 (TP-2) group's ranks, which then replicate them as SGLang's TP does.
- float32 weights, so SGLang on CPU and transformers agree token for token.
- vocab = the demo tokenizer's 512 entries; ``tests.reference.prompts`` ids are valid.
- Norm weights and biases are random too (transformers initialises them to 1 and 0),
  so that Qwen2's QKV bias, Qwen3's per-head q/k norms and the tied variant's o_proj
  bias actually change the output if a TP view gets them wrong.
- A checkpoint lives in ``<cache>/test-models/<name>-<hash>``, the hash taken over the
  recipe below; it is created once (written to a temporary sibling, then renamed).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flying.node.demo_model import DemoSpec, default_cache_dir, ensure_demo_model

#: Bump when the recipe changes, so stale caches are not reused.
RECIPE_VERSION = 1

HEADS, KV_HEADS = 8, 4
SEED = 0
INIT_STD = 0.08

#: The Llama family: a small demo checkpoint (the demo builder, its tokenizer).
LLAMA_SPEC = DemoSpec(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2048,
    init_std=INIT_STD, seed=SEED,
)


@dataclass(frozen=True)
class Family:
    """One test checkpoint: a transformers architecture and its config overrides.

    ``architecture`` is both the transformers class and ``config.architectures[0]``,
    which is what SGLang resolves its own model class from.
    """

    name: str
    architecture: str
    config: dict = field(default_factory=dict)
    #: What a TP view of this family has to get right (documentation; not hashed).
    exercises: str = ""

    def recipe(self) -> dict:
        spec = {k: v for k, v in asdict(self).items() if k != "exercises"}
        return {"recipe": RECIPE_VERSION, "seed": SEED, **spec}

    def key(self) -> str:
        blob = json.dumps(self.recipe(), sort_keys=True).encode()
        return f"{self.name}-{hashlib.sha256(blob).hexdigest()[:10]}"


_COMMON = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
    max_position_embeddings=2048, initializer_range=INIT_STD, hidden_act="silu",
    tie_word_embeddings=False,
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        # Built by the demo builder from LLAMA_SPEC (config and key unused).
        Family("llama", "LlamaForCausalLM", exercises="fused QKV / gate_up row blocks"),
        Family(
            "qwen2", "Qwen2ForCausalLM", {**_COMMON},
            exercises="QKV bias rows; down_proj(x, forward_batch=...)",
        ),
        Family(
            "qwen3", "Qwen3ForCausalLM", {**_COMMON, "head_dim": 16},
            exercises="per-head q_norm/k_norm on the rank's heads; down_proj kwargs",
        ),
        # head_dim 16 with hidden 64: q_size (128) != hidden, as in Mistral-Nemo. SGLang's
        # Llama attention ignores sliding_window (full attention); transformers applies
        # it, so it is kept longer than any test sequence.
        Family(
            "mistral", "MistralForCausalLM",
            {**_COMMON, "hidden_size": 64, "head_dim": 16, "sliding_window": 4096},
            exercises="SGLang serves it with its Llama classes; head_dim != hidden/heads",
        ),
        # Larger init: at 0.08 the tied head echoes the last input token (12 x the same).
        Family(
            "llama-tied", "LlamaForCausalLM",
            {**_COMMON, "tie_word_embeddings": True, "attention_bias": True,
             "initializer_range": 0.2},
            exercises="tied lm_head (replicated); QKV bias and o_proj bias on rank 0 only",
        ),
    )
}


#: Fewer KV heads than a group's degree (8 query heads): each KV head on degree/H_kv
#: ranks, a DP KV slot holding H_kv tokens of the group (``layout.KvSplit``).
REPLICATED: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "qwen2-kv2", "Qwen2ForCausalLM", {**_COMMON, "num_key_value_heads": 2},
            exercises="Qwen2/2.5 0.5B-3B style: 2 KV heads, split at TP-2, replicated at "
            "TP-4 (k/v bias rows replicated too)",
        ),
        Family(
            "llama-kv1", "LlamaForCausalLM", {**_COMMON, "num_key_value_heads": 1},
            exercises="one KV head (MQA): replicated on every rank of any group",
        ),
    )
}

#: Every test checkpoint by name.
CHECKPOINTS: dict[str, Family] = {**FAMILIES, **REPLICATED}


def cache_root() -> Path:
    return default_cache_dir() / "test-models"


def _tokenizer(root: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_demo_model(LLAMA_SPEC, root))


def _randomize_vectors(model, seed: int) -> None:
    """Norm weights ~ 1 + N(0, 0.2), biases ~ N(0, INIT_STD); matrices untouched."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() != 1:
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(INIT_STD * noise)


def _write(family: Family, out: Path, root: Path) -> None:
    import torch
    import transformers

    tok = _tokenizer(root)
    config_cls = getattr(transformers, family.architecture.replace("ForCausalLM", "Config"))
    config = config_cls(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, **family.config,
    )
    config.architectures = [family.architecture]
    torch.manual_seed(SEED)
    model = getattr(transformers, family.architecture)(config).to(torch.float32).eval()
    _randomize_vectors(model, SEED + 1)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "flying_test_model.json").write_text(json.dumps(family.recipe(), sort_keys=True))


def ensure_model(name: str, cache_dir: Path | None = None) -> Path:
    """The checkpoint directory of ``name`` (``CHECKPOINTS``), created on first use."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    if name == "llama":
        return ensure_demo_model(LLAMA_SPEC, root)
    family = CHECKPOINTS[name]
    out = root / family.key()
    if (out / "flying_test_model.json").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{family.key()}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write(family, tmp, root)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; its checkpoint is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return out
