"""The zero-copy views on CUDA tensors (bf16), where the GEMM libraries differ from CPU.

Skipped without a CUDA device (CI has none): run on a GPU host with
``python -m pytest -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

from flying.substrate import kv_adaptor
from flying.substrate.weight_views import build_shards, shares_storage, tp_layers
from tests.unit.test_views import H, Model, _pool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("m", [2, 4])
def test_cuda_views_share_storage_and_recompose_the_mlp(m):
    torch.manual_seed(0)
    model = Model().to("cuda", torch.bfloat16)
    mlp = model.layers[0]["m"]
    x = torch.randn(7, H, device="cuda", dtype=torch.bfloat16)
    full = mlp(x).float()
    before = torch.cuda.memory_allocated()
    parts = []
    for r in range(m):
        table = build_shards(model, m, r)
        assert all(shares_storage(v, f) for v, f in table.tensors())
        with tp_layers(table, reduce=lambda t: t):
            parts.append(mlp(x).float())
    # Each rank's partial sum is rounded to bf16 on its own (relative error 2^-8), and
    # partials of unit-variance weights are larger than their sum where they cancel:
    # bound the error by a few bf16 ulps of the terms, not of the result. A wrong view
    # (a shard's rows or columns misplaced) misses by the size of the terms themselves.
    total = sum(parts)
    scale = sum(p.abs() for p in parts) + full.abs()
    err = (total - full).abs()
    assert (err <= 4 * 2**-8 * scale + 1e-3).all(), (err / scale).max()
    assert (total - full).abs().mean() < 0.02 * full.abs().mean()
    assert torch.cuda.memory_allocated() - before < 1 << 20  # activations only


def test_cuda_kv_view_is_a_view():
    pool = _pool()
    pool.k_buffer = [b.cuda() for b in pool.k_buffer]
    pool.v_buffer = [b.cuda() for b in pool.v_buffer]
    tp = kv_adaptor.view_pool(pool, 2)
    for view, full in zip(tp.k_buffer, pool.k_buffer, strict=True):
        assert view.is_cuda and shares_storage(view, full)


@pytest.mark.parametrize("m", [2, 4])
def test_cuda_layer_copies_recompose_the_layer_without_weight_memory(m):
    """The TP state as one exchange of the layer list (``shadow_layers``) on CUDA bf16:
    the ranks' copies share every weight with the originals, allocate no weight memory,
    leave the originals untouched, and their partial outputs sum to the full layer."""
    from flying.substrate.toggle import entered
    from flying.substrate.weight_views import layer_toggle

    torch.manual_seed(1)
    model = Model(bias=True).to("cuda", torch.bfloat16)
    originals = model.layers
    x = torch.randn(7, H, device="cuda", dtype=torch.bfloat16)
    full = originals[0]["m"](x).float()
    before = torch.cuda.memory_allocated()
    parts = []
    for r in range(m):
        toggle = layer_toggle(build_shards(model, m, r), lambda t: t, root=model)
        assert len(toggle) == 1
        with entered(toggle):
            layer = model.layers[0]
            assert model.layers is not originals
            assert layer["m"].down_proj.weight is originals[0]["m"].down_proj.weight
            parts.append(layer["m"](x).float())
        assert model.layers is originals and "forward" not in vars(originals[0]["m"].down_proj)
    total, scale = sum(parts), sum(p.abs() for p in parts) + full.abs()
    assert ((total - full).abs() <= 4 * 2**-8 * scale + 1e-3).all()
    assert torch.cuda.memory_allocated() - before < 1 << 20  # activations only
