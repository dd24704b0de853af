"""Model Weights Manager: zero-copy TP shard views of an engine's full weights.

Each engine loads its full weights once (tp_size=1). For a TP group of degree m, member
rank r computes with *views* of those tensors; nothing is copied or reloaded:

- column-parallel (fused ``qkv_proj`` [(Hq+2Hkv)*d, hidden], fused ``gate_up_proj``
  [2I, hidden]): the rank's rows of each of q, k, v (gate, up) are contiguous row blocks,
  ``narrow(0, ...)``; one GEMM per block, outputs concatenated (activations only). With
  fewer KV heads than ranks (``H_kv < m``, ``m % H_kv == 0``) the k and v blocks are the
  one head ``r // (m/H_kv)``, the same rows on ``m/H_kv`` ranks (``layout.KvSplit``:
  SGLang's ``num_kv_head_replicas``); the rank's query heads all attend to that head.
- row-parallel (``o_proj`` [hidden, Hq*d], ``down_proj`` [hidden, I]): ``narrow(1, ...)``
  is a strided view that GEMMs accept; bias added on rank 0 only; then the group's
  all-reduce. Flying reduces here itself because SGLang's own TP size stays 1, so its
  stage boundaries owe no sums (see ``comm_pool``'s docstring).
- embedding and lm_head stay replicated: every member computes full logits.

The mode switch is per module *instance* (an instance attribute ``forward`` shadows the
class's), held by ``layer_toggle()`` (built once per degree, entered for TP steps and
left for DP steps; ``tp_layers()`` is the context-manager form that always restores in
``finally``). In an engine those instances are copies of the decoder layers, swapped in
as one attribute (``shadow_layers``), so entering costs one exchange whatever the depth
and the original modules are never written. DP mode is therefore the untouched SGLang
code path, with zero overhead.

The installed forwards keep SGLang's call contract for those layers, so every family's
model code calls them unchanged: column-parallel ``forward(input_)`` and row-parallel
``forward(input_, skip_all_reduce=False, forward_batch=None, output_tensor=None)``
(Qwen2/Qwen3's MLP passes ``forward_batch=`` to ``down_proj``), both returning
``(output, None)``. Families covered (tests/integration/test_model_families.py): Llama,
Mistral (SGLang's ``MistralForCausalLM`` *is* its ``LlamaForCausalLM``), Qwen2 (QKV
bias), Qwen3 (per-head q/k RMSNorm, applied by the attention forward to whatever heads
the QKV output holds, so the rank's heads are normalised exactly as in DP).

What the views refuse (``UnsupportedModel`` when the table is built, never mid-forward):
quantized or non-float weights, query heads not divisible by the degree, KV heads that
neither divide nor are divided by it, biases returned to the
caller (``skip_bias_add``), gathered column outputs, MLP biases, and q/k norms whose
weight spans more than one head (those need statistics over all heads: a reduction).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flying.substrate.layout import KvSplit
from flying.substrate.shadow_layers import shadow
from flying.substrate.toggle import Toggle, entered

AllReduce = Callable[[torch.Tensor], torch.Tensor]


class UnsupportedModel(ValueError):
    pass


@dataclass
class AttentionShard:
    """Rank r's views for one attention module (Llama, Qwen2 with bias, Qwen3 q/k norm)."""

    module: nn.Module
    q_w: torch.Tensor  # [Hq*d/m, hidden] view
    k_w: torch.Tensor  # [Hkv*d/m, hidden] view (one head's rows when replicated)
    v_w: torch.Tensor
    q_b: torch.Tensor | None
    k_b: torch.Tensor | None
    v_b: torch.Tensor | None
    o_w: torch.Tensor  # [hidden, Hq*d/m] strided view
    o_b: torch.Tensor | None  # only on rank 0
    #: distinct KV head groups of the degree (``KvSplit.shards``): m, or H_kv when each
    #: head is replicated; k_w / v_w are [Hkv*d/kv_shards, hidden]
    kv_shards: int


@dataclass
class MlpShard:
    module: nn.Module
    gate_w: torch.Tensor  # [I/m, hidden] view
    up_w: torch.Tensor
    down_w: torch.Tensor  # [hidden, I/m] strided view


def _rows(t: torch.Tensor | None, start: int, length: int) -> torch.Tensor | None:
    return None if t is None else t.narrow(0, start, length)


def _is_attention(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("qkv_proj", "o_proj", "attn", "q_size", "kv_size"))


def _is_mlp(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("gate_up_proj", "down_proj", "act_fn"))


def _weight(linear: nn.Module) -> torch.Tensor:
    """The layer's plain float [out, in] weight, after checking that the views' forward
    computes what SGLang's would (same bias handling, no quantization, no gather)."""
    w = getattr(linear, "weight", None)
    method = type(getattr(linear, "quant_method", None)).__name__
    if (
        not isinstance(w, torch.Tensor)
        or w.dim() != 2
        or not w.is_floating_point()
        or method not in ("UnquantizedLinearMethod", "NoneType")
    ):
        raise UnsupportedModel(
            f"{type(linear).__name__} has no plain 2-D float weight ({method}): quantized "
            "layers are not supported by TP views yet"
        )
    if getattr(linear, "skip_bias_add", False) or getattr(linear, "gather_output", False):
        raise UnsupportedModel(f"{type(linear).__name__}: skip_bias_add / gather_output")
    if getattr(linear, "input_is_parallel", True) is False:
        raise UnsupportedModel(f"{type(linear).__name__}: input_is_parallel=False")
    return w


def _check_qk_norms(attn: nn.Module) -> None:
    """Per-head q/k norms (Qwen3: weight [head_dim]) act on each head alone, so a rank
    that holds a subset of the heads normalises them exactly as DP does. A norm over all
    heads (weight [H*d]) would need the other ranks' heads: refused."""
    head_dim = getattr(attn, "head_dim", None)
    for name in ("q_norm", "k_norm"):
        w = getattr(getattr(attn, name, None), "weight", None)
        if isinstance(w, torch.Tensor) and w.numel() != head_dim:
            raise UnsupportedModel(
                f"{type(attn).__name__}.{name} spans {w.numel()} features, not one head "
                f"({head_dim}): it needs a reduction over the group"
            )


def attention_shard(attn: nn.Module, m: int, r: int) -> AttentionShard:
    """Rank r's rows of q (heads ``[r*H_q/m, (r+1)*H_q/m)``) and of k and v (the heads
    ``KvSplit(H_kv, m).heads(r)``: split, or one head replicated on ``m/H_kv`` ranks,
    as SGLang's ``QKVParallelLinear`` loads them), and its o_proj columns (its query
    heads' outputs)."""
    q, kv = attn.q_size, attn.kv_size  # full sizes: engines run at tp_size=1
    if attn.num_heads % m:
        raise UnsupportedModel(f"{attn.num_heads} query heads not divisible by TP degree {m}")
    try:
        split = KvSplit(attn.num_kv_heads, m)
    except ValueError as exc:
        raise UnsupportedModel(str(exc)) from None
    _check_qk_norms(attn)
    qkv_w, o_w = _weight(attn.qkv_proj), _weight(attn.o_proj)
    qkv_b = getattr(attn.qkv_proj, "bias", None)
    o_b = getattr(attn.o_proj, "bias", None)
    qs, ks = q // m, kv // split.shards
    k0 = split.shard(r) * ks  # this rank's first k (and v) row
    return AttentionShard(
        module=attn,
        q_w=qkv_w.narrow(0, r * qs, qs),
        k_w=qkv_w.narrow(0, q + k0, ks),
        v_w=qkv_w.narrow(0, q + kv + k0, ks),
        q_b=_rows(qkv_b, r * qs, qs),
        k_b=_rows(qkv_b, q + k0, ks),
        v_b=_rows(qkv_b, q + kv + k0, ks),
        o_w=o_w.narrow(1, r * qs, qs),
        o_b=o_b if r == 0 else None,
        kv_shards=split.shards,
    )


def mlp_shard(mlp: nn.Module, m: int, r: int) -> MlpShard:
    gu, down = _weight(mlp.gate_up_proj), _weight(mlp.down_proj)
    inter = gu.shape[0] // 2
    if inter % m:
        raise UnsupportedModel(f"intermediate size {inter} not divisible by {m}")
    s = inter // m
    if getattr(mlp.gate_up_proj, "bias", None) is not None or getattr(
        mlp.down_proj, "bias", None
    ) is not None:
        raise UnsupportedModel("MLP biases are not supported by TP views yet")
    return MlpShard(
        module=mlp,
        gate_w=gu.narrow(0, r * s, s),
        up_w=gu.narrow(0, inter + r * s, s),
        down_w=down.narrow(1, r * s, s),
    )


@dataclass
class ShardTable:
    """All views of one model for one (degree, rank)."""

    degree: int
    rank: int
    attention: list[AttentionShard]
    mlp: list[MlpShard]

    def tensors(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(view, full weight) pairs, for zero-copy checks."""
        for a in self.attention:
            full_qkv, full_o = a.module.qkv_proj.weight, a.module.o_proj.weight
            yield from ((a.q_w, full_qkv), (a.k_w, full_qkv), (a.v_w, full_qkv))
            yield a.o_w, full_o
        for p in self.mlp:
            yield p.gate_w, p.module.gate_up_proj.weight
            yield p.up_w, p.module.gate_up_proj.weight
            yield p.down_w, p.module.down_proj.weight


def build_shards(model: nn.Module, degree: int, rank: int) -> ShardTable:
    attention = [attention_shard(mod, degree, rank) for mod in model.modules() if _is_attention(mod)]
    mlp = [mlp_shard(mod, degree, rank) for mod in model.modules() if _is_mlp(mod)]
    if not attention or not mlp:
        raise UnsupportedModel(
            f"{type(model).__name__}: no Llama-style attention/MLP modules found"
        )
    return ShardTable(degree, rank, attention, mlp)


def shares_storage(view: torch.Tensor, full: torch.Tensor) -> bool:
    """True if ``view``'s data lies inside ``full``'s storage (no copy was made)."""
    base = full.untyped_storage().data_ptr()
    end = base + full.untyped_storage().nbytes()
    return base <= view.data_ptr() < end and view.untyped_storage().data_ptr() == base


# -- TP-mode forwards (bound per instance) ----------------------------------------


class _QkvView:
    """``qkv_proj.forward`` in TP mode; SGLang's column-parallel contract
    ``forward(input_) -> (output, None)``.

    ``input_``: [T, hidden] -> output [T, (Hq + 2*Hkv) * d / m], this rank's q, k and v
    heads side by side, which is the layout the attention forward splits with the
    divided ``q_size`` / ``kv_size``. QKV bias rows (Qwen2, attention_bias) are the
    rank's own, added by every rank (column layers own their output rows).
    """

    def __init__(self, shard: AttentionShard) -> None:
        self.s = shard

    def __call__(self, input_: torch.Tensor) -> tuple[torch.Tensor, None]:
        s = self.s
        parts = [F.linear(input_, s.q_w, s.q_b), F.linear(input_, s.k_w, s.k_b),
                 F.linear(input_, s.v_w, s.v_b)]
        return torch.cat(parts, dim=-1), None


class _GateUpView:
    """``gate_up_proj.forward`` in TP mode: [T, hidden] -> [T, 2*I/m] (gate rows, then
    up rows, as ``SiluAndMul`` expects); returns ``(output, None)``."""

    def __init__(self, shard: MlpShard) -> None:
        self.s = shard

    def __call__(self, input_: torch.Tensor) -> tuple[torch.Tensor, None]:
        s = self.s
        return torch.cat([F.linear(input_, s.gate_w), F.linear(input_, s.up_w)], dim=-1), None


class _RowView:
    """``o_proj`` / ``down_proj.forward`` in TP mode, with SGLang's row-parallel
    signature ``forward(input_, skip_all_reduce=False, forward_batch=None,
    output_tensor=None) -> (output, None)``.

    ``input_``: [T, K/m], the rank's columns -> [T, hidden], summed over the group.
    ``skip_all_reduce`` is accepted and ignored: a caller sets it when SGLang's own TP
    group will reduce later, but that group has size 1 here (engines run tp_size=1), so
    the group's sum must happen in this layer or nowhere. ``forward_batch`` only selects
    SGLang's quantized communication, which the views never use. ``output_tensor``, if
    given, receives the result and is returned (SGLang's caller-owned output).
    """

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, reduce: AllReduce) -> None:
        self.w, self.b, self.reduce = w, b, reduce

    def __call__(
        self,
        input_: torch.Tensor,
        skip_all_reduce: bool = False,
        forward_batch: object = None,
        output_tensor: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        out = F.linear(input_, self.w)
        if self.b is not None:  # rank 0 only: the sum adds it once
            out = out + self.b
        out = self.reduce(out)
        if output_tensor is not None:
            output_tensor.copy_(out)
            out = output_tensor
        return out, None


def layer_toggle(table: ShardTable, reduce: AllReduce, root: nn.Module | None = None) -> Toggle:
    """The toggle that runs the model's layers as TP rank ``table.rank`` of
    ``table.degree``: per-instance forwards (the views) and per-rank head counts.
    Built once per degree. With the model's ``root``, the layers' TP copies swapped as
    one attribute (``shadow_layers``: one exchange per enter, where the original objects
    take ~11 per layer), unless the entries do not all lie under one layer list."""
    entries = layer_entries(table, reduce)
    one = shadow(root, entries) if root is not None else None
    return Toggle([one] if one is not None else entries)


def layer_entries(table: ShardTable, reduce: AllReduce) -> list[tuple[object, str, object]]:
    """(object, attribute, TP value) for every module attribute the TP state changes."""
    m = table.degree
    out: list[tuple[object, str, object]] = []
    for s in table.attention:
        a = s.module
        out.append((a.qkv_proj, "forward", _QkvView(s)))
        out.append((a.o_proj, "forward", _RowView(s.o_w, s.o_b, reduce)))
        for name in ("num_heads", "q_size"):
            out.append((a, name, getattr(a, name) // m))
        for name in ("num_kv_heads", "kv_size"):  # replicated heads: 1 per rank
            out.append((a, name, getattr(a, name) // s.kv_shards))
        out.append((a.attn, "tp_q_head_num", a.attn.tp_q_head_num // m))
        for name in ("tp_k_head_num", "tp_v_head_num"):
            out.append((a.attn, name, getattr(a.attn, name) // s.kv_shards))
    for p in table.mlp:
        mod = p.module
        out.append((mod.gate_up_proj, "forward", _GateUpView(p)))
        out.append((mod.down_proj, "forward", _RowView(p.down_w, None, reduce)))
        # Both bypass gate_up_proj / down_proj's forward with the full weights: the
        # fused dual GEMM (mode None = off) and the FP8 decode activation (which
        # would hand down_proj a quantized tuple; off unless the layer is FP8).
        if getattr(mod, "dual_gemm", None) is not None:
            out.append((mod.dual_gemm, "mode", None))
        if getattr(mod, "activation_quant", None) is not None:
            out.append((mod.activation_quant, "enabled", False))
    return out


def tp_layers(table: ShardTable, reduce: AllReduce, root: nn.Module | None = None):
    """Context manager: the layers as TP rank ``table.rank`` for the block, restored in
    ``finally`` (``layer_toggle`` entered once)."""
    return entered(layer_toggle(table, reduce, root))
