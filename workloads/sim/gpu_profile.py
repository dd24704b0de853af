"""First-principles cost profiles of GPU nodes: Llama 3 on H100 SXM and H200.

No GPU has run Flying's groups (README: "never run on a GPU yet"), so these profiles are
what the hardware's published figures and the model's shapes imply, with the
efficiency factors marked as assumptions. Per step, on ``n`` GPUs (a TP-m group of
engines of ``g`` GPUs each: ``n = m g``):

- decode of ``b`` requests: ``overhead + max(bytes / (HBM bandwidth x eff),
  FLOPs / (peak x mfu)) + all-reduces``, where bytes are the weights (without the
  embedding table, of which a step reads one row per request) split n ways plus the
  KV the batch reads (``b x context x KV bytes per token``, split over the KV heads'
  shards), and FLOPs are ``2 x matmul parameters + 4 x layers x context x q width``
  per request;
- prefill (extend) of ``T`` new tokens: ``overhead + max(FLOPs / (peak x mfu),
  weight and KV-write bytes / bandwidth) + all-reduces``, the attention's quadratic
  term over prompts of ``prefill_sequence`` tokens;
- all-reduces: two per layer (after attention and after the MLP), each the ring
  formula ``latency + 2 (n-1)/n x bytes / bus bandwidth`` of ``tokens x hidden x 2``
  bytes, over NVLink at its per-direction bandwidth times an efficiency;
- KV tokens per engine: ``(g x HBM x mem fraction - weights) / KV bytes per token``;
- a move to DP per 1k tokens of context: the KV bytes of 1k tokens over NVLink (the
  measured profiles add one GPU's gather and write, timed with Flying's relayout code:
  a fixed part per move and a part per 1k tokens).

``python -m workloads.sim.gpu_profile [--out DIR]`` writes the profiles shipped in
``workloads/sim/profiles/`` (every constant with its source, every assumption
flagged); the simulator never reads this module, only the files.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from flying.substrate.layout import allowed_degrees
from scheduler.costs import Costs, Curve
from scheduler.layout_choice import SwitchCosts
from workloads.sim.gpu_calibrate import (
    MEASURED_DIR,
    RELAYOUT_DIR,
    Measured,
    calibrated,
    load_measured,
    relayout_fit,
)
from workloads.sim.profile import PROFILES_DIR, Profile

#: GPUs on one node (an HGX H100 / H200 board).
NODE_GPUS = 8
BF16 = 2  # bytes


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    bf16_flops: float  # dense, FLOP/s
    nvlink_bw: float  # bytes/s, both directions together
    source: str


H100_SXM = Gpu("H100 SXM", 80e9, 3.35e12, 989e12, 900e9,
               "NVIDIA H100 Tensor Core GPU datasheet, SXM5: 80 GB HBM3, 3.35 TB/s, "
               "989 TFLOPS dense BF16 (1,979 with sparsity), NVLink 900 GB/s")
H200 = Gpu("H200 SXM", 141e9, 4.8e12, 989e12, 900e9,
           "NVIDIA H200 Tensor Core GPU datasheet, SXM: 141 GB HBM3e, 4.8 TB/s, "
           "989 TFLOPS dense BF16, NVLink 900 GB/s")


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    context: int
    source: str

    @property
    def embedding(self) -> int:
        return self.vocab * self.hidden

    @property
    def layer_params(self) -> int:
        q = self.heads * self.head_dim
        kv = 2 * self.kv_heads * self.head_dim
        return self.hidden * (q + kv) + q * self.hidden + 3 * self.hidden * self.intermediate \
            + 2 * self.hidden

    @property
    def params(self) -> int:
        """Every parameter (untied embedding and LM head, as in Llama 3)."""
        return self.layers * self.layer_params + 2 * self.embedding + self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16


LLAMA3_8B = Model("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, 8192,
                  "meta-llama/Meta-Llama-3-8B config.json: 32 layers, hidden 4096, 32 heads, "
                  "8 KV heads, intermediate 14336, vocab 128256, 8192 positions")
LLAMA3_70B = Model("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256, 8192,
                   "meta-llama/Meta-Llama-3-70B config.json: 80 layers, hidden 8192, 64 heads, "
                   "8 KV heads, intermediate 28672, vocab 128256, 8192 positions")


@dataclass(frozen=True)
class Assumed:
    """The efficiency factors and workload shape: assumptions, not measurements."""

    hbm_efficiency: float = 0.8  # achieved share of HBM bandwidth in decode's reads
    mfu_prefill: float = 0.6  # achieved share of dense BF16 peak in prefill GEMMs
    mfu_decode: float = 0.5  # the same for decode's (compute-bound only at large batch)
    nvlink_efficiency: float = 0.8  # all-reduce bus bandwidth / NVLink per direction
    allreduce_latency_s: float = 8e-6  # per all-reduce of a small message
    step_overhead_s: float = 0.3e-3  # scheduling, sampling, launches (CUDA graphs)
    mem_fraction: float = 0.85  # SGLang's --mem-fraction-static: weights + KV
    decode_context: int = 2208  # tokens in context while decoding (paper preset)
    prefill_sequence: int = 2064  # tokens per prompt of an extend step (paper preset)
    bind_ms: float = 2.0  # bind -> first group step


ASSUMED_WHY = {
    "hbm_efficiency": "decode GEMV and attention kernels reach about 80 % of HBM bandwidth",
    "mfu_prefill": "large BF16 GEMMs reach about 60 % of the dense peak end to end",
    "mfu_decode": "decode GEMMs are small and reach less of the peak",
    "nvlink_efficiency": "NCCL / custom all-reduce bus bandwidth about 80 % of NVLink's "
                         "450 GB/s per direction",
    "allreduce_latency_s": "small-message all-reduce latency on NVLink, order of 5-10 us",
    "step_overhead_s": "SGLang's per-step CPU work with CUDA graphs, order of 0.1-1 ms",
    "mem_fraction": "SGLang's static memory fraction on an 80-141 GB GPU, about 0.85-0.9",
    "decode_context": "the paper preset's mean prompt (2064) + half its mean output (288)",
    "prefill_sequence": "the paper preset's mean prompt: the quadratic attention term",
    "bind_ms": "the CPU demo's measured bind (SwitchCosts' default); GPU groups never ran",
}


def _allreduce_s(nbytes: float, ranks: int, gpu: Gpu, a: Assumed) -> float:
    if ranks <= 1:
        return 0.0
    bus = gpu.nvlink_bw / 2 * a.nvlink_efficiency
    return a.allreduce_latency_s + 2 * (ranks - 1) / ranks * nbytes / bus


def _kv_share(model: Model, ranks: int) -> float:
    """The share of a token's KV one rank holds (heads split, or one replicated)."""
    return 1.0 / min(ranks, model.kv_heads)


def decode_kernels_ms(gpu: Gpu, model: Model, a: Assumed, ranks: int, batch: int) -> float:
    """One rank's GPU time of a decode step: ``max(memory, compute)``."""
    weights = (model.params - model.embedding) * BF16 / ranks
    kv = batch * a.decode_context * model.kv_bytes_per_token * _kv_share(model, ranks)
    memory = (weights + kv) / (gpu.hbm_bw * a.hbm_efficiency)
    per_token = 2 * (model.params - model.embedding) \
        + 4 * model.layers * a.decode_context * model.heads * model.head_dim
    compute = batch * per_token / ranks / (gpu.bf16_flops * a.mfu_decode)
    return 1000 * max(memory, compute)


def prefill_kernels_ms(gpu: Gpu, model: Model, a: Assumed, ranks: int, tokens: int) -> float:
    """One rank's GPU time of an extend of ``tokens`` new tokens: ``max(compute, memory)``."""
    seq = min(tokens, a.prefill_sequence)
    matmul = 2 * (model.params - 2 * model.embedding) * tokens
    attention = 2 * model.layers * tokens * seq * model.heads * model.head_dim
    head = 2 * model.embedding * math.ceil(tokens / seq)  # logits of each prompt's last token
    compute = (matmul + attention + head) / ranks / (gpu.bf16_flops * a.mfu_prefill)
    written = tokens * model.kv_bytes_per_token * _kv_share(model, ranks)
    memory = ((model.params - model.embedding) * BF16 / ranks + written) \
        / (gpu.hbm_bw * a.hbm_efficiency)
    return 1000 * max(compute, memory)


def _comm_ms(gpu: Gpu, model: Model, a: Assumed, ranks: int, tokens: int) -> float:
    return 1000 * 2 * model.layers * _allreduce_s(tokens * model.hidden * BF16, ranks, gpu, a)


def decode_ms(gpu: Gpu, model: Model, a: Assumed, ranks: int, batch: int,
              kernels: Measured | None = None) -> float:
    """A decode step on ``ranks`` GPUs: overhead + one rank's kernels + all-reduces; the
    kernels from ``kernels`` (measured on a GPU) where given, else the formula."""
    ms = decode_kernels_ms(gpu, model, a, ranks, batch)
    if kernels is not None:
        ms = calibrated(lambda b: decode_kernels_ms(gpu, model, a, ranks, b),
                        kernels.decode, batch)
    return 1000 * a.step_overhead_s + ms + _comm_ms(gpu, model, a, ranks, batch)


def prefill_ms(gpu: Gpu, model: Model, a: Assumed, ranks: int, tokens: int,
               kernels: Measured | None = None) -> float:
    """An extend step on ``ranks`` GPUs, as ``decode_ms``."""
    ms = prefill_kernels_ms(gpu, model, a, ranks, tokens)
    if kernels is not None:
        ms = calibrated(lambda t: prefill_kernels_ms(gpu, model, a, ranks, t),
                        kernels.prefill, tokens)
    return 1000 * a.step_overhead_s + ms + _comm_ms(gpu, model, a, ranks, tokens)


def gpus_per_engine(gpu: Gpu, model: Model) -> int:
    """GPUs one engine needs: the smallest power of two whose memory holds the weights
    in at most 70 % of it (the rest is KV and activations)."""
    g = 1
    while model.params * BF16 > 0.7 * g * gpu.hbm_bytes:
        g *= 2
    return g


BATCHES = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CHUNK = 8192  # SGLang's chunked-prefill size on a GPU (tokens per extend step)
TOKENS = tuple(1 << k for k in range(4, 15))  # 16 .. 16384


def build(name: str, gpu: Gpu, model: Model, a: Assumed = Assumed(),
          measured: str | None = None) -> Profile:
    """The profile of ``model`` on a node of 8 ``gpu``; with ``measured`` (a file in
    ``MEASURED_DIR`` from ``gpu_measure``) each rank's kernels are that measurement's
    (``gpu_calibrate``), the overhead and all-reduces still the formula's."""
    g = gpus_per_engine(gpu, model)
    engines = NODE_GPUS // g
    weights = model.params * BF16
    kv_tokens = int((g * gpu.hbm_bytes * a.mem_fraction - weights) / model.kv_bytes_per_token)
    max_running = max(min(int(kv_tokens / model.context * 512), 4096), 2048)
    degrees = tuple(allowed_degrees(engines, model.kv_heads, model.heads))
    kernels: dict[int, Measured | None] = dict.fromkeys((1, *degrees))
    device = None
    if measured is not None:
        device, rows = load_measured(MEASURED_DIR / measured)
        kernels = {m: rows[(model.name, m * g)] for m in kernels}
    curves = {
        m: Curve.of([(b, decode_ms(gpu, model, a, m * g, b, kernels[m])) for b in BATCHES],
                    [(t, prefill_ms(gpu, model, a, m * g, t, kernels[m])) for t in TOKENS])
        for m in (1, *degrees)
    }
    costs = Costs({m: round(c.decode[0][1], 4) for m, c in curves.items()},
                  {m: Curve.of([(x, round(y, 4)) for x, y in c.decode],
                               [(x, round(y, 4)) for x, y in c.prefill])
                   for m, c in curves.items()})
    move = 1000 * model.kv_bytes_per_token / (gpu.nvlink_bw / 2 * a.nvlink_efficiency) * 1000
    move_fixed = 0.0
    constants = {
        "gpu": {**{k: v for k, v in asdict(gpu).items() if k != "source"},
                "units": "bytes, bytes/s, FLOP/s", "source": gpu.source},
        "model": {**{k: v for k, v in asdict(model).items() if k != "source"},
                  "params": model.params, "kv_bytes_per_token": model.kv_bytes_per_token,
                  "dtype": "bf16", "source": model.source},
        "gpus_per_engine": {"value": g, "source": "weights (bf16) within 70 % of the "
                            "engine's HBM; an engine of more than one GPU is SGLang's own "
                            "TP inside the engine, which Flying does not run today"},
        "chunked_prefill_tokens": {"value": CHUNK, "source": "SGLang 0.5.23's default "
                                   "--chunked-prefill-size for GPUs of 60-160 GiB "
                                   "(arg_groups/memory_hook.py: H100, H200)"},
        "max_running_requests": {"value": max_running, "source": "SGLang 0.5.23 "
                                 "resolve_max_num_reqs: KV / context x 512 within [2048, 4096]"},
        "overlap": {"value": False, "source": "SGLang's overlap loop launches step N+1 on "
                    "the forward stream and processes step N's result when its copy is "
                    "done, during step N+1: a token is not held one step (the delay of CPU "
                    "engines, whose forward runs inside the launch)"},
        "frontend_ms": {"value": 0.0, "assumption": True, "source": "unknown: HTTP, "
                        "tokenization, dispatch, detokenization and streaming on a GPU "
                        "node's host are not modelled (8-9 ms on the 2-core CPU machine)"},
        **{k: {"value": v, "assumption": True, "source": ASSUMED_WHY[k]}
           for k, v in asdict(a).items()},
    }
    first = "simulated, not measured: Flying's groups have never run on a GPU"
    if measured is not None:
        constants["kernels"] = {
            "value": f"gpu-shard-steps/{measured}",
            "source": f"one rank's kernels timed on one {device} by workloads.sim.gpu_measure "
                      "(PyTorch kernels with CUDA graphs for decode, not SGLang's), in place "
                      "of max(memory, compute) and the efficiencies above; all-reduces and "
                      "the step overhead still modelled"}
        where, move_fixed, slope = relayout_fit(RELAYOUT_DIR / measured, model.name)
        move += slope
        constants["relayout"] = {
            "value": {"move_ms": round(move_fixed, 4), "ms_per_ktok": round(slope, 4)},
            "source": f"gpu-relayout/{measured}: Flying's kv_relayout gather and "
                      f"write timed on one {where} by workloads.sim.gpu_relayout (a line "
                      "through 1k and 4k tokens at TP-2/4/8; launch-bound: the fixed part is "
                      "a gather and a write per layer and buffer), added to the NVLink term"}
        first = (f"simulated: one GPU's kernels measured on a {device}, all-reduces over "
                 "NVLink and the scheduler's overhead modelled; Flying's groups have never "
                 "run on a GPU")
    return Profile(
        name=name, costs=costs, switch=SwitchCosts(a.bind_ms, round(move, 4), round(move_fixed, 4)),
        kv_tokens=kv_tokens, degrees=degrees, max_engines=engines,
        context_len=model.context, kv_heads=model.kv_heads, heads=model.heads,
        chunk_tokens=CHUNK, max_running=max_running, overlap=False, frontend_ms=0.0,
        kind="first-principles",
        source=f"workloads.sim.gpu_profile: {model.name} bf16 on {engines} engines of {g} "
               f"{gpu.name} ({NODE_GPUS} GPUs)",
        constants=constants,
        assumptions=(
            first,
            "step costs depend on batch size and new tokens only, at a fixed context "
            f"({a.decode_context} tokens decoding, {a.prefill_sequence}-token prompts)",
            "decode batches above SGLang's CUDA-graph limit (256 at TP < 4) cost what the "
            "formula says, not an eager step's extra launch overhead",
            "every efficiency factor marked assumption above",
        ),
    )


#: name -> (GPU, model, measured file or None: its kernels in ``MEASURED_DIR``, its
#: relayout in ``RELAYOUT_DIR``, by the same name).
PROFILES: dict[str, tuple[Gpu, Model, str | None]] = {
    "h100-llama3-8b": (H100_SXM, LLAMA3_8B, None),
    "h200-llama3-8b": (H200, LLAMA3_8B, None),
    "h200-llama3-70b": (H200, LLAMA3_70B, None),
    "h100-llama3-8b-measured": (H100_SXM, LLAMA3_8B, "h100.json"),
    "h200-llama3-8b-measured": (H200, LLAMA3_8B, "h200.json"),
    "h200-llama3-70b-measured": (H200, LLAMA3_70B, "h200.json"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workloads.sim.gpu_profile",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(PROFILES_DIR), help="directory to write into")
    parser.add_argument("--only", choices=sorted(PROFILES), help="one profile only")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, (gpu, model, measured) in PROFILES.items():
        if args.only and name != args.only:
            continue
        profile = build(name, gpu, model, measured=measured)
        profile.save(out / f"{name}.json")
        c = profile.costs
        print(f"{name}: {profile.max_engines} engines, degrees {list(profile.degrees)}, "
              f"KV {profile.kv_tokens} tokens/engine; decode b=1 "
              + ", ".join(f"TP{m} {c.decode(m, 1):.2f} ms" for m in (1, *profile.degrees))
              + "; prefill 2048 tok "
              + ", ".join(f"TP{m} {c.prefill(m, 2048):.1f} ms" for m in (1, *profile.degrees)))


if __name__ == "__main__":
    main()
