"""transformers as the reference oracle: greedy tokens from ``LlamaForCausalLM``."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4)
def _model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def greedy_tokens(model_path: str, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation with transformers, never stopping at EOS (like ignore_eos)."""
    import torch

    model = _model(str(model_path))
    ids = torch.tensor([input_ids])
    out: list[int] = []
    past = None
    with torch.no_grad():
        step_input = ids
        for _ in range(max_new_tokens):
            res = model(input_ids=step_input, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            step_input = torch.tensor([[nxt]])
    return out


def prompts(n: int, length: int, seed: int = 0, vocab: tuple[int, int] = (3, 500)) -> list[list[int]]:
    """Deterministic token-id prompts that avoid the demo model's special tokens."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(*vocab) for _ in range(length + i)] for i in range(n)]
