"""TP views on SGLang's own model classes, per family, without a server.

A child process (SGLang's globals and a one-rank gloo world stay out of the test
process) loads each test checkpoint (``tests.models``) with SGLang's model loader at
tp_size=1, as an engine does, and checks per layer, for TP degrees 2 and 4, that the
ranks' outputs recompose the DP outputs of SGLang's own module code:

- attention prepare (QKV projection, split by the divided sizes, Qwen3's per-head q/k
  norm, rotary embedding): the ranks' q concatenated == DP's, and each rank's k and v ==
  DP's heads that the rank holds (``layout.KvSplit``: split, or one head replicated on
  several ranks for the ``REPLICATED`` checkpoints, fewer KV heads than ranks);
- ``o_proj``: the ranks' partial outputs summed == DP's (bias once: rank 0);
- the MLP module's own forward, called as the decoder layer calls it
  (``mlp(x, forward_batch=...)``; Qwen2/Qwen3 pass ``forward_batch=`` on to
  ``down_proj``): the ranks' outputs summed == DP's.

The reduction is the identity inside the views and the sum is taken here, so one
process plays every rank. ~20 s, nearly all of it importing SGLang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models import CHECKPOINTS, ensure_model
from workloads.microbench.sglang_model import init_engine, load

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DEGREES = (2, 4)
#: SGLang's class for each family (Mistral: SGLang's Llama classes, subclassed).
EXPECTED = {
    "llama": ("LlamaForCausalLM", "LlamaAttention", "LlamaMLP"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Attention", "Qwen2MLP"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Attention", "Qwen2MLP"),
    "mistral": ("MistralForCausalLM", "LlamaAttention", "LlamaMLP"),
    "llama-tied": ("LlamaForCausalLM", "LlamaAttention", "LlamaMLP"),
    "qwen2-kv2": ("Qwen2ForCausalLM", "Qwen2Attention", "Qwen2MLP"),
    "llama-kv1": ("LlamaForCausalLM", "LlamaAttention", "LlamaMLP"),
}


@pytest.fixture(scope="module")
def report() -> dict:
    paths = {name: str(ensure_model(name)) for name in CHECKPOINTS}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.unit.test_views_families", json.dumps(paths)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_views_recompose_sglang_layers(report, family):
    got = report[family]
    assert "error" not in got, got.get("error")
    assert tuple(got["classes"]) == EXPECTED[family]
    if family == "mistral":
        assert "LlamaForCausalLM" in got["bases"]
    for degree in DEGREES:
        diffs = got["max_abs_diff"][str(degree)]
        assert set(diffs) == {"q", "k", "v", "o_proj", "mlp"}, diffs
        assert max(diffs.values()) < 1e-4, (degree, diffs)
    assert got["views_share_storage"]
    assert got["restored"]
    assert got["layer_copies"]


# -- the child process ---------------------------------------------------------------


def _prepare(attn, positions, x):
    """(q, k, v) as the family's attention forward computes them before attending."""
    prepare = getattr(attn, "forward_prepare_native", None)
    if prepare is not None:  # Llama/Mistral, Qwen3 (q/k norm inside)
        return prepare(positions=positions, hidden_states=x)
    qkv, _ = attn.qkv_proj(x)  # Qwen2: the same steps inline in its forward
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k = attn.rotary_emb(positions, q, k)
    return q, k, v


def _check_family(model_path: str) -> dict:
    import torch

    from flying.substrate.layout import KvSplit
    from flying.substrate.weight_views import build_shards, shares_storage, tp_layers

    model = load(model_path)
    layer = model.model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    gen = torch.Generator().manual_seed(0)
    tokens = 7
    x = torch.randn(tokens, attn.hidden_size, generator=gen)
    positions = torch.arange(3, 3 + tokens)
    attn_out = torch.randn(tokens, attn.q_size, generator=gen)
    fb = None  # the kwarg itself is what matters: SGLang passes it, possibly None
    with torch.no_grad():
        full = dict(zip("qkv", _prepare(attn, positions, x), strict=True))
        full["o_proj"] = attn.o_proj(attn_out)[0]
        full["mlp"] = mlp(x, forward_batch=fb)
        before = (attn.q_size, attn.num_heads, attn.attn.tp_k_head_num, attn.num_kv_heads)
        diffs, shared, copies = {}, True, True
        for m in DEGREES:
            parts = {"q": [], "k": [], "v": []}
            sums = {"o_proj": 0, "mlp": 0}
            for r in range(m):
                table = build_shards(model, m, r)
                shared = shared and all(shares_storage(v, f) for v, f in table.tensors())
                with tp_layers(table, reduce=lambda t: t, root=model):
                    # the TP state's copies of the layers (``shadow_layers``), reached as
                    # SGLang's forward reaches them
                    tp_layer = model.model.layers[1]
                    tp_attn, tp_mlp = tp_layer.self_attn, tp_layer.mlp
                    copies = copies and tp_attn is not attn and tp_mlp is not mlp
                    for key, t in zip("qkv", _prepare(tp_attn, positions, x), strict=True):
                        parts[key].append(t)
                    cols = attn_out.chunk(m, dim=-1)[r]
                    sums["o_proj"] = sums["o_proj"] + tp_attn.o_proj(cols)[0]
                    sums["mlp"] = sums["mlp"] + tp_mlp(x, forward_batch=fb)
            split, d = KvSplit(before[3], m), attn.head_dim
            diffs[str(m)] = {
                "q": float((torch.cat(parts["q"], dim=-1) - full["q"]).abs().max()),
                **{k: float((sums[k] - full[k]).abs().max()) for k in sums},
                **{  # each rank's k / v: the DP heads it holds (replicas alike)
                    k: max(
                        float((t - full[k][:, split.heads(r)[0] * d : split.heads(r)[-1] * d + d])
                              .abs().max())
                        for r, t in enumerate(parts[k])
                    )
                    for k in "kv"
                },
            }
    return {
        "classes": [type(model).__name__, type(attn).__name__, type(mlp).__name__],
        "bases": [c.__name__ for c in type(model).__mro__],
        "max_abs_diff": diffs,
        "views_share_storage": shared,
        "layer_copies": copies,
        "restored": before == (attn.q_size, attn.num_heads, attn.attn.tp_k_head_num,
                               attn.num_kv_heads)
        and "forward" not in vars(attn.qkv_proj) and "forward" not in vars(mlp.down_proj),
    }


def main(paths: dict[str, str]) -> None:
    import traceback

    init_engine(next(iter(paths.values())))
    out = {}
    for name, path in paths.items():
        try:
            out[name] = _check_family(path)
        except Exception:  # noqa: BLE001 - reported per family to the test
            out[name] = {"error": traceback.format_exc()[-3000:]}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
