"""Measure one GPU rank's share of a Llama 3 step, to check the first-principles profiles.

The GPU profiles (``workloads.sim.gpu_profile``) predict a step as ``overhead +
max(memory, compute) + all-reduces`` with assumed efficiencies. On one GPU the middle
term can be measured: a TP-``n`` rank runs the same kernels as a full model over
``1/n`` of the heads, the intermediate size and the vocabulary. This module runs that
shard with random bf16 weights (values do not change a kernel's time) and reports the
GPU time of one step, beside the formula's ``max(memory, compute)`` for the same shape.
The all-reduces (several GPUs) and the CPU's per-step work (SGLang's scheduler) are not
in it: they stay modelled.

What a step runs (per layer; shapes for ``b`` requests, ``h = heads / n``,
``k = max(kv_heads / n, 1)``, ``i = intermediate / n``, head size 128):

- decode: RMSNorm, QKV ``(b, hidden) x (hidden, (h + 2k) 128)``, attention of ``h`` query
  heads over each request's own cache ``(k, context, 128)`` (grouped: ``h / k`` queries per
  KV head, as a decode kernel reads it), O ``(b, h 128) x (h 128, hidden)``, RMSNorm,
  gate-up ``(b, hidden) x (hidden, 2 i)``, SiLU x up, down ``(b, i) x (i, hidden)``; then
  the final norm and the LM head ``(b, hidden) x (hidden, vocab / n)``. Captured once per
  batch size in a CUDA graph and replayed, as SGLang replays its decode graphs.
- prefill of ``T`` tokens: the same GEMMs over ``T`` rows and causal attention over
  prompts of ``min(T, 2048)`` tokens, eager (SGLang runs extends without graphs); the LM
  head only for each prompt's last token.

Every layer has its own weights and KV cache (no tensor shared between layers, so no
layer reads another's bytes from the L2 cache); RoPE and the residual adds are left out
(elementwise, a few percent of a decode step's bytes).

``python -m workloads.sim.gpu_measure --out FILE`` (needs CUDA; the GPU profiles are
built on a machine without one, from the file this writes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from workloads.sim.gpu_profile import BF16, LLAMA3_8B, LLAMA3_70B, Model

#: Decode batch sizes and prefill token counts measured (a subset of the profile's knots).
BATCHES = (1, 8, 32, 64, 128, 256)
TOKENS = (512, 2048, 8192)
#: Tokens in each request's cache while decoding, and the longest prompt of a prefill.
CONTEXT = 2208
PROMPT = 2048
#: Leave this much of the GPU's memory free (activations, the graph pool).
HEADROOM_BYTES = 12 << 30


@dataclass(frozen=True)
class Shard:
    """One TP rank's shapes of ``model`` at ``ranks`` ranks."""

    model: Model
    ranks: int

    @property
    def heads(self) -> int:
        return self.model.heads // self.ranks

    @property
    def kv_heads(self) -> int:
        return max(self.model.kv_heads // self.ranks, 1)

    @property
    def inter(self) -> int:
        return self.model.intermediate // self.ranks

    @property
    def vocab(self) -> int:
        return self.model.vocab // self.ranks

    def weight_bytes(self) -> int:
        m, d = self.model, self.model.head_dim
        layer = m.hidden * (self.heads + 2 * self.kv_heads) * d + self.heads * d * m.hidden \
            + 3 * m.hidden * self.inter
        return BF16 * (m.layers * layer + m.hidden * self.vocab)

    def kv_bytes(self, batch: int, context: int) -> int:
        return 2 * BF16 * self.model.layers * batch * context * self.kv_heads * \
            self.model.head_dim


class Layers:
    """The shard's weights: one set per layer, random bf16 (``(out, in)`` like nn.Linear)."""

    def __init__(self, shard: Shard, device: str) -> None:
        m, d = shard.model, shard.model.head_dim
        self.shard = shard

        def w(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, device=device, dtype=torch.bfloat16).normal_(0, 0.02)

        self.layers = [
            {"qkv": w((shard.heads + 2 * shard.kv_heads) * d, m.hidden),
             "o": w(m.hidden, shard.heads * d),
             "gate_up": w(2 * shard.inter, m.hidden),
             "down": w(m.hidden, shard.inter),
             "norm1": torch.ones(m.hidden, device=device, dtype=torch.bfloat16),
             "norm2": torch.ones(m.hidden, device=device, dtype=torch.bfloat16)}
            for _ in range(m.layers)
        ]
        self.head = w(shard.vocab, m.hidden)
        self.final_norm = torch.ones(m.hidden, device=device, dtype=torch.bfloat16)


def _norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """RMSNorm in one call (PyTorch's fused kernel on CUDA; SGLang fuses it too)."""
    return F.rms_norm(x, (x.shape[-1],), w, 1e-5)


def _mlp(x: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
    gate, up = F.linear(_norm(x, layer["norm2"]), layer["gate_up"]).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, layer["down"])


def decode_step(w: Layers, x: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
    """One decode step of ``b`` requests: ``x`` is ``(b, hidden)``, each cache
    ``(b, k, context, 128)``; returns the logits ``(b, vocab / n)``."""
    s, d = w.shard, w.shard.model.head_dim
    b = x.shape[0]
    group = s.heads // s.kv_heads
    for layer, (kc, vc) in zip(w.layers, caches, strict=True):
        qkv = F.linear(_norm(x, layer["norm1"]), layer["qkv"])
        q = qkv[:, : s.heads * d].view(b, s.kv_heads, group, d)
        out = F.scaled_dot_product_attention(q, kc, vc)  # (b, k, group, d)
        x = x + F.linear(out.reshape(b, s.heads * d), layer["o"])
        x = x + _mlp(x, layer)
    return F.linear(_norm(x, w.final_norm), w.head)


def prefill_step(w: Layers, x: torch.Tensor, prompt: int) -> torch.Tensor:
    """One extend of ``T`` new tokens: ``x`` is ``(T, hidden)``, prompts of ``prompt``
    tokens with causal attention; returns the logits of each prompt's last token."""
    s, d = w.shard, w.shard.model.head_dim
    t = x.shape[0]
    n = t // prompt
    for layer in w.layers:
        qkv = F.linear(_norm(x, layer["norm1"]), layer["qkv"])
        q, k, v = qkv.split([s.heads * d, s.kv_heads * d, s.kv_heads * d], dim=-1)
        q = q.view(n, prompt, s.heads, d).transpose(1, 2)
        k = k.view(n, prompt, s.kv_heads, d).transpose(1, 2)
        v = v.view(n, prompt, s.kv_heads, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + F.linear(out.transpose(1, 2).reshape(t, s.heads * d), layer["o"])
        x = x + _mlp(x, layer)
    last = x.view(n, prompt, -1)[:, -1]
    return F.linear(_norm(last, w.final_norm), w.head)


def _time_ms(fn, repeats: int) -> float:
    """Median GPU time of ``fn`` over ``repeats`` runs (CUDA events), after two warm-ups."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_decode(w: Layers, batch: int, repeats: int = 20) -> float:
    s, m = w.shard, w.shard.model
    caches = [(torch.empty(batch, s.kv_heads, CONTEXT, m.head_dim, device="cuda",
                           dtype=torch.bfloat16).normal_(),
               torch.empty(batch, s.kv_heads, CONTEXT, m.head_dim, device="cuda",
                           dtype=torch.bfloat16).normal_())
              for _ in range(m.layers)]
    x = torch.randn(batch, m.hidden, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_step(w, x, caches)  # warm the kernels' choice before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_step(w, x, caches)
    ms = _time_ms(graph.replay, repeats)
    del graph, caches
    torch.cuda.empty_cache()
    return ms


def measure_prefill(w: Layers, tokens: int, repeats: int = 5) -> tuple[float, str]:
    """The prefill's time, with the flash attention kernel where it takes the shapes
    (else PyTorch's choice, named in the result)."""
    x = torch.randn(tokens, w.shard.model.hidden, device="cuda", dtype=torch.bfloat16)
    step = lambda: prefill_step(w, x, min(tokens, PROMPT))  # noqa: E731
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return _time_ms(step, repeats), "flash"
    except RuntimeError:
        return _time_ms(step, repeats), "default"


def run(model: Model, ranks: int, free_bytes: int) -> dict:
    shard = Shard(model, ranks)
    if shard.weight_bytes() > free_bytes - HEADROOM_BYTES:
        return {"model": model.name, "ranks": ranks, "skipped": "weights do not fit"}
    t0 = time.perf_counter()
    w = Layers(shard, "cuda")
    torch.cuda.synchronize()
    row: dict = {"model": model.name, "ranks": ranks, "weight_bytes": shard.weight_bytes(),
                 "decode_context": CONTEXT, "prompt": PROMPT, "decode_ms": {}, "prefill_ms": {},
                 "kv_bytes": {}}
    budget = free_bytes - shard.weight_bytes() - HEADROOM_BYTES
    with torch.inference_mode():
        for b in BATCHES:
            if shard.kv_bytes(b, CONTEXT) > budget:
                continue
            row["decode_ms"][b] = round(measure_decode(w, b), 4)
            row["kv_bytes"][b] = shard.kv_bytes(b, CONTEXT)
        for t in TOKENS:
            ms, backend = measure_prefill(w, t)
            row["prefill_ms"][t] = round(ms, 4)
            row["prefill_attention"] = backend
    row["seconds"] = round(time.perf_counter() - t0, 1)
    del w
    torch.cuda.empty_cache()
    return row


#: (model, ranks) measured: one GPU of an 8B engine at TP-1/2/4/8, one of a 70B engine of
#: two GPUs (ranks 2) in a TP-1/2/4 group (ranks 2, 4, 8).
CASES = ((LLAMA3_8B, 1), (LLAMA3_8B, 2), (LLAMA3_8B, 4), (LLAMA3_8B, 8),
         (LLAMA3_70B, 2), (LLAMA3_70B, 4), (LLAMA3_70B, 8))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workloads.sim.gpu_measure",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_measure needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    result = {"device": props.name, "torch": torch.__version__,
              "memory_bytes": props.total_memory, "rows": []}
    for model, ranks in CASES:
        free, _ = torch.cuda.mem_get_info()
        row = run(model, ranks, free)
        row["device"] = props.name
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:  # keep what is done if a later case fails
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
