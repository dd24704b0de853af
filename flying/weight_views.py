"""Model Weights Manager: zero-copy TP shard views of an engine's full weights.

Each engine loads its full weights once (tp_size=1). For a TP group of degree m, member
rank r computes with *views* of those tensors; nothing is copied or reloaded:

- column-parallel (fused ``qkv_proj`` [(Hq+2Hkv)*d, hidden], fused ``gate_up_proj``
  [2I, hidden]): the rank's rows of each of q, k, v (gate, up) are contiguous row blocks,
  ``narrow(0, ...)``; one GEMM per block, outputs concatenated (activations only).
- row-parallel (``o_proj`` [hidden, Hq*d], ``down_proj`` [hidden, I]): ``narrow(1, ...)``
  is a strided view that GEMMs accept; bias added on rank 0 only; then the group's
  all-reduce. Flying reduces here itself because SGLang's own TP size stays 1, so its
  stage boundaries owe no sums (see ``comm_pool``'s docstring).
- embedding and lm_head stay replicated: every member computes full logits.

The mode switch is per module *instance* (an instance attribute ``forward`` shadows the
class's), entered and left by ``tp_layers()``, a context manager that always restores in
``finally``. DP mode is therefore the untouched SGLang code path, with zero overhead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

AllReduce = Callable[[torch.Tensor], torch.Tensor]


class UnsupportedModel(ValueError):
    pass


@dataclass
class AttentionShard:
    """Rank r's views for one attention module (Llama, Qwen2 with bias, Qwen3 q/k norm)."""

    module: nn.Module
    q_w: torch.Tensor  # [Hq*d/m, hidden] view
    k_w: torch.Tensor  # [Hkv*d/m, hidden] view
    v_w: torch.Tensor
    q_b: torch.Tensor | None
    k_b: torch.Tensor | None
    v_b: torch.Tensor | None
    o_w: torch.Tensor  # [hidden, Hq*d/m] strided view
    o_b: torch.Tensor | None  # only on rank 0


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
    w = getattr(linear, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise UnsupportedModel(
            f"{type(linear).__name__} has no plain 2-D weight (quantized layers are not "
            "supported by TP views yet)"
        )
    return w


def attention_shard(attn: nn.Module, m: int, r: int) -> AttentionShard:
    q, kv = attn.q_size, attn.kv_size  # full sizes: engines run at tp_size=1
    if q % m or kv % m or attn.num_kv_heads % m:
        raise UnsupportedModel(f"heads not divisible by TP degree {m}")
    qkv_w, o_w = _weight(attn.qkv_proj), _weight(attn.o_proj)
    qkv_b = getattr(attn.qkv_proj, "bias", None)
    o_b = getattr(attn.o_proj, "bias", None)
    qs, ks = q // m, kv // m
    return AttentionShard(
        module=attn,
        q_w=qkv_w.narrow(0, r * qs, qs),
        k_w=qkv_w.narrow(0, q + r * ks, ks),
        v_w=qkv_w.narrow(0, q + kv + r * ks, ks),
        q_b=_rows(qkv_b, r * qs, qs),
        k_b=_rows(qkv_b, q + r * ks, ks),
        v_b=_rows(qkv_b, q + kv + r * ks, ks),
        o_w=o_w.narrow(1, r * qs, qs),
        o_b=o_b if r == 0 else None,
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


def _qkv_forward(s: AttentionShard, x: torch.Tensor):
    out = torch.cat(
        [F.linear(x, s.q_w, s.q_b), F.linear(x, s.k_w, s.k_b), F.linear(x, s.v_w, s.v_b)],
        dim=-1,
    )
    return out, None


def _row_forward(w: torch.Tensor, b: torch.Tensor | None, reduce: AllReduce, x: torch.Tensor):
    out = F.linear(x, w)
    if b is not None:
        out = out + b
    return reduce(out), None


def _gate_up_forward(s: MlpShard, x: torch.Tensor):
    return torch.cat([F.linear(x, s.gate_w), F.linear(x, s.up_w)], dim=-1), None


@contextlib.contextmanager
def tp_layers(table: ShardTable, reduce: AllReduce) -> Iterator[None]:
    """Run the model's layers as TP rank ``table.rank`` of ``table.degree``.

    Sets per-instance forwards and head counts; restores all of them in ``finally``.
    """
    m = table.degree
    saved: list[tuple[object, str, object, bool]] = []

    def put(obj: object, name: str, value: object) -> None:
        had = name in vars(obj)
        saved.append((obj, name, vars(obj).get(name), had))
        setattr(obj, name, value)

    try:
        for s in table.attention:
            a = s.module
            put(a.qkv_proj, "forward", lambda x, s=s: _qkv_forward(s, x))
            put(a.o_proj, "forward", lambda x, s=s: _row_forward(s.o_w, s.o_b, reduce, x))
            for name in ("num_heads", "num_kv_heads", "q_size", "kv_size"):
                put(a, name, getattr(a, name) // m)
            for name in ("tp_q_head_num", "tp_k_head_num", "tp_v_head_num"):
                put(a.attn, name, getattr(a.attn, name) // m)
        for p in table.mlp:
            mod = p.module
            put(mod.gate_up_proj, "forward", lambda x, p=p: _gate_up_forward(p, x))
            put(mod.down_proj, "forward", lambda x, p=p: _row_forward(p.down_w, None, reduce, x))
            if getattr(mod, "dual_gemm", None) is not None:  # reads the full gate_up weight
                put(mod.dual_gemm, "mode", None)
        yield
    finally:
        for obj, name, old, had in reversed(saved):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
